"""The safetensors header, encoded and decoded in one place: an 8-byte little-endian length, then JSON.

We write headers ourselves (shards are streamed: the header must be final before any data) and read them
ourselves (a truncated or corrupt file is named before work starts). The encoding is the safetensors
library's own: compact JSON, UTF-8 unescaped, padded with spaces to a multiple of 8 bytes so tensor data
starts aligned; tests compare bytes with the library's output.
"""

from __future__ import annotations

import json
from typing import BinaryIO

MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


class HeaderError(ValueError):
    """A header that cannot be decoded; the message says why, the caller adds the file name."""


def entry(dtype: str, shape: tuple[int, ...] | list[int], begin: int, end: int) -> dict:
    """One tensor's header entry; `begin`/`end` are offsets into the data section (after the header)."""
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def encode_header(tensors: dict[str, dict], metadata: dict[str, str] | None = None) -> bytes:
    """Length prefix + JSON for `tensors` (name -> entry, in data order) and optional `__metadata__`."""
    header = {"__metadata__": metadata, **tensors} if metadata else dict(tensors)
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def decode_header(f: BinaryIO, size: int) -> tuple[dict, int]:
    """Read the header at the start of `f` (a file of `size` bytes): (parsed JSON object, bytes before the
    data). Raises HeaderError for a short file, an impossible length, invalid JSON, a name given twice (JSON
    would silently keep the last) or a non-object."""
    head = f.read(8)
    if len(head) < 8:
        raise HeaderError("file is shorter than a safetensors header")
    length = int.from_bytes(head, "little")
    if length > MAX_HEADER or 8 + length > size:
        raise HeaderError("header length is larger than the file (truncated or not safetensors)")
    raw = f.read(length)
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise HeaderError("header is not valid JSON (corrupt or not safetensors)") from None
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    return header, 8 + length


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise HeaderError(f"header names {key!r} twice (corrupt file)")
        out[key] = value
    return out
