"""External node ids -> dense internal ids: a growing, vectorized id map, and the id check.

Streams name nodes by any int64 value (sparse, hashed, huge, negative) or, with
`data.string_ids`, by strings. Everything after the point where events enter a run (the
stream a learner builds, and the increments `ContinualLearner.append` adds) sees dense internal
ids 0..N-1 that index node tables; `IdMap` translates, and translates back for anything that
names nodes to a user.

Rules (stated here once; `tidegraph.training.data` and the learner follow them):
- Identity below a bound. Ids in [0, identity_bound) map to themselves; every other id gets
  the next free dense id (identity_bound, identity_bound + 1, ...) the first time it is seen,
  in order of first appearance: events in stream order, src before dst. `for_ids` chooses the
  bound from the ids a stream starts with: max id + 1 when its ids are already nearly dense
  (non-negative ids with max + 1 <= 2 * distinct + 65,536, as the bundled datasets and files
  with ids below 65,536 are), else 0 (every id mapped). So dense data keeps its ids bitwise,
  a node table wastes at most half its rows plus 65,536, and one id of 1e9 among small ids
  costs one table row, not a billion.
- Mapping is idempotent: mapping a stream's dense ids again through a fresh map gives the same
  ids (they are dense, so the bound covers them, and later ones appear in the order they were
  given). A run rebuilt from its durable log (which holds dense ids) may therefore go through
  the same entry points; its checkpoint's map then replaces the rebuilt one.
- Negative ids are valid external ids (mapped like any other); internal ids are never negative.
- Vectorized: a sorted key array searched with `np.searchsorted` (int ids) or a pyarrow hash
  lookup (`pc.index_in`, string ids); new keys are merged in O(K + m) per batch, no Python
  loop per id.
- State: `state_dict()` holds the bound and the keys in dense order (int64 tensor, or the UTF-8
  bytes and offsets of the strings), so a loaded map is bitwise the saved one.
- Partitioning: `split(owner, num_parts)` cuts the state by the partitioner's `owner` function
  of dense ids (`Partitioner.owner`), one part per shard with the (external, dense) pairs of its
  nodes; `IdMap.merge(parts)` puts the whole map back. The identity range needs no entries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

__all__ = ["IdMap", "check_ids"]

# ids a stream may skip and still keep its ids: files with ids below 65,536 keep them (a
# node table of that many rows is small), and one huge id among small ones is still mapped
_SLACK = 1 << 16


def check_ids(
    ids, where: str, *, name: str = "ids", negative: bool = True, one_dim: bool = True
) -> torch.Tensor:
    """Internal ids as an int64 tensor: integer dtype (an empty float list is no ids), 1-D when
    `one_dim`, and no negative id when `negative` (callers that check negatives with other
    checks in one host sync pass False). Messages start with `where`."""
    ids = torch.as_tensor(ids)
    bad_dtype = ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool
    if one_dim and (ids.dim() != 1 or (bad_dtype and (ids.numel() or ids.dtype == torch.bool))):
        raise ValueError(f"{where}: {name} must be a 1-D integer tensor, got {ids.dtype} "
                         f"{tuple(ids.shape)}")  # fmt: skip
    if bad_dtype and ids.numel():
        raise ValueError(f"{where}: {name} must hold integer ids, got dtype {ids.dtype}")
    ids = ids.to(torch.int64)
    if negative and ids.numel() and bool((ids < 0).any()):
        pos = int((ids < 0).nonzero()[0])
        raise ValueError(f"{where}: id at position {pos} is negative ({int(ids[pos])})")
    return ids


class IdMap:
    """External ids -> dense ids, growing as new ids arrive; `kind` is "int" or "str"."""

    def __init__(self, identity_bound: int = 0, kind: str = "int") -> None:
        if kind not in ("int", "str"):
            raise ValueError(f"IdMap: kind must be 'int' or 'str', got {kind!r}")
        if kind == "str" and identity_bound:
            raise ValueError("IdMap: string ids have no identity range")
        self.kind = kind
        self.identity_bound = int(identity_bound)
        self._keys = np.empty(0, dtype=np.int64)  # int keys in dense order
        # the keys as sorted runs (sorted keys, their dense ids), merged like a binary counter
        # (a run merges into the one before while that one is no larger than twice its size):
        # O(log K) runs, each key re-sorted O(log K) times, no O(K) copy per batch
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []
        self._text = pa.array([], pa.large_string())  # str keys in dense order

    @classmethod
    def for_ids(cls, ids: np.ndarray | torch.Tensor) -> IdMap:
        """A map whose identity bound suits `ids` (the ids a stream starts with); memory in
        proportion to the ids (distinct ones are counted only when the bound could hold)."""
        ids = _numpy(ids).reshape(-1)
        plain = ids >= 0
        if not plain.any():
            return cls()
        top = int(ids.max(initial=-1, where=plain)) + 1
        if top > 2 * ids.size + _SLACK:  # more than 2 * distinct + slack whatever they are
            return cls()
        seen = np.zeros(top, dtype=bool)
        seen[ids[plain]] = True
        return cls.for_counts(top, ids.size, int(seen.sum()))

    @classmethod
    def for_counts(cls, top: int, size: int, distinct: int) -> IdMap:
        """`for_ids` from counts of the ids: `top`, one past the largest non-negative id (0:
        none); `size`, how many ids; `distinct`, how many distinct non-negative ones (a
        stream counted a batch at a time gets the map `for_ids` gives it whole)."""
        if top == 0 or top > 2 * size + _SLACK:
            return cls()
        return cls(top if top <= 2 * distinct + _SLACK else 0)

    def __len__(self) -> int:
        """Dense ids handed out: one past the largest."""
        extra = len(self._text) if self.kind == "str" else self._keys.size
        return self.identity_bound + extra

    @property
    def mapped(self) -> int:
        """Ids that have an entry (outside the identity range)."""
        return len(self) - self.identity_bound

    # ---- mapping --------------------------------------------------------------------------

    def map(self, ids) -> torch.Tensor:
        """Dense ids of int64 external `ids` (any shape), adding the new ones in order."""
        if self.kind != "int":
            raise TypeError("IdMap.map: this map holds string ids; use map_text")
        array = _numpy(ids)
        flat = array.reshape(-1)
        out = flat.copy()
        outside = (flat < 0) | (flat >= self.identity_bound)
        if outside.any():
            out[outside] = self._lookup_add(flat[outside])
        return torch.from_numpy(out.reshape(array.shape))

    def lookup(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(dense ids, found) of int64 external `ids` (1-D), adding none: absent ones get 0."""
        if self.kind != "int":
            raise TypeError("IdMap.lookup: this map holds string ids; use lookup_text")
        flat = _numpy(ids).reshape(-1)
        dense, found = flat.copy(), np.ones(flat.size, dtype=bool)
        outside = (flat < 0) | (flat >= self.identity_bound)
        if outside.any():
            dense[outside], found[outside] = self._find(flat[outside])
        return torch.from_numpy(dense), torch.from_numpy(found)

    def lookup_text(self, values: pa.Array) -> tuple[torch.Tensor, torch.Tensor]:
        """(dense ids, found) of string external ids, adding none: absent ones get 0."""
        if self.kind != "str":
            raise TypeError("IdMap.lookup_text: this map holds int ids; use lookup")
        index = pc.index_in(values.cast(pa.large_string()), value_set=self._text)
        found = index.is_valid().to_numpy(zero_copy_only=False)
        dense = index.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        return torch.from_numpy(dense), torch.from_numpy(found.copy())

    def map_events(self, src, dst, chunk: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) of events mapped, new ids in order of first appearance, src before dst;
        `chunk` events at a time (the same ids; bounded temporary memory)."""
        src, dst = _numpy(src), _numpy(dst)
        out_src, out_dst = np.empty_like(src), np.empty_like(dst)
        for lo in range(0, src.size, chunk):
            both = self.map(np.stack([src[lo : lo + chunk], dst[lo : lo + chunk]], 1)).numpy()
            out_src[lo : lo + chunk], out_dst[lo : lo + chunk] = both[:, 0], both[:, 1]
        return torch.from_numpy(out_src), torch.from_numpy(out_dst)

    def _lookup_add(self, x: np.ndarray) -> np.ndarray:
        dense, found = self._find(x)
        if not found.all():
            miss = ~found
            keys, first, inverse = np.unique(x[miss], return_index=True, return_inverse=True)
            by_first = np.argsort(first, kind="stable")  # new ids in order of first appearance
            new = np.empty(keys.size, dtype=np.int64)
            new[by_first] = len(self) + np.arange(keys.size)
            self._keys = np.concatenate([self._keys, keys[by_first]])
            self._push(keys, new)
            dense[miss] = new[inverse.reshape(-1)]
        return dense

    def _push(self, keys: np.ndarray, dense: np.ndarray) -> None:
        """Add a sorted run, merging the last runs while the older is not much larger."""
        self._runs.append((keys, dense))
        while len(self._runs) > 1 and self._runs[-2][0].size <= 2 * self._runs[-1][0].size:
            (k1, d1), (k2, d2) = self._runs[-2:]
            keys = np.concatenate([k1, k2])
            order = np.argsort(keys, kind="stable")
            self._runs[-2:] = [(keys[order], np.concatenate([d1, d2])[order])]

    def _find(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Dense ids of `x` (0 where absent) and whether each was found; each run (largest
        first) is searched for the ids not found yet."""
        dense = np.zeros(x.size, dtype=np.int64)
        found = np.zeros(x.size, dtype=bool)
        todo = np.arange(x.size)
        for keys, values in self._runs:
            want = x[todo]
            pos = np.minimum(np.searchsorted(keys, want), keys.size - 1)
            hit = keys[pos] == want
            dense[todo[hit]] = values[pos[hit]]
            found[todo[hit]] = True
            todo = todo[~hit]
            if todo.size == 0:
                break
        return dense, found

    def map_text(self, values: pa.Array) -> np.ndarray:
        """Dense ids of string external ids (a pyarrow string array without nulls)."""
        if self.kind != "str":
            raise TypeError("IdMap.map_text: this map holds int ids; use map")
        values = values.cast(pa.large_string())
        index = pc.index_in(values, value_set=self._text)
        if index.null_count:
            fresh = pc.unique(values.filter(index.is_null()))  # in order of first appearance
            self._text = pa.concat_arrays([self._text, fresh])
            index = pc.index_in(values, value_set=self._text)
        return index.to_numpy(zero_copy_only=False).astype(np.int64)

    def map_text_events(self, src: pa.Array, dst: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """String (src, dst) of events mapped, new ids in order of first appearance."""
        n = len(src)
        order = np.stack([np.arange(n), np.arange(n) + n], 1).reshape(-1)
        both = pa.concat_arrays([src.cast(pa.large_string()), dst.cast(pa.large_string())])
        dense = self.map_text(both.take(pa.array(order))).reshape(n, 2)
        return dense[:, 0].copy(), dense[:, 1].copy()

    def text(self, dense: np.ndarray) -> pa.Array:
        """The string keys of dense ids (a string map)."""
        return self._text.take(pa.array(np.asarray(dense, dtype=np.int64)))

    def external(self, dense) -> torch.Tensor | list[str]:
        """The external ids of dense ids (int64 tensor, or a list of strings)."""
        d = _numpy(dense).reshape(-1)
        if d.size and (d.min() < 0 or d.max() >= len(self)):
            raise ValueError(f"IdMap.external: dense ids must be in [0, {len(self)})")
        if self.kind == "str":
            return self._text.take(pa.array(d)).to_pylist()
        out = d.copy()
        beyond = d >= self.identity_bound
        out[beyond] = self._keys[d[beyond] - self.identity_bound]
        return torch.from_numpy(out)

    # ---- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {"kind": self.kind, "identity_bound": self.identity_bound}
        if self.kind == "str":
            state.update(_text_state(self._text))
        else:
            state["keys"] = torch.from_numpy(self._keys.copy())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.__init__(state["identity_bound"], state["kind"])
        if self.kind == "str":
            self._text = _text_from(state["offsets"], state["data"])
        else:
            self._set_keys(state["keys"].numpy().astype(np.int64, copy=True))

    def _set_keys(self, keys: np.ndarray) -> None:
        self._keys = keys
        order = np.argsort(keys, kind="stable")
        self._runs = (
            [(keys[order], self.identity_bound + order.astype(np.int64))] if keys.size else []
        )

    @classmethod
    def from_state(cls, state: dict) -> IdMap:
        out = cls(state["identity_bound"], state["kind"])
        out.load_state_dict(state)
        return out

    def split(self, owner: Callable[[torch.Tensor], torch.Tensor], num_parts: int) -> list[dict]:
        """The map's entries cut by `owner(dense ids) -> part`: one state per part, holding
        the dense ids it owns and their keys (`IdMap.merge` joins them again)."""
        dense = torch.arange(self.identity_bound, len(self), dtype=torch.int64)
        part = owner(dense) if dense.numel() else dense
        whole = self.state_dict()
        out = []
        for p in range(num_parts):
            mine = dense[part == p]
            piece = {"kind": self.kind, "identity_bound": self.identity_bound, "dense": mine,
                     "size": len(self)}  # fmt: skip
            rows = (mine - self.identity_bound).numpy()
            if self.kind == "str":
                piece.update(_text_state(self._text.take(pa.array(rows))))
            else:
                piece["keys"] = whole["keys"][torch.from_numpy(rows)]
            out.append(piece)
        return out

    @classmethod
    def merge(cls, parts: Sequence[dict]) -> IdMap:
        """The whole map from the parts `split` made (in any order)."""
        first = parts[0]
        out = cls(first["identity_bound"], first["kind"])
        dense = torch.cat([p["dense"] for p in parts])
        if dense.numel() != first["size"] - first["identity_bound"]:
            raise ValueError(f"IdMap.merge: the parts hold {dense.numel()} entries, the map "
                             f"had {first['size'] - first['identity_bound']}")  # fmt: skip
        order = torch.argsort(dense).numpy()
        if out.kind == "str":
            text = pa.concat_arrays([_text_from(p["offsets"], p["data"]) for p in parts])
            out._text = text.take(pa.array(order))
        else:
            out._set_keys(torch.cat([p["keys"] for p in parts]).numpy()[order].copy())
        return out


def _numpy(ids) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        return ids.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(ids, dtype=np.int64)


def _text_state(text: pa.Array) -> dict:
    """Strings as UTF-8 bytes and int64 offsets (tensors: saved and loaded bitwise)."""
    text = pa.concat_arrays([text]) if text.offset else text  # offsets from 0
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int64)[: len(text) + 1]
    data = np.frombuffer(text.buffers()[2] or b"", dtype=np.uint8)
    lo, hi = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
    return {
        "offsets": torch.from_numpy((offsets - lo).copy()),
        "data": torch.from_numpy(data[lo:hi].copy()),
    }


def _text_from(offsets: torch.Tensor, data: torch.Tensor) -> pa.Array:
    n = max(offsets.numel() - 1, 0)
    if n == 0:
        return pa.array([], pa.large_string())
    buffers = [None, pa.py_buffer(offsets.numpy().tobytes()), pa.py_buffer(data.numpy().tobytes())]
    return pa.Array.from_buffers(pa.large_string(), n, buffers)
