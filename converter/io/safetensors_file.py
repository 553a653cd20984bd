"""One safetensors file, read by byte range or front to back once: the header parsed and checked before any data.

We parse the safetensors header ourselves (converter.io.safetensors_header) so that a truncated or corrupt file is
reported with its name before any work starts, and so untouched tensors can be copied as raw bytes.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from converter.errors import BadInputError
from converter.io import dtypes
from converter.io.background import Worker
from converter.io.dtypes import ITEMSIZE
from converter.io.lazy import torch
from converter.io.safetensors_header import HeaderError, decode_header

CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


class SafetensorsFile:
    """One .safetensors file: header parsed and checked eagerly, tensor bytes read on demand."""

    # A file fetched for one job (converter.jobs.streaming) sets these: `arrival(end)` returns once bytes [0, end) are
    # on disk; `release(after, tensor)` is called once the merge has read everything it needs of `tensor` (None: of
    # the whole file; `after`: the last output tensor that read it). None: a complete file that stays.
    arrival = None
    release = None

    def __init__(self, path: Path):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            try:
                header, self.header_bytes = decode_header(f, self.size)
            except HeaderError as e:
                raise self._bad(str(e)) from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict) or not all(isinstance(v, str) for v in self.metadata.values()):
            raise self._bad("__metadata__ must map names to strings")
        self.tensors: dict[str, TensorInfo] = {}
        data_end = 0
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor {name!r} has a malformed header entry", name) from None
            if not isinstance(dtype, str) or dtype not in ITEMSIZE:
                raise self._bad(f"tensor {name!r} has unsupported dtype {dtype!r}", name)
            if not all(_count(n) for n in (*shape, begin, end)):
                raise self._bad(f"tensor {name!r}: shape and data_offsets must be non-negative integers", name)
            if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
                raise self._bad(f"tensor {name!r}: byte range does not match its shape {list(shape)}", name)
            self.tensors[name] = TensorInfo(name, dtype, shape, self.header_bytes + begin, self.header_bytes + end)
            data_end = max(data_end, end)
        spans = sorted((t.start, t.end, t.name) for t in self.tensors.values() if t.end > t.start)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise self._bad(
                    f"tensors {first!r} and {second!r} share bytes (overlapping data_offsets; corrupt)", first
                )
        if self.header_bytes + data_end > self.size:
            missing = self.header_bytes + data_end - self.size
            raise self._bad(f"file is truncated: {missing} bytes of tensor data are missing (re-download it)")

    def _bad(self, why: str, tensor: str | None = None) -> BadInputError:
        return BadInputError(f"{self.path}: {why}", file=self.path, tensor=tensor)

    def wait(self, end: int) -> None:
        """Return once bytes [0, end) of the file are there (at once unless it is still being downloaded)."""
        if self.arrival is not None:
            self.arrival(end)

    def read_bytes(self, name: str) -> np.ndarray:
        """One tensor's raw bytes (a fresh, writable uint8 array)."""
        info = self.tensors[name]
        self.wait(info.end)
        buf = buffer(info.nbytes)
        with open(self.path, "rb") as f:
            f.seek(info.start)
            if f.readinto(buf) != info.nbytes:
                raise self._bad(f"tensor {name!r} could not be read completely (truncated file)", name)
        return buf

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into memory (a fresh, writable tensor)."""
        return as_tensor(self.read_bytes(name), self.tensors[name])


def buffer(nbytes: int) -> np.ndarray:
    """Room for `nbytes` read from a file: numpy's allocation, not zero-filled like a bytearray, and in huge pages
    where the kernel allows (numpy asks for them above 4 MiB): far fewer page faults for a large tensor."""
    return np.empty(nbytes, np.uint8)


def as_tensor(buf, info: TensorInfo) -> torch.Tensor:
    """A torch view of a tensor's bytes (torch is imported here, on first use)."""
    if len(buf) == 0:
        return torch.empty(info.shape, dtype=dtypes.ST_TO_TORCH[info.dtype])
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtypes.ST_TO_TORCH[info.dtype]).reshape(info.shape)


class SequentialReader:
    """Reads one file front to back exactly once, hashing every byte on the way (sha256 for provenance).

    Tensors must be requested in file order; the bytes between and after them are hashed too. With `sha256`
    (a Hub file: its LFS id) nothing is hashed and that is the answer.
    """

    def __init__(self, file: SafetensorsFile, sha256: str | None = None):
        self.file = file
        # Unbuffered: a buffered reader reads ahead, and a file still arriving has holes (zeros) past that point.
        self._f = open(file.path, "rb", buffering=0)  # noqa: SIM115 - closed in finish()
        self._pos = 0
        self._known = sha256
        self._hash = hashlib.sha256()
        # Hashing runs on another core (hashlib releases the GIL); buffers handed to it are never mutated.
        self._hasher = None if sha256 else Worker(self._hash.update, name="converter-sha256")
        self._dropped = 0
        self._digest: str | None = None

    def _forget(self) -> None:
        """Tell the kernel the bytes read so far are not needed again (each base byte is read once)."""
        if self._pos - self._dropped >= 128 * 2**20:
            os.posix_fadvise(self._f.fileno(), 0, self._pos, os.POSIX_FADV_DONTNEED)
            self._dropped = self._pos

    def _hashed(self, chunk) -> None:
        if self._hasher is not None:
            self._hasher.put(chunk)

    def _advance(self, to: int, sink=None) -> None:
        while self._pos < to:
            n = min(CHUNK, to - self._pos)
            self.file.wait(self._pos + n)
            chunk = self._f.read(n)  # one read(2): may be short, the loop goes on from where it stopped
            if not chunk:
                raise self.file._bad("unexpected end of file (truncated while reading)")
            self._hashed(chunk)
            if sink is not None:
                sink(chunk)
            self._pos += len(chunk)
            self._forget()

    def copy(self, info: TensorInfo, sink) -> None:
        """Stream a tensor's raw bytes to `sink` in chunks, without holding it whole."""
        self._advance(info.start)
        self._advance(info.end, sink)

    def read_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, hashed in the background: callers must not modify them."""
        self._advance(info.start)
        self.file.wait(info.end)
        buf = buffer(info.nbytes)
        view, got = memoryview(buf), 0
        while got < info.nbytes:
            n = self._f.readinto(view[got:])
            if not n:
                raise self.file._bad(f"tensor {info.name!r} could not be read completely (truncated file)", info.name)
            got += n
        self._hashed(buf)
        self._pos = info.end
        self._forget()
        return buf

    def read(self, info: TensorInfo) -> torch.Tensor:
        """The tensor, on a buffer that is hashed in the background: callers must not modify it in place."""
        return as_tensor(self.read_bytes(info), info)

    def finish(self) -> str:
        """Hash the rest of the file (unless its sha256 is known) and return its sha256. Idempotent."""
        if self._digest is None:
            if self._hasher is not None:
                self._advance(self.file.size)
            self._f.close()
            if self._hasher is not None:
                self._hasher.close()
            self._digest = self._known or self._hash.hexdigest()
        return self._digest

    def abort(self) -> None:
        if self._hasher is not None:
            self._hasher.abort()
        self._f.close()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
