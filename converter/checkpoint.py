"""Lazy, validated views of safetensors files and model folders: names, shapes, dtypes; one tensor at a time.

We parse the safetensors header ourselves (8-byte length + JSON) so that a truncated or corrupt file is
reported with its name before any work starts, and so untouched tensors can be copied as raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from converter.background import Worker
from converter.dtypes import ITEMSIZE, ST_TO_TORCH
from converter.errors import ConverterError

MAX_HEADER = 100 * 1024 * 1024
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


class SafetensorsFile:
    """One .safetensors file: header parsed and checked eagerly, tensor bytes read on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise self._bad("file is shorter than a safetensors header")
            header_len = int.from_bytes(head, "little")
            if header_len > MAX_HEADER or 8 + header_len > self.size:
                raise self._bad("header length is larger than the file (truncated or not safetensors)")
            raw = f.read(header_len)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self._bad("header is not valid JSON (corrupt or not safetensors)") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        self.header_bytes = 8 + header_len
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, TensorInfo] = {}
        data_end = 0
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor {name!r} has a malformed header entry") from None
            if dtype not in ST_TO_TORCH:
                raise self._bad(f"tensor {name!r} has unsupported dtype {dtype}")
            if end - begin != math.prod(shape) * ITEMSIZE[dtype] or begin < 0:
                raise self._bad(f"tensor {name!r}: byte range does not match its shape {list(shape)}")
            self.tensors[name] = TensorInfo(name, dtype, shape, self.header_bytes + begin, self.header_bytes + end)
            data_end = max(data_end, end)
        if self.header_bytes + data_end > self.size:
            missing = self.header_bytes + data_end - self.size
            raise self._bad(f"file is truncated: {missing} bytes of tensor data are missing (re-download it)")

    def _bad(self, why: str) -> ConverterError:
        return ConverterError(f"{self.path}: {why}")

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into memory (a fresh, writable tensor)."""
        info = self.tensors[name]
        buf = bytearray(info.nbytes)
        with open(self.path, "rb") as f:
            f.seek(info.start)
            if f.readinto(buf) != info.nbytes:
                raise self._bad(f"tensor {name!r} could not be read completely (truncated file)")
        if not buf:
            return torch.empty(info.shape, dtype=ST_TO_TORCH[info.dtype])
        return torch.frombuffer(buf, dtype=torch.uint8).view(ST_TO_TORCH[info.dtype]).reshape(info.shape)


class SequentialReader:
    """Reads one file front to back exactly once, hashing every byte on the way (sha256 for provenance).

    Tensors must be requested in file order; the bytes between and after them are hashed too.
    """

    def __init__(self, file: SafetensorsFile):
        self.file = file
        self._f = open(file.path, "rb")  # noqa: SIM115 - closed in finish()
        self._pos = 0
        self._hash = hashlib.sha256()
        # Hashing runs on another core (hashlib releases the GIL); buffers handed to it are never mutated.
        self._hasher = Worker(self._hash.update, name="converter-sha256")
        self._dropped = 0

    def _forget(self) -> None:
        """Tell the kernel the bytes read so far are not needed again (each base byte is read once)."""
        if self._pos - self._dropped >= 128 * 2**20:
            os.posix_fadvise(self._f.fileno(), 0, self._pos, os.POSIX_FADV_DONTNEED)
            self._dropped = self._pos

    def _advance(self, to: int, sink=None) -> None:
        while self._pos < to:
            chunk = self._f.read(min(CHUNK, to - self._pos))
            if not chunk:
                raise self.file._bad("unexpected end of file (truncated while reading)")
            self._hasher.put(chunk)
            if sink is not None:
                sink(chunk)
            self._pos += len(chunk)
            self._forget()

    def copy(self, info: TensorInfo, sink) -> None:
        """Stream a tensor's raw bytes to `sink` in chunks, without holding it whole."""
        self._advance(info.start)
        self._advance(info.end, sink)

    def read(self, info: TensorInfo) -> torch.Tensor:
        """The tensor, on a buffer that is hashed in the background: callers must not modify it in place."""
        self._advance(info.start)
        buf = bytearray(info.nbytes)
        if self._f.readinto(buf) != info.nbytes:
            raise self.file._bad(f"tensor {info.name!r} could not be read completely (truncated file)")
        self._hasher.put(buf)
        self._pos = info.end
        self._forget()
        if not buf:
            return torch.empty(info.shape, dtype=ST_TO_TORCH[info.dtype])
        return torch.frombuffer(buf, dtype=torch.uint8).view(ST_TO_TORCH[info.dtype]).reshape(info.shape)

    def finish(self) -> str:
        """Hash the rest of the file and return its sha256."""
        self._advance(self.file.size)
        self._f.close()
        self._hasher.close()
        return self._hash.hexdigest()

    def abort(self) -> None:
        self._hasher.abort()
        self._f.close()


WEIGHT_INDEXES = ("model.safetensors.index.json",)


class Checkpoint:
    """A model folder: config.json plus safetensors weights (one file or shards with an index)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConverterError(f"{self.folder}: base is not a folder (expected a model folder with config.json)")
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise ConverterError(f"{self.folder}: not a model folder: no config.json (point --base at the folder)")
        try:
            self.config: dict = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ConverterError(f"{config_path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        self.files = [SafetensorsFile(p) for p in self._weight_files()]
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self.where:
                    raise ConverterError(f"{f.path}: tensor {name!r} also appears in {self.where[name].path.name}")
                self.where[name] = f

    def _weight_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError):
                raise ConverterError(f"{index}: not a valid safetensors index (no weight_map)") from None
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.folder / n).is_file()]
            if missing:
                raise ConverterError(
                    f"{index}: lists shard {missing[0]} which is not in the folder (incomplete download?)"
                )
            return [self.folder / n for n in names]
        files = sorted(self.folder.glob("*.safetensors"))
        if files:
            return files
        if any(self.folder.glob("*.bin")) or any(self.folder.glob("*.pt")):
            raise ConverterError(
                f"{self.folder}: the base has only pickle weights (.bin/.pt); save it as safetensors first "
                "(transformers: model.save_pretrained(folder))"
            )
        raise ConverterError(f"{self.folder}: not a model folder: no *.safetensors weights found")

    def names(self) -> list[str]:
        """Tensor names in file order (file by file, by byte offset): the order a sequential read takes."""
        out = []
        for f in self.files:
            out.extend(sorted(f.tensors, key=lambda n, f=f: f.tensors[n].start))
        return out

    def info(self, name: str) -> TensorInfo:
        return self.where[name].tensors[name]

    def read(self, name: str) -> torch.Tensor:
        return self.where[name].read(name)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
