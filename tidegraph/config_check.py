"""Type checks shared by every configuration dataclass, and the YAML reader of `--config`.

`check_fields(config, "train")` is the first line of each section's `__post_init__`: it checks
every field against its annotation (`int`, `float`, `str`, `bool`, `X | None`, `list[int]`,
`tuple[float, float]`, `tuple[int, ...]`, a nested config) and raises one ValueError naming the
field, so the range checks after it see values of the right type. A bool is not an int here
(YAML's `true` is not a batch size). A float field takes an int, and a string that reads as a
number, since YAML 1.1 (PyYAML) reads `1e-3` as a string; it is converted to a float.
`unknown_keys` names keys that are no field, with the close match when there is one;
`explicit_fields` lists the fields a raw mapping sets (what a YAML file and flags asked for).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path

import yaml

__all__ = ["check_fields", "explicit_fields", "read_yaml", "unknown_keys"]

_HINTS: dict[type, dict] = {}


def check_fields(config, section: str) -> None:
    """Check (and, for floats given as int or text, convert) each field of `config`."""
    cls = type(config)
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    for f in dataclasses.fields(config):
        name = f"{section}.{f.name}" if section else f.name
        value = getattr(config, f.name)
        setattr(config, f.name, _check(_HINTS[cls][f.name], value, name))


def unknown_keys(given, known, where: str) -> None:
    """Raise naming the keys of `given` not in `known`, each with its close match if any."""
    bad = [key for key in given if key not in known]
    if not bad:
        return
    if any(not isinstance(key, str) for key in bad):
        raise ValueError(f"{where}: keys must be field names, got {bad}")
    hints = []
    for key in bad:
        close = difflib.get_close_matches(key, list(known), n=2)
        if close:
            hints.append(f"{key!r}: did you mean {' or '.join(repr(k) for k in close)}?")
    hint = "; ".join(hints) if hints else f"known: {', '.join(sorted(known))}"
    raise ValueError(f"{where}: unknown keys {sorted(bad)}; {hint}")


def explicit_fields(raw: dict) -> set[str]:
    """The dotted fields a raw config mapping sets (`{"model": {"dim": 8}, "seed": 1}` ->
    {"model.dim", "seed"}): what a YAML file and flags asked for."""
    out = set()
    for key, value in (raw or {}).items():
        if isinstance(value, dict):
            out |= {f"{key}.{k}" for k in value}
        else:
            out.add(str(key))
    return out


def read_yaml(path: str, flag: str = "--config") -> dict:
    """The mapping a YAML file holds (an empty file: {}); a missing file, a syntax error or a
    root that is no mapping raises one line naming the file (and the line of the error)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"{flag} {path}: cannot read it: {reason}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{flag} {path}: invalid YAML at {where}{problem}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(
            f"{flag} {path}: a mapping of sections expected (model: ..., train: ...), "
            f"but the file holds a {_kind(raw)}"
        )
    return raw


def _check(hint, value, name: str):
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"{name} must be {_want(hint)}, got null")
    for option in options:
        if option is type(None):
            continue
        try:
            return _as(option, value, name)
        except _Mismatch:
            continue
    raise ValueError(f"{name} must be {_want(hint)}, got {_shown(value)}")


class _Mismatch(Exception):
    pass


def _as(hint, value, name: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        return _float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple) or hint in (list, tuple):
        return _sequence(origin or hint, args, value, name)
    elif hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
    else:  # an annotation this checker does not know: leave the value to the section
        return value
    raise _Mismatch


def _float(value) -> float:
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise _Mismatch from None
        if not math.isnan(number):
            return number
    raise _Mismatch


def _sequence(kind, args, value, name: str):
    if not isinstance(value, (list, tuple)):
        raise _Mismatch
    if not args:
        return value
    if kind is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise _Mismatch
        items = [
            _check(a, v, f"{name}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        ]
    else:
        items = [_check(args[0], v, f"{name}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if kind is tuple else items


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


_WORDS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "a mapping",
}


def _want(hint) -> str:
    if _is_union(hint):
        words = [_want(a) if a is not type(None) else "null" for a in typing.get_args(hint)]
        return " or ".join(words) if len(words) < 3 else f"{', '.join(words[:-1])} or {words[-1]}"
    if hint in _WORDS:
        return _WORDS[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict:
        return "a mapping"
    if origin in (list, tuple) or hint in (list, tuple):
        if not args:
            return "a list"
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(set(args)) == 1:
                return f"a list of {len(args)} {_plural(args[0])}"
            return f"a list of {len(args)} ({', '.join(_want(a) for a in args)})"
        return f"a list of {_plural(args[0])}"
    if isinstance(hint, type):
        return f"a {hint.__name__}"
    return str(hint)


def _plural(hint) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(
        hint, _want(hint)
    )


def _kind(value) -> str:
    return {dict: "mapping", list: "list", str: "string"}.get(type(value), type(value).__name__)


def _shown(value) -> str:
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else text
