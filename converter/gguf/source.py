"""A Hugging Face model folder as the GGUF writer needs it: config, tokenizer files, and its tensors read one at a
time as float32 numpy arrays.

Why our own reader: the writer must know every tensor's name and shape before it writes a byte (a GGUF header lists
them all), and then read each tensor once, so memory holds one tensor, never the model; bfloat16 widens to float32
exactly by a bit shift, without torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from converter.errors import BadInputError
from converter.io.safetensors_header import HeaderError, decode_header

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def decode(raw: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's safetensors bytes as float32 (exact for F32 / F16 / BF16)."""
    data = np.frombuffer(raw, dtype=_DTYPES[dtype]).reshape(shape)
    if dtype == "BF16":
        # bfloat16 is the high half of a float32: written into the high halves of zeroed words, one pass (widening
        # to uint32 and shifting made two temporaries and took 14x longer)
        words = np.empty((*shape, 2), np.uint16)
        words[..., 0] = 0
        words[..., 1] = data
        return words.view(np.float32).reshape(shape)
    return data.astype(np.float32)


def check_dtype(where: object, name: str, dtype: str) -> None:
    if dtype not in _DTYPES:
        raise BadInputError(f"{where}: {name} is {dtype}; GGUF export reads F32, F16 and BF16 weights",
                            file=where, tensor=name)  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file, its byte range there, its dtype and shape."""

    file: Path | None  # None: a tensor not on disk yet (a merge's output, converter.gguf.stream)
    begin: int
    end: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Source:
    folder: Path
    config: dict
    tensors: dict[str, Entry] = field(default_factory=dict)

    def read(self, name: str) -> np.ndarray:
        """One tensor as float32 (exact for F32 / F16 / BF16 sources)."""
        e = self.tensors[name]
        with open(e.file, "rb") as f:
            f.seek(e.begin)
            raw = f.read(e.end - e.begin)
        if len(raw) != e.end - e.begin:
            raise BadInputError(f"{e.file}: {name} is cut short (the file is truncated)", file=e.file, tensor=name)
        return decode(raw, e.dtype, e.shape)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.tensors:
            yield name, self.read(name)


def open_source(folder: str | os.PathLike) -> Source:
    """Read the folder's config.json and every safetensors header; a missing or unreadable part is named."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise BadInputError(f"{folder}: no config.json (give a Hugging Face model folder)", file=folder)
    config = json.loads(config_file.read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise BadInputError(f"{folder}: no .safetensors files (GGUF is written from safetensors)", file=folder)
    source = Source(folder, config)
    for path in files:
        size = path.stat().st_size
        with open(path, "rb") as f:
            try:
                header, start = decode_header(f, size)
            except HeaderError as e:
                raise BadInputError(f"{path}: {e}", file=path) from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            check_dtype(path, name, info["dtype"])
            begin, end = info["data_offsets"]
            source.tensors[name] = Entry(path, start + begin, start + end, info["dtype"], tuple(info["shape"]))
    return source
