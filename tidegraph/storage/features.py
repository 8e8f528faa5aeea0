"""Node and edge feature stores: one interface, a host-memory store and an in-memory fake.

A `FeatureStore` maps non-negative int64 ids (node ids, or eids for edge features) to rows of
`dim` values. Node and edge features are two stores. Assumptions and semantics:

- `get(ids)` returns float32 rows `[n, dim]` in the order of `ids` (duplicates allowed). An id
  that was never written (beyond the end, or skipped over by a `put` further out) reads as the
  store's `default` row; a dataset without features is a store with `dim=0`, whose rows are
  zero-width. Only negative or non-integer ids are errors.
- `put(ids, rows)` writes rows, growing the store as needed; `append(rows)` writes after the
  last row and returns the new ids (eids follow the stream, so edge features are appended).
- Rows may be kept (and moved) in lower precision: `fp16`, `bf16` or `int8` with a per-row
  absmax scale. `int8` rounds stochastically (unbiased) by default, `bf16` optionally; `fp16`
  rounds to nearest. The store measures the error this adds on every write (`error_stats()`).
- `fetch(ids)` returns the stored (encoded) rows, which is what a cache moves to the GPU; with
  `pin_memory` the result is gathered into pinned memory so the copy can be asynchronous.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tidegraph.rng import load_generator_state
from tidegraph.storage.idmap import check_ids

__all__ = [
    "PRECISIONS",
    "EncodedRows",
    "FeatureConfig",
    "FeatureStore",
    "HostFeatureStore",
    "InMemoryFeatureStore",
    "decode",
    "encode",
    "quantization_error",
]

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
_STORAGE_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
}
_INT8_MAX = 127.0


# ---- encoding ---------------------------------------------------------------------------------


@dataclass
class EncodedRows:
    """Rows as stored: `data` [n, dim] in the storage dtype, `scale` [n] float32 for int8."""

    data: torch.Tensor
    scale: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        extra = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.data.numel() * self.data.element_size() + extra

    def to(self, device: torch.device | str, non_blocking: bool = False) -> EncodedRows:
        scale = self.scale
        if scale is not None:
            scale = scale.to(device, non_blocking=non_blocking)
        return EncodedRows(self.data.to(device, non_blocking=non_blocking), scale)


def encode(
    rows: torch.Tensor,
    precision: str = "fp32",
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> EncodedRows:
    """Encode float rows [n, dim]; `stochastic` applies to int8 and bf16 (fp16 is nearest)."""
    _check_precision(precision, "encode")
    wide = rows
    rows = _narrowed(rows, rows.to(torch.float32), "fp32")
    if precision == "fp32":
        return EncodedRows(rows.clone() if rows is wide else rows)
    if precision == "fp16":
        return EncodedRows(_narrowed(rows, rows.to(torch.float16), "fp16"))
    if precision == "bf16":
        return EncodedRows(_narrowed(rows, _to_bf16(rows, stochastic, generator), "bf16"))
    return _to_int8(rows, stochastic, generator)


def _narrowed(wide: torch.Tensor, narrow: torch.Tensor, name: str) -> torch.Tensor:
    """`narrow` (a lower-precision copy of `wide`), refused when a finite value of `wide`
    overflowed to infinity: a store never holds an infinity it was not given."""
    if narrow.dtype == wide.dtype or not narrow.is_floating_point():
        return narrow
    over = torch.isinf(narrow) & torch.isfinite(wide)
    if bool(over.any()):
        row, col = (int(x) for x in over.nonzero()[0])
        fix = "store these features in fp32" if name != "fp32" else "scale them into it"
        why = f"is beyond the {name} range ({torch.finfo(narrow.dtype).max:.6g}); {fix}"
        raise _Overflow(row, f"feature value {float(wide[row, col])!r} (column {col}) {why}")
    return narrow


class _Overflow(ValueError):
    """A finite feature value that a narrower precision would turn into an infinity."""

    def __init__(self, row: int, message: str) -> None:
        super().__init__(f"row {row}: {message}")
        self.row, self.message = row, message


def decode(rows: EncodedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float rows [n, dim] from encoded rows (on whatever device they are)."""
    out = rows.data.to(dtype)
    if rows.scale is not None:
        out = out * rows.scale.to(dtype).unsqueeze(1)
    return out


def quantization_error(
    rows: torch.Tensor, precision: str, stochastic: bool = True, seed: int = 0
) -> dict[str, float]:
    """Error of an encode/decode round trip of `rows` (what `HostFeatureStore` reports)."""
    gen = torch.Generator(device=rows.device).manual_seed(seed)
    rows = rows.to(torch.float32)
    err = decode(encode(rows, precision, stochastic, gen)) - rows
    acc = _ErrorAccumulator()
    acc.add(rows, err)
    return acc.report()


def _to_bf16(rows: torch.Tensor, stochastic: bool, gen: torch.Generator | None) -> torch.Tensor:
    if not stochastic:
        return rows.to(torch.bfloat16)
    # add uniform noise below bfloat16's last mantissa bit, then truncate: unbiased rounding
    bits = rows.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=gen, device=rows.device)
    truncated = (bits + noise.to(torch.int32)) & ~0xFFFF
    return truncated.view(torch.float32).to(torch.bfloat16)


def _to_int8(rows: torch.Tensor, stochastic: bool, gen: torch.Generator | None) -> EncodedRows:
    absmax = rows.abs().amax(1) if rows.shape[1] else rows.new_zeros(rows.shape[0])
    scale = absmax / _INT8_MAX
    scaled = rows / torch.where(scale > 0, scale, 1.0).unsqueeze(1)
    if stochastic:
        noise = torch.rand(scaled.shape, generator=gen, device=rows.device)
        q = torch.floor(scaled + noise)
    else:
        q = torch.round(scaled)
    return EncodedRows(q.clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8), scale)


class _ErrorAccumulator:
    """Running totals of the error added by lower-precision storage."""

    def __init__(self) -> None:
        self.rows = 0
        self.values = 0
        self.sum_sq_err = 0.0
        self.sum_sq = 0.0
        self.max_abs = 0.0

    def add(self, rows: torch.Tensor, err: torch.Tensor) -> None:
        if err.numel() == 0:
            self.rows += int(rows.shape[0])
            return
        sums = torch.stack([err.square().sum(), rows.square().sum(), err.abs().max()])
        sq_err, sq, max_abs = sums.double().tolist()
        self.rows += int(rows.shape[0])
        self.values += err.numel()
        self.sum_sq_err += sq_err
        self.sum_sq += sq
        self.max_abs = max(self.max_abs, max_abs)

    def report(self) -> dict[str, float]:
        rel = math.sqrt(self.sum_sq_err / self.sum_sq) if self.sum_sq > 0 else 0.0
        return {
            "rows": float(self.rows),
            "rmse": math.sqrt(self.sum_sq_err / max(self.values, 1)),
            "relative_rmse": rel,
            "max_abs_error": self.max_abs,
        }

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


# ---- interface --------------------------------------------------------------------------------


class FeatureStore(ABC):
    """Rows of `dim` features addressed by non-negative int64 ids."""

    dim: int
    precision: str = "fp32"

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """One past the largest id written so far."""

    @abstractmethod
    def get(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows [len(ids), dim], on the store's device, in the order of `ids`."""

    @abstractmethod
    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `rows` [n, dim] at `ids` (growing the store); the last of duplicate ids wins."""

    @abstractmethod
    def state_dict(self) -> dict: ...

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    def fetch(self, ids: torch.Tensor) -> EncodedRows:
        """The stored form of rows `ids` (what a cache moves to its device)."""
        return EncodedRows(self.get(ids))

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Write `rows` after the last row; returns their ids."""
        start = self.num_rows
        ids = torch.arange(start, start + int(rows.shape[0]), dtype=torch.int64)
        self.put(ids, rows)
        return ids

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row (scale included)."""
        size = torch.empty(0, dtype=_STORAGE_DTYPES[self.precision]).element_size()
        return self.dim * size + (4 if self.precision == "int8" else 0)


# ---- host-memory store ------------------------------------------------------------------------


@dataclass(kw_only=True)
class FeatureConfig:
    """How a `HostFeatureStore` keeps its rows."""

    dim: int
    precision: str = "fp32"
    stochastic: bool = True  # int8 and bf16: unbiased stochastic rounding
    default: float = 0.0  # value of rows never written
    pin_memory: bool = False  # pinned host memory (only where CUDA is present)
    track_error: bool = True  # measure the error lower precision adds on every write
    seed: int = 0

    def __post_init__(self) -> None:
        if int(self.dim) != self.dim or self.dim < 0:
            raise ValueError(f"FeatureConfig.dim must be a non-negative integer, got {self.dim}")
        _check_precision(self.precision, "FeatureConfig.precision")
        if not math.isfinite(self.default):
            raise ValueError(f"FeatureConfig.default must be finite, got {self.default}")
        narrow = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.precision)
        if narrow is not None and not math.isfinite(torch.tensor(self.default).to(narrow)):
            raise ValueError(
                f"FeatureConfig.default {self.default} is beyond the {self.precision} range"
            )


class HostFeatureStore(FeatureStore):
    """Rows in one growable host tensor (optionally pinned), in the configured precision."""

    def __init__(self, config: FeatureConfig | None = None, **overrides) -> None:
        self.config = _merge_config(config, overrides)
        self.dim = self.config.dim
        self.precision = self.config.precision
        self.pinned = self.config.pin_memory and torch.cuda.is_available()
        if self.config.pin_memory and not self.pinned:
            log.info("HostFeatureStore: not pinning host memory, since CUDA is absent")
        self._generator = torch.Generator().manual_seed(self.config.seed)
        default_row = torch.full((1, self.dim), self.config.default)
        self._default = encode(default_row, self.precision)
        self._error = _ErrorAccumulator()
        self._num_rows = 0
        self._data, self._scale = self._allocate(0)

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        return decode(self.fetch(ids))

    def fetch(self, ids: torch.Tensor) -> EncodedRows:
        ids = check_ids(ids, "HostFeatureStore.fetch").cpu()
        inside = ids < self._num_rows
        safe = torch.where(inside, ids, 0) if self._num_rows else torch.zeros_like(ids)
        data = self._gather(self._data, safe)
        scale = self._gather(self._scale, safe) if self._scale is not None else None
        if not bool(inside.all()):
            outside = ~inside
            data[outside] = self._default.data
            if scale is not None:
                scale[outside] = self._default.scale
        return EncodedRows(data, scale)

    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        ids = check_ids(ids, "HostFeatureStore.put").cpu()
        rows = _check_rows(rows, ids, self.dim, "HostFeatureStore.put").cpu()
        if ids.numel() == 0:
            return
        ids, rows = _last_write_wins(ids, rows)
        try:
            enc = encode(rows, self.precision, self.config.stochastic, self._generator)
        except _Overflow as exc:  # name the id: rows were deduplicated and reordered
            raise ValueError(
                f"HostFeatureStore.put: id {int(ids[exc.row])}: {exc.message}"
            ) from None
        if self.config.track_error and self.precision != "fp32":
            self._error.add(rows.float(), decode(enc) - rows.float())
        self._reserve(int(ids.max()) + 1)
        self._data[ids] = enc.data
        if self._scale is not None:
            self._scale[ids] = enc.scale
        self._num_rows = max(self._num_rows, int(ids.max()) + 1)

    def put_encoded(self, ids: torch.Tensor, rows: EncodedRows) -> None:
        """Write rows encoded elsewhere (in this store's precision) at distinct `ids`."""
        ids = check_ids(ids, "HostFeatureStore.put_encoded").cpu()
        if ids.numel() == 0:
            return
        if rows.data.dtype != self._data.dtype or len(rows) != ids.shape[0]:
            raise ValueError(
                f"HostFeatureStore.put_encoded: {len(rows)} rows of {rows.data.dtype} for "
                f"{ids.shape[0]} ids of a {self.precision} store"
            )
        self._reserve(int(ids.max()) + 1)
        self._data[ids] = rows.data.cpu()
        if self._scale is not None:
            self._scale[ids] = rows.scale.cpu()
        self._num_rows = max(self._num_rows, int(ids.max()) + 1)

    def error_stats(self) -> dict[str, float]:
        """Error added by the storage precision over every row written (zeros for fp32)."""
        return self._error.report()

    @property
    def nbytes(self) -> int:
        return EncodedRows(self._data[: self._num_rows], self._scale_view()).nbytes

    def state_dict(self) -> dict:
        return {
            "num_rows": self._num_rows,
            "data": self._data[: self._num_rows].clone(),
            "scale": self._scale_view().clone() if self._scale is not None else None,
            "generator": self._generator.get_state(),
            "error": self._error.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        data = state["data"]
        if data.dtype != self._data.dtype or data.shape[1] != self.dim:
            raise ValueError(
                f"HostFeatureStore.load_state_dict: rows are {data.dtype} x {data.shape[1]}, "
                f"this store keeps {self._data.dtype} x {self.dim}"
            )
        self._num_rows = 0
        self._data, self._scale = self._allocate(state["num_rows"])
        self._data[: state["num_rows"]] = data
        if self._scale is not None:
            self._scale[: state["num_rows"]] = state["scale"]
        self._num_rows = state["num_rows"]
        load_generator_state(self._generator, state["generator"], "feature store rounding")
        self._error.load_state_dict(state["error"])

    # ---- internals ----------------------------------------------------------------------------

    def _scale_view(self) -> torch.Tensor | None:
        return self._scale[: self._num_rows] if self._scale is not None else None

    def _allocate(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Buffers of `rows` rows filled with the default row."""
        dtype = _STORAGE_DTYPES[self.precision]
        data = torch.empty((rows, self.dim), dtype=dtype, pin_memory=self.pinned)
        data[:] = self._default.data
        scale = None
        if self._default.scale is not None:
            scale = torch.empty(rows, dtype=torch.float32, pin_memory=self.pinned)
            scale[:] = self._default.scale
        return data, scale

    def _reserve(self, rows: int) -> None:
        """Grow the buffers (geometrically) to hold at least `rows` rows."""
        if rows <= self._data.shape[0]:
            return
        data, scale = self._allocate(max(rows, 2 * self._data.shape[0], 1024))
        data[: self._num_rows] = self._data[: self._num_rows]
        if scale is not None:
            scale[: self._num_rows] = self._scale[: self._num_rows]
        self._data, self._scale = data, scale

    def _gather(self, source: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(
            (ids.shape[0], *source.shape[1:]), dtype=source.dtype, pin_memory=self.pinned
        )
        if ids.numel() and source.shape[0]:
            torch.index_select(source, 0, ids, out=out)
        return out


# ---- in-memory fake ---------------------------------------------------------------------------


class InMemoryFeatureStore(FeatureStore):
    """A dict of rows, for tests: obviously correct, slow, and it records every fetch."""

    def __init__(self, dim: int, default: float = 0.0) -> None:
        self.dim = dim
        self.default = default
        self.rows: dict[int, torch.Tensor] = {}
        self.fetched: list[torch.Tensor] = []  # the ids of every fetch, in order

    @property
    def num_rows(self) -> int:
        return max(self.rows, default=-1) + 1

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        ids = check_ids(ids, "InMemoryFeatureStore.get").cpu()
        self.fetched.append(ids.clone())
        blank = torch.full((self.dim,), float(self.default))
        out = [self.rows.get(i, blank) for i in ids.tolist()]
        return torch.stack(out) if out else torch.empty((0, self.dim))

    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        ids = check_ids(ids, "InMemoryFeatureStore.put").cpu()
        rows = _check_rows(rows, ids, self.dim, "InMemoryFeatureStore.put").cpu()
        for i, row in zip(ids.tolist(), rows.float(), strict=True):
            self.rows[i] = row.clone()

    def state_dict(self) -> dict:
        return {"rows": {i: r.clone() for i, r in self.rows.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rows = {i: r.clone() for i, r in state["rows"].items()}


# ---- checks -----------------------------------------------------------------------------------


def _merge_config(config: FeatureConfig | None, overrides: dict) -> FeatureConfig:
    if config is None:
        return FeatureConfig(**overrides)
    return FeatureConfig(**{**vars(config), **overrides})


def _last_write_wins(ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids with the row of their last occurrence (index_put order is unspecified)."""
    uniq, inverse = torch.unique(ids, return_inverse=True)
    if uniq.shape[0] == ids.shape[0]:
        return ids, rows
    pos = torch.arange(ids.shape[0], device=ids.device)
    last = torch.full_like(uniq, -1).scatter_reduce(0, inverse, pos, "amax")
    return uniq, rows[last]


def _check_precision(precision: str, where: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"{where} must be one of {PRECISIONS}, got {precision!r}")


def _check_rows(rows, ids: torch.Tensor, dim: int, where: str) -> torch.Tensor:
    rows = torch.as_tensor(rows)
    if rows.dim() != 2 or rows.shape != (ids.shape[0], dim):
        raise ValueError(
            f"{where}: rows must have shape ({ids.shape[0]}, {dim}), got {tuple(rows.shape)}"
        )
    if rows.numel() and not bool(torch.isfinite(rows).all()):
        bad = int((~torch.isfinite(rows)).any(1).nonzero()[0])
        raise ValueError(f"{where}: row {bad} (id {int(ids[bad])}) has a non-finite value")
    return rows
