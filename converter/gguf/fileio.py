"""gguf's own reader and writer, with the metadata's long arrays (a vocabulary's tokens, scores, token types and
merges) read and packed in bulk.

Why: gguf handles an array one element at a time (a numpy view or a struct call each, through its recursive field
parser and packer), so a 49,152-token vocabulary cost about a second to write and one to three to read, per file:
more than all the tensors of a small model. The bulk paths make the same bytes and the same fields (parts, indices,
types) as gguf's; anything else (nested arrays, empty ones, big-endian files) takes gguf's own path.
tests/gguf/test_gguf.py compares both classes with gguf's on a real vocabulary.
"""

from __future__ import annotations

import struct
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

ARRAY, STRING = GGUFValueType.ARRAY, GGUFValueType.STRING


class Reader(gguf.GGUFReader):
    """gguf's reader, parsing a plain array view of the file's memory map (slicing an np.memmap runs its
    __array_finalize__ each time), with arrays of strings and scalars split in bulk. The mapping stays open while
    the reader or a tensor's data is held."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list[GGUFValueType]]:
        if raw_type != ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        sub, n = GGUFValueType(int(item_type[0])), int(count[0])
        scalar = self.gguf_scalar_to_np.get(sub)
        if n == 0 or (sub != STRING and scalar is None):
            return super()._get_field_parts(orig_offs, raw_type)
        parts: list[np.ndarray] = [item_type, count]
        offs = orig_offs + 12
        if sub == STRING:  # each string: its length (uint64) and its bytes, the bytes being the data
            data, raw = self.data, memoryview(self.data)
            for _ in range(n):
                (size,) = struct.unpack_from("<Q", raw, offs)
                parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + size])
                offs += 8 + size
            return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), [ARRAY, STRING]
        values = self._get(offs, scalar, n)
        parts += list(values.reshape(n, 1))  # one (1,)-shaped view per element, as gguf makes them
        return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), [ARRAY, sub]


class Writer(gguf.GGUFWriter):
    """gguf's writer, packing a flat array of strings or scalars in one call instead of one per element."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool,
                  sub_type: GGUFValueType | None = None) -> bytes:  # fmt: skip
        if (vtype != ARRAY or self.endianess != gguf.GGUFEndian.LITTLE or not isinstance(val, (list, tuple))
                or not val):  # fmt: skip
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        item_type = sub_type if sub_type is not None else GGUFValueType.get_type(val[0])
        if sub_type is None and not all(GGUFValueType.get_type(v) is item_type for v in val):
            return super()._pack_val(val, vtype, add_vtype, sub_type)  # gguf's own error
        head = struct.pack("<IIQ", vtype, item_type, len(val)) if add_vtype else struct.pack("<IQ", item_type, len(val))
        if item_type == STRING:
            encoded = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
            return head + b"".join(struct.pack("<Q", len(e)) + e for e in encoded)
        fmt = self._simple_value_packing.get(item_type)
        if fmt is None:  # arrays of arrays
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        return head + struct.pack(f"<{len(val)}{fmt}", *val)
