"""Checkpoints as small manifests over content-addressed chunks, kept to a number.

A checkpoint `tag` is the file `{tag}.pt` of a checkpoint directory: the state tree
(`torch.save`) in which every tensor of `INLINE` bytes or more is replaced by a `TensorRef`
(dtype, shape, device and the keys of its chunks). A chunk is a run of whole rows of the
tensor's bytes, about `CHUNK` bytes, stored once as `blobs/{key}` (key: BLAKE2b of its bytes).
So:
- what does not change between checkpoints is written once and referenced by the later ones:
  an immutable graph segment, the rows of a table that grows by appending rows (feature rows,
  the id map, a segment list's older segments) up to its last partial chunk;
- equal tensors are stored once: the W trainer replicas' parameters, optimizer and node state
  (identical after every step) cost one copy, not W;
- a tensor costs its own bytes, never those of a larger storage it views (a parameter view of
  a flat buffer). `compact` gives the same for state sent between processes.

The large tensors of a state may be written by the process that holds them (`put_state`: a
shard actor its graph, a trainer its model), so a checkpoint's bulk never passes through the
driver, which writes the manifest of the refs they return.

Retention: `index.json` lists the checkpoints kept, oldest first, with the chunks each
references. `save(state, tag, keep)` writes the new chunks, the manifest, the index and
`latest` (naming the newest), then deletes the manifests of all but the newest `keep` and every
chunk that no kept checkpoint (nor the one `latest` names) references. Every file is written to
a temporary name and moved into place, and nothing a checkpoint references is deleted before
`latest` names a newer one, so a kill at any point leaves `latest` naming a checkpoint whose
files all exist (a kill's leftovers, temporary files and unreferenced chunks, go at the next
save). Loading resolves the references; bytes come back as they were written (bitwise).

Storage is a `pyarrow.fs` file system (local path, s3://, gs://).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import pyarrow.fs as pafs
import torch

__all__ = [
    "CHUNK",
    "INLINE",
    "CheckpointStore",
    "DeltaTables",
    "RowDelta",
    "TensorRef",
    "chunks_of",
    "compact",
    "gathered",
    "pack_rows",
    "put_state",
    "read_file",
    "unpack_rows",
    "write_file",
]

log = logging.getLogger(__name__)

CHUNK = 4 << 20  # bytes of a chunk (whole rows; a row larger than this is one chunk)
INLINE = 64 << 10  # tensors smaller than this stay in the manifest


@dataclass(frozen=True)
class TensorRef:
    """A tensor stored as chunks: their keys, in order, make its bytes."""

    dtype: str
    shape: tuple[int, ...]
    device: str
    chunks: tuple[str, ...]


@dataclass(frozen=True)
class RowDelta:
    """A table of `shape` stored as a base written earlier (its first rows) and patches, the
    rows changed since, in order: (row indices, their values) pairs, a later pair winning.
    Loads as the table itself (`CheckpointStore.resolve`)."""

    base: object  # a TensorRef (or, in memory, a tensor)
    shape: tuple[int, ...]
    patches: tuple[tuple[object, object], ...]

    def assemble(self) -> torch.Tensor:
        """The table, from resolved parts."""
        base = self.base
        out = base.new_zeros(self.shape)
        out[: base.shape[0]] = base
        for rows, values in self.patches:
            out[rows.to(out.device)] = values.to(out.device)
        return out


class DeltaTables:
    """Writes node-state tables to a checkpoint store as `RowDelta` chains, for the process
    that holds them: a table whose changed rows are known since its last write is written as
    those rows (a patch) over the base and patches written before, by reference; it is
    written whole (a new base) when its changed rows are unknown, when its patches since the
    base would hold more rows than `rebase` times the table, or when it goes to another
    store. Per-step cost is the holder's: it tracks which rows change."""

    def __init__(self, rebase: float = 0.5, max_patches: int = 16) -> None:
        self.rebase, self.max_patches = rebase, max_patches
        self.store: str | None = None
        self.chains: dict[str, tuple] = {}  # name -> (base ref, patches, rows in patches)

    def put(
        self, store: str, name: str, table: torch.Tensor, changed: torch.Tensor | None,
        have: set[str],
    ):  # fmt: skip
        """What to save for `table` (a ref or a `RowDelta`); `changed`: a bool mask of its
        rows changed since the last `put` of it to this store (None: unknown); `have`: the
        chunks the store holds (`CheckpointStore.chunk_keys`): a chain whose chunks are not
        all there any more (deleted by retention while checkpoints went another way) is not
        continued."""
        target = CheckpointStore.at(store)
        if store != self.store:
            self.store, self.chains = store, {}
        chain = self.chains.get(name)
        if chain is not None and not chunks_of([chain[0], chain[1]]) <= have:
            chain = None
        if changed is not None and changed.shape[0] != table.shape[0]:
            changed = None  # not this table's rows
        rows = None if changed is None else changed.nonzero().squeeze(1)
        if (chain is not None and rows is not None and chain[0].dtype == str(table.dtype)
                .removeprefix("torch.") and tuple(chain[0].shape[1:]) == tuple(table.shape[1:])
                and chain[0].shape[0] <= table.shape[0] and len(chain[1]) < self.max_patches
                and chain[2] + rows.numel() <= self.rebase * table.shape[0]):  # fmt: skip
            base, patches, count = chain
            if rows.numel():
                patch = target.put((rows.cpu(), table.index_select(0, rows)), 0, have)
                patches = (*patches, tuple(patch))
                self.chains[name] = (base, patches, count + rows.numel())
            return RowDelta(base, tuple(table.shape), patches)
        base = target.put(table, 0, have)
        self.chains[name] = (base, (), 0)
        return base

    def put_tables(self, store: str, tables: dict, model, have: set[str]) -> dict:
        """`tables` (name -> table, node state of `model`) as `put` writes them, with the
        rows `model.take_changed()` reports; when a write fails those rows go back to the
        model (`return_changed`): they count as changed at the next checkpoint."""
        changed = model.take_changed()
        try:
            return {name: self.put(store, name, t, changed, have) for name, t in tables.items()}
        except BaseException:
            model.return_changed(changed)
            raise

    def forget(self) -> None:
        """The tables were replaced (a load): their next writes are whole."""
        self.chains = {}


_GATHER = threading.local()  # `gathered`'s chunks and listing, in the thread that asked


def gathered(fn, have: set[str]):
    """`fn()` (a state put to a checkpoint store: `state_chunks`) for a process that does
    not reach the store, and the chunks it would have written there: its puts write
    nothing, the chunks the store lacks (`have`: what it holds, as the caller listed it;
    the store's listing within) are gathered as {key: bytes}. The caller, which reaches
    the store, writes them (`CheckpointStore.write_chunks`) before saving the refs: an
    actor on another node than a local run directory's sends what is new, once, not its
    whole state."""
    if getattr(_GATHER, "chunks", None) is not None:
        raise RuntimeError("gathered: already gathering in this thread")
    _GATHER.chunks, _GATHER.have = {}, have
    try:
        return fn(), _GATHER.chunks
    finally:
        _GATHER.chunks = _GATHER.have = None


def chunks_of(state) -> set[str]:
    """The chunk keys the refs in `state` (a checkpoint loaded unresolved, or refs `put`
    returned) name."""
    out: set[str] = set()
    _map(state, None, lambda r: out.update(r.chunks))
    return out


class CheckpointStore:
    """Checkpoints in directory `path` of file system `fs` (see the module's docstring)."""

    def __init__(self, fs: pafs.FileSystem, path: str) -> None:
        self.fs, self.path = fs, path.rstrip("/")
        self.last_written = 0  # bytes the newest `save` wrote (chunks and manifest)

    @classmethod
    def at(cls, uri: str) -> CheckpointStore:
        """The store at a local path or a URI `pyarrow.fs` opens."""
        fs, path = pafs.FileSystem.from_uri(uri) if "://" in uri else (pafs.LocalFileSystem(), uri)
        return cls(fs, path)

    # ---- writing ------------------------------------------------------------------------------

    def put(self, state, inline: int = INLINE, have: set[str] | None = None):
        """`state` with every tensor of `inline` bytes or more written as chunks (those the
        store lacks) and replaced by its `TensorRef`; any process that reaches the store may
        call it (an actor puts its own state, and the driver saves the refs it returns).
        `inline=0`: every tensor as chunks (what later checkpoints reference, however small,
        and should not carry inline in every manifest). `have`: the chunks the store holds
        (`chunk_keys`, taken once for several puts; the new ones are added to it)."""
        return self._put(state, self.chunk_keys() if have is None else have, inline)

    def chunk_keys(self) -> set[str]:
        """The keys of the chunks the store holds (one listing; within `gathered`, the
        caller's)."""
        if getattr(_GATHER, "chunks", None) is not None:
            return set(_GATHER.have)
        return self._blobs()

    def write_chunks(self, chunks: dict[str, bytes], have: set[str]) -> None:
        """Chunks another process gathered (`gathered`), those not in `have` (the store's,
        the new ones added to it)."""
        for key, data in chunks.items():
            if key not in have:
                self._write(f"blobs/{key}", data)
                have.add(key)

    def _blobs(self) -> set[str]:
        """Names of the files in blobs/ (one listing)."""
        return {p.rsplit("/", 1)[-1] for p in self._list("blobs")}

    def _put(self, state, have: set[str], inline: int = INLINE):
        """`put`, with `have` the chunks the store holds (the new ones are added to it)."""

        def put(t: torch.Tensor) -> TensorRef:
            data = _bytes(t)
            keys = []
            for a, b in _chunks(t, len(data)):
                key = hashlib.blake2b(data[a:b], digest_size=20).hexdigest()
                if key not in have:
                    gathering = getattr(_GATHER, "chunks", None)
                    if gathering is not None:  # for the caller to write (`gathered`)
                        gathering[key] = bytes(data[a:b])
                    else:
                        self._write(f"blobs/{key}", data[a:b])
                        self.last_written += b - a
                    have.add(key)
                keys.append(key)
            return TensorRef(str(t.dtype).removeprefix("torch."), tuple(t.shape), str(t.device),
                             tuple(keys))  # fmt: skip

        return _map(state, lambda t: put(t) if _chunked(t, inline) else _own(t))

    def save(self, state, tag: str, keep: int | None = None, meta: dict | None = None) -> None:
        """Write `state` (tensors, or refs `put` returned) as checkpoint `tag` (replacing one
        of that tag), name it `latest`, then keep the newest `keep` checkpoints (None: all).
        `meta`: a small JSON-able dict kept in the index (`meta(tag)`)."""
        if keep is not None and keep < 1:
            raise ValueError(f"CheckpointStore.save: keep must be >= 1, got {keep}")
        self.last_written = 0
        have = self._blobs()  # listed after the actors put theirs: all this save can see
        tree = self._put(state, have)
        refs = chunks_of(tree)
        missing = refs - have
        if missing:  # a writer that could not reach this store: refuse, keep the last one
            raise RuntimeError(
                f"checkpoint {tag}: {len(missing)} chunks it references are not "
                f"in {self.path}/blobs (written where this process cannot see)"
            )
        manifest = io.BytesIO()
        torch.save(tree, manifest)
        self._write(f"{tag}.pt", manifest.getbuffer())
        self.last_written += manifest.getbuffer().nbytes

        index = self._index()
        order = [x for x in index["order"] if x != tag] + [tag]
        index["blobs"][tag] = sorted(refs)
        index.setdefault("meta", {})[tag] = meta or {}
        kept = order if keep is None else order[-keep:]
        self._write("index.json", json.dumps({
            "order": kept, **{part: {x: index[part][x] for x in kept if x in index[part]}
                              for part in ("blobs", "meta")}}).encode())  # fmt: skip
        self._write("latest", tag.encode())
        self._prune(set(kept), {k for x in kept for k in index["blobs"].get(x, ())}, have)
        log.info("checkpoint %s: %d new bytes written, %d kept", tag, self.last_written, len(kept))

    def _prune(self, kept: set[str], referenced: set[str], blobs: set[str]) -> None:
        """Delete manifests not kept, and of `blobs` (the files in blobs/) the chunks not
        referenced and temporary files (`latest` names a kept checkpoint when this runs)."""
        for path in self._list(""):
            name = path.rsplit("/", 1)[-1]
            if name.endswith(".tmp") or (name.endswith(".pt") and name[:-3] not in kept):
                self.fs.delete_file(path)
        for name in blobs - referenced:  # temporary files are never referenced
            self.fs.delete_file(f"{self.path}/blobs/{name}")

    # ---- reading ------------------------------------------------------------------------------

    def latest(self) -> str | None:
        """The newest checkpoint's tag (None: no checkpoint yet)."""
        if not self._exists("latest"):
            return None
        return self._read("latest").decode().strip()

    def tags(self) -> list[str]:
        """The kept checkpoints, oldest first."""
        return list(self._index()["order"])

    def meta(self, tag: str) -> dict:
        """What `save` was given as `meta` for checkpoint `tag` ({} if nothing)."""
        return self._index().get("meta", {}).get(tag, {})

    def kept_meta(self) -> list[dict]:
        """`meta` of every kept checkpoint, oldest first (one read of the index)."""
        index = self._index()
        return [index.get("meta", {}).get(tag, {}) for tag in index["order"]]

    def load(self, tag: str | None = None, resolve: bool = True, host: bool = False):
        """Checkpoint `tag` (default: the newest), every tensor as it was saved (`resolve`
        False: large ones as refs, for `resolve` where they are needed; `host`: every tensor
        in host memory, whatever device it was saved from)."""
        tag = tag or self.latest()
        if tag is None:
            raise FileNotFoundError(f"{self.path}: no checkpoint")
        where = "cpu" if host else None
        state = torch.load(io.BytesIO(self._read(f"{tag}.pt")), weights_only=False,
                           map_location=where)  # fmt: skip
        if not resolve:
            return state
        return _assemble(_map(state, None, functools.partial(self._tensor, host=host)))

    def resolve(self, state):
        """`state` with its refs read back as tensors (and row deltas as their tables)."""
        return _assemble(_map(state, None, self._tensor))

    def _tensor(self, ref: TensorRef, host: bool = False) -> torch.Tensor:
        data = bytearray().join(self._read(f"blobs/{key}") for key in ref.chunks)
        dtype = getattr(torch, ref.dtype)
        t = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        t = t.view(dtype).reshape(ref.shape)
        if ref.device.startswith("cuda") and torch.cuda.is_available() and not host:
            t = t.to(ref.device)
        return t

    def bytes_on_disk(self) -> int:
        """Bytes of every file in the store."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True,
                                                        allow_not_found=True))  # fmt: skip
        return sum(i.size for i in infos if i.type == pafs.FileType.File)

    # ---- files --------------------------------------------------------------------------------

    def _index(self) -> dict:
        """The kept checkpoints; a directory of whole-file checkpoints (written before
        manifests) lists them oldest first (they reference no chunks)."""
        if self._exists("index.json"):
            return json.loads(self._read("index.json"))
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        latest = self.latest()  # on equal times (coarse clocks) the one `latest` names is newest
        old = sorted((i.mtime_ns, i.base_name[:-3] == latest, i.base_name[:-3])
                     for i in infos if i.base_name.endswith(".pt"))  # fmt: skip
        return {"order": [tag for *_, tag in old], "blobs": {}, "meta": {}}

    def _list(self, sub: str) -> list[str]:
        """Files in `sub`. Other processes write chunks there at the same time (a temporary
        name, then a move): a listing that meets an entry gone between reading the directory
        and looking at the entry fails (pyarrow: "Cannot list directory", ENOENT) and is
        taken again (bounded)."""
        selector = pafs.FileSelector(f"{self.path}/{sub}".rstrip("/"), allow_not_found=True)
        for attempt in range(1, 20):
            try:
                infos = self.fs.get_file_info(selector)
                break
            except FileNotFoundError:
                time.sleep(0.01 * attempt)
        else:
            infos = self.fs.get_file_info(selector)  # the 20th: its failure is the answer
        return [i.path for i in infos if i.type == pafs.FileType.File]

    def _exists(self, name: str) -> bool:
        return self.fs.get_file_info(f"{self.path}/{name}").type != pafs.FileType.NotFound

    def _write(self, name: str, data) -> None:
        write_file(self.fs, f"{self.path}/{name}", data)

    def _read(self, name: str) -> bytes:
        return read_file(self.fs, f"{self.path}/{name}")


def write_file(fs: pafs.FileSystem, path: str, data) -> None:
    """`data` (bytes or a buffer) as file `path`, whole or not at all: written to a temporary
    name of this writer's own, then moved into place (its directory made if missing)."""
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(data)
    fs.move(tmp, path)


def read_file(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def put_state(uri: str, state, inline: int = INLINE, have: set[str] | None = None):
    """`CheckpointStore.at(uri).put(state, inline, have)`: what an actor returns for a
    checkpoint."""
    return CheckpointStore.at(uri).put(state, inline, have)


def compact(state):
    """`state` with every tensor that views a larger storage copied into its own (a parameter
    view of a flat buffer would otherwise carry the whole buffer where it is sent)."""
    return _map(state, _own)


def _own(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided or t.is_quantized:
        return t
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


def _chunked(t: torch.Tensor, inline: int = INLINE) -> bool:
    """Whether tensor `t` is stored as chunks (`inline` bytes or more, dense, plain)."""
    return (t.layout == torch.strided and not t.is_quantized and not t.is_complex()
            and t.numel() * t.element_size() >= inline)  # fmt: skip


def pack_rows(cols: list[torch.Tensor]) -> torch.Tensor:
    """Rows [n, bytes]: the bytes of the 1-D columns' rows side by side (a table that grows
    at its end as one tensor: one chunk's tail rewritten per checkpoint, not one per column)."""
    n = cols[0].shape[0]
    return torch.cat([c.contiguous().view(torch.uint8).reshape(n, c.element_size()) for c in cols],
                     1)  # fmt: skip


def unpack_rows(rows: torch.Tensor, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """The columns `pack_rows` packed, given their dtypes."""
    out, at = [], 0
    for dtype in dtypes:
        width = torch.empty(0, dtype=dtype).element_size()
        col = rows[:, at : at + width].clone(memory_format=torch.contiguous_format)
        out.append(col.view(dtype).reshape(-1))  # its own, aligned storage
        at += width
    return out


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t`, row-major."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _chunks(t: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """Byte ranges of whole rows (along dim 0), about `CHUNK` bytes each."""
    if size == 0:  # no bytes (an empty tensor, rows of width 0): no chunk
        return []
    rows = t.shape[0] if t.dim() else 1
    row = size // max(rows, 1)
    step = max(1, CHUNK // max(row, 1)) * max(row, 1)
    return [(a, min(a + step, size)) for a in range(0, size, step)]


def _assemble(x):
    """`x` with every `RowDelta` (its parts resolved) replaced by its table."""
    if isinstance(x, RowDelta):
        return x.assemble()
    if isinstance(x, OrderedDict):
        out = OrderedDict((k, _assemble(v)) for k, v in x.items())
        if hasattr(x, "_metadata"):
            out._metadata = x._metadata
        return out
    if isinstance(x, dict):
        return {k: _assemble(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_assemble(v) for v in x]
    if isinstance(x, tuple) and not isinstance(x, torch.Size):
        values = [_assemble(v) for v in x]
        return type(x)(*values) if hasattr(x, "_fields") else tuple(values)
    return x


def _map(x, tensor=None, ref=None):
    """`x` with tensors through `tensor` and refs through `ref` (None: kept), containers
    (dict, OrderedDict, list, tuple, named tuple) rebuilt."""
    if isinstance(x, torch.Tensor):
        return tensor(x) if tensor is not None else x
    if isinstance(x, TensorRef):
        return ref(x) if ref is not None else x
    if isinstance(x, RowDelta):  # its parts mapped; `_assemble` makes it the table
        patches = tuple(tuple(_map(p, tensor, ref)) for p in x.patches)
        return RowDelta(_map(x.base, tensor, ref), x.shape, patches)
    if isinstance(x, OrderedDict):  # a module's state dict: its `_metadata` (versions) kept
        out = OrderedDict((k, _map(v, tensor, ref)) for k, v in x.items())
        if hasattr(x, "_metadata"):
            out._metadata = x._metadata
        return out
    if isinstance(x, dict):
        return {k: _map(v, tensor, ref) for k, v in x.items()}
    if isinstance(x, list):
        return [_map(v, tensor, ref) for v in x]
    if isinstance(x, tuple):
        values = [_map(v, tensor, ref) for v in x]
        return type(x)(*values) if hasattr(x, "_fields") else tuple(values)
    return x
