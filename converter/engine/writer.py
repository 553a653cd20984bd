"""Sharded safetensors output written tensor by tensor, and the atomic output folder (staged beside it).

Every output tensor's dtype and shape are known before the first byte is written, so each shard's header is
final when the shard is opened and tensors are streamed into it in order: memory never holds a shard.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from converter.errors import OutputError
from converter.io import libc, scratch
from converter.io.background import Worker
from converter.io.dtypes import ITEMSIZE
from converter.io.safetensors_header import encode_header, entry


@dataclass(frozen=True)
class Shard:
    """A finished output file, durable on disk: what an uploader needs without reading it again."""

    path: Path
    name: str  # its path inside the output folder (the repo path)
    sha256: str
    size: int
    sample: bytes  # the first 512 bytes (the Hub's upload-mode check looks at them)
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class OutSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


DROP_EVERY = 64 * 2**20


def _sync_file_range(fd: int, offset: int, length: int, flags: int) -> bool:
    """Linux sync_file_range(2) (not in the os module): start or wait for writeback of a byte range without the
    disk-cache flush that fdatasync issues. False where it is not available."""
    call = libc.function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return call is not None and call(fd, offset, length, flags) == 0


_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4


class _Writeback:
    """Streams a file out of the page cache as it is written: each 64 MiB window is handed to writeback at once,
    the one before it is waited for and dropped. Why: the page cache would otherwise grow by the model's size
    (charged to a memory cgroup), and an fdatasync per window would flush the disk's cache each time."""

    def __init__(self, f):
        self.f, self.done, self.kicked = f, 0, 0

    def wrote(self, end: int) -> None:
        if end - self.kicked < DROP_EVERY:
            return
        self.f.flush()
        fd = self.f.fileno()
        if not _sync_file_range(fd, self.kicked, end - self.kicked, _WRITE):
            _drop_cache(self.f)  # no sync_file_range: the old way
            self.done = self.kicked = end
            return
        if self.kicked > self.done:  # the previous window: written back by now, mostly
            _sync_file_range(fd, self.done, self.kicked - self.done, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            os.posix_fadvise(fd, self.done, self.kicked - self.done, os.POSIX_FADV_DONTNEED)
            self.done = self.kicked
        self.kicked = end


def _drop_cache(f) -> None:
    """Make written pages durable and let the kernel drop them (a shard's end: durable before the rename)."""
    f.flush()
    os.fdatasync(f.fileno())
    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def plan_shards(specs: list[OutSpec], max_shard_bytes: int) -> list[list[OutSpec]]:
    """Greedy split in order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[OutSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_names(count: int, stem: str = "model") -> list[str]:
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(shard: list[OutSpec], metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
    tensors, offset = {}, 0
    for spec in shard:
        tensors[spec.name] = entry(spec.dtype, spec.shape, offset, offset + spec.nbytes)
        offset += spec.nbytes
    return encode_header(tensors, {**dict(metadata), "format": "pt"})


class ShardedWriter:
    """Writes `specs` in the given order into shards of at most `max_shard_bytes`, plus the index."""

    def __init__(
        self,
        folder: Path,
        specs: list[OutSpec],
        max_shard_bytes: float,
        stem: str = "model",
        single_file: str | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
        on_shard: Callable[[Shard], None] | None = None,
    ):
        """`stem` names the shards (`diffusion_pytorch_model` in diffusers components); `single_file` writes one
        file of exactly that name (a single-file checkpoint keeps its own); `metadata` goes into every header.
        `on_shard` is called (on the writer thread, so it may block to hold the merge back) with each shard as
        soon as it is durable, its sha256 taken from the bytes as they were written (no second read)."""
        self.folder = folder
        self.stem = stem
        self.metadata = metadata
        self.shards = plan_shards(specs, max_shard_bytes)
        self.names = [single_file] if single_file and len(self.shards) == 1 else shard_names(len(self.shards), stem)
        self._order = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._next = 0
        self._shard = -1
        self._f = None
        self._on_shard = on_shard
        # File writes run on another core; callables queued in between open and close shards in order.
        self._io = Worker(lambda item: item() if callable(item) else self._put(item), name="converter-writer")

    def write(self, name: str, produce: Callable[[Callable[[bytes], None]], None]) -> None:
        """Write the next tensor: `produce(sink)` must pass exactly the tensor's bytes to sink, in order."""
        index, spec = self._order[self._next]
        if spec.name != name:
            raise AssertionError(f"writer expected {spec.name}, got {name}")
        if index != self._shard:
            self._io.put(self._close_shard)
            self._shard = index
            self._io.put(lambda path=self.folder / self.names[index], i=index: self._open_shard(path, i))
            self._io.put(_header(self.shards[index], self.metadata))
        written = 0

        def sink(chunk: bytes) -> None:
            """Queue `chunk` for writing; it must not change afterwards (bytes, or a view of a tensor we drop)."""
            nonlocal written
            self._io.put(chunk)
            written += len(chunk)

        produce(sink)
        if written != spec.nbytes:
            raise AssertionError(f"{name}: wrote {written} bytes, expected {spec.nbytes}")
        self._next += 1

    def _put(self, chunk) -> None:
        self._f.write(chunk)
        if self._sha is not None:
            self._sha.update(chunk)
            if len(self._sample) < 512:
                self._sample += bytes(chunk[: 512 - len(self._sample)])
        self._written += len(chunk)
        self._writeback.wrote(self._written)

    def _open_shard(self, path: Path, index: int) -> None:
        self._f = open(path, "wb")  # noqa: SIM115 - closed in _close_shard
        self._writeback, self._written, self._index = _Writeback(self._f), 0, index
        self._sha, self._sample = (hashlib.sha256(), b"") if self._on_shard else (None, b"")

    def _close_shard(self) -> None:
        if self._f is not None:
            _drop_cache(self._f)
            path = Path(self._f.name)
            self._f.close()
            self._f = None
            scratch.stop_here("shard")
            if self._on_shard is not None:
                names = tuple(s.name for s in self.shards[self._index])
                shard = Shard(path, path.name, self._sha.hexdigest(), self._written, self._sample, names)
                self._on_shard(shard)

    def close(self) -> list[str]:
        """Finish the last shard and write the index (for more than one shard). Returns the file names."""
        if self._next != len(self._order):
            raise AssertionError(f"writer closed after {self._next} of {len(self._order)} tensors")
        self._io.put(self._close_shard)
        self._io.close()
        if len(self.names) == 1:
            return self.names
        index = {
            "metadata": {"total_size": sum(s.nbytes for shard in self.shards for s in shard)},
            "weight_map": {s.name: self.names[i] for i, shard in enumerate(self.shards) for s in shard},
        }
        (self.folder / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return [*self.names, f"{self.stem}.safetensors.index.json"]

    def abort(self) -> None:
        self._io.abort()
        if self._f is not None:
            self._f.close()


def check_output_target(out: Path, force: bool) -> None:
    """Refuse a non-empty `out` (unless `force`) and a target another live run is writing right now."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise OutputError(f"{out}: output already exists and is not empty (use --force to replace it)", path=out)
    _refuse_if_busy(out, scratch.live(out.parent, _lead(out)))


def _lead(out: Path) -> str:
    return f".{out.name}."


def _refuse_if_busy(out: Path, others: list[tuple[scratch.Owned, Path]]) -> None:
    if others:
        owned, path = others[0]
        raise OutputError(
            f"{out}: another converter run ({owned.owner.describe()}) is writing it right now; wait for it to finish "
            f"(if that run is gone, remove {path})",
            path=out,
        )


@contextmanager
def atomic_folder(out: Path, force: bool, needs: int | None = None, log: Callable[[str], None] = print):
    """Yield a folder to fill; on success it replaces `out` in one rename, on failure it disappears.

    It lives in an owned staging folder beside `out` (`scratch`): leftovers of interrupted runs on the same
    target are removed first, and a second run on a target a live run is writing is refused. `needs` (bytes)
    goes into the error when the disk fills up on the way."""
    check_output_target(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _staging(out, log) as payload:
            yield payload
            scratch.stop_here("staged")
            if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):  # a run that was quicker
                raise OutputError(f"{out}: another run wrote it meanwhile (use --force to replace it)", path=out)
            if out.exists():  # --force: the old output goes into our staging folder, removed with it
                out.rename(payload.parent / f"{out.name}.previous")
            payload.rename(out)
    except OSError as e:
        if e.errno in scratch.DISK_FULL:
            raise scratch.disk_full(out.parent, needs) from None
        raise


@contextmanager
def _staging(out: Path, log: Callable[[str], None]):
    """An owned folder beside `out` holding `<out.name>` to fill; removed at the end whatever happens."""
    scratch.sweep(out.parent, log, _lead(out))
    stage = out.parent / scratch.owned_name("out", _lead(out))
    stage.mkdir()
    try:
        # Two runs that got here together both see each other: the one whose folder is older goes on.
        mine = scratch.owner_of(stage).made
        _refuse_if_busy(out, [(o, p) for o, p in scratch.live(out.parent, _lead(out)) if (o.made, p) < (mine, stage)])
        payload = stage / out.name
        payload.mkdir()
        yield payload
    finally:
        scratch.remove(stage)
