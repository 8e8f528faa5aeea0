"""The shapes of serving requests: JSON bodies checked field by field (`QueryError` names the
field and the reason; the server answers it with HTTP 400).

Ids are JSON integers, or strings for a run of string ids (the served state checks which);
times are numbers, one per row or one for all rows. A batch holds at most `MAX_ROWS` rows.
"""

from __future__ import annotations

from tidegraph.serving.engine import QueryError

__all__ = ["MAX_ROWS", "parse_embed", "parse_score", "parse_tgb", "parse_topk"]

MAX_ROWS = 100_000


def _body(body) -> dict:
    if not isinstance(body, dict):
        raise QueryError(f"body: a JSON object expected, got {type(body).__name__}")
    return body


def _field(body: dict, name: str):
    if name not in body:
        raise QueryError(f"{name}: missing")
    return body[name]


def _ids(body: dict, name: str) -> list:
    value = _field(body, name)
    if not isinstance(value, list):
        raise QueryError(f"{name}: a list of node ids expected, got {type(value).__name__}")
    if not value:
        raise QueryError(f"{name}: empty")
    if len(value) > MAX_ROWS:
        raise QueryError(f"{name}: {len(value)} ids, at most {MAX_ROWS} a request")
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, int | str):
            raise QueryError(f"{name}[{i}]: a node id (integer or string) expected, got {x!r}")
    return value


def _number(x, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise QueryError(f"{name}: a number expected, got {x!r}")
    try:
        return float(x)
    except OverflowError:
        raise QueryError(f"{name}: {str(x)[:20]}... is out of range") from None


def _times(body: dict, n: int) -> list[float] | float:
    value = _field(body, "t")
    if isinstance(value, list):
        if len(value) != n:
            raise QueryError(f"t: {len(value)} times for {n} rows (give one per row, or one)")
        return [_number(x, f"t[{i}]") for i, x in enumerate(value)]
    return _number(value, "t")


def parse_score(body) -> tuple[list, list, list[float] | float]:
    body = _body(body)
    src, dst = _ids(body, "src"), _ids(body, "dst")
    if len(src) != len(dst):
        raise QueryError(f"dst: {len(dst)} ids for {len(src)} src ids")
    return src, dst, _times(body, len(src))


def parse_topk(body) -> tuple[int | str, float, int, list | str | None]:
    """(src, t, k, candidates): a list of ids, None (every destination seen) or "tgb" (the
    true destination `dst` and TGB's hist_rnd negatives of it: `parse_tgb`)."""
    body = _body(body)
    src = _field(body, "src")
    if isinstance(src, bool) or not isinstance(src, int | str):
        raise QueryError(f"src: one node id (integer or string) expected, got {src!r}")
    t = _number(_field(body, "t"), "t")
    k = _field(body, "k")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise QueryError(f"k: a positive integer expected, got {k!r}")
    if body.get("candidates") == "tgb":
        return src, t, k, "tgb"
    candidates = _ids(body, "candidates") if body.get("candidates") is not None else None
    if candidates is not None and k > len(set(candidates)):
        raise QueryError(f"k: {k} is more than the {len(set(candidates))} candidates")
    return src, t, k, candidates


def parse_tgb(body) -> tuple[int | str, int | None, int]:
    """A `/topk` under TGB's protocol (`"candidates": "tgb"`): (dst, negatives, seed): the
    true destination whose rank is asked, how many negatives (None: the run's
    `eval.negatives`), the draw's seed (default 0)."""
    body = _body(body)
    dst = _field(body, "dst")
    if isinstance(dst, bool) or not isinstance(dst, int | str):
        raise QueryError(f"dst: one node id (integer or string) expected, got {dst!r}")
    out = []
    for name, low in (("negatives", 1), ("seed", 0)):
        x = body.get(name)
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or not
                              low <= x < 1 << 63):  # fmt: skip
            raise QueryError(f"{name}: an integer in [{low}, 2**63) expected, got {x!r}")
        out.append(x)
    if out[0] is not None and out[0] > MAX_ROWS:
        raise QueryError(f"negatives: {out[0]}, at most {MAX_ROWS} a request")
    return dst, out[0], out[1] or 0


def parse_embed(body) -> tuple[list, list[float] | float]:
    body = _body(body)
    nodes = _ids(body, "nodes")
    return nodes, _times(body, len(nodes))
