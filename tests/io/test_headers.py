"""The one safetensors header codec, checked against the safetensors library itself: the bytes it writes are the
bytes we write (compact JSON, raw UTF-8, padded with spaces to a multiple of 8), and what we write it reads."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load, save

from converter.errors import ConverterError
from converter.hub.remote_headers import write_standin
from converter.io.safetensors_file import SafetensorsFile
from converter.io.safetensors_header import HeaderError, decode_header, encode_header, entry

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    **{f"name of {n} chars": ({"w" * n: torch.ones(2, 3), "b": torch.zeros(5, dtype=torch.bfloat16)}, None)
       for n in range(1, 9)},  # every remainder mod 8, so every padding length
    "metadata": ({"a.weight": torch.arange(6, dtype=torch.int64)}, {"format": "pt", "note": "x y"}),
    "non-ASCII names and metadata": ({"é.wéight": torch.ones(1)}, {"模型": "Straße"}),
    "empty file": ({}, None),
    "empty tensor": ({"z": torch.zeros(0, 4)}, {"format": "pt"}),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_round_trip_gives_the_librarys_bytes(case):
    tensors, metadata = CASES[case]
    blob = save(tensors, metadata=metadata)
    header, data_start = decode_header(io.BytesIO(blob), len(blob))
    assert (data_start - 8) % 8 == 0
    stored = {k: v for k, v in header.items() if k != "__metadata__"}
    assert header.get("__metadata__") == metadata
    assert encode_header(stored, header.get("__metadata__")) == blob[:data_start]  # byte for byte


@pytest.mark.parametrize("case", CASES)
def test_what_we_encode_the_library_reads(case):
    tensors, metadata = CASES[case]
    entries, data, offset = {}, b"", 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        entries[name] = entry({torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}[t.dtype],
                              t.shape, offset, offset + len(raw))  # fmt: skip
        data += raw
        offset += len(raw)
    head = encode_header(entries, metadata)
    length = int.from_bytes(head[:8], "little")
    assert length == len(head) - 8 and length % 8 == 0
    json_end = len(head[8:].rstrip(b" "))
    assert length - json_end < 8 and set(head[8 + json_end :]) <= {ord(" ")}  # space padding, under 8 bytes
    back = load(head + data)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize(
    "blob, why",
    [
        (b"\x01\x02", "shorter than a safetensors header"),
        ((1000).to_bytes(8, "little") + b"{}", "header length is larger than the file"),
        ((8).to_bytes(8, "little") + b"{not js}", "not valid JSON"),
        ((8).to_bytes(8, "little") + b"\xff\xfe{}    ", "not valid JSON"),
        ((8).to_bytes(8, "little") + b"[1,2,3] ", "not a JSON object"),
    ],
    ids=["short", "length", "json", "utf8", "array"],
)
def test_undecodable_headers_say_why_and_name_the_file(blob, why, tmp_path):
    with pytest.raises(HeaderError, match=why):
        decode_header(io.BytesIO(blob), len(blob))
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(ConverterError, match=rf"{path}: .*{why}"):
        SafetensorsFile(path)


def test_a_standin_has_the_real_files_header_bytes_and_length(tmp_path):
    """A Hub base's stand-in (from the parsed header the Hub client returns) starts with exactly the bytes of
    the real file's header and has its length, the data a hole."""
    real = tmp_path / "model.safetensors"
    real.write_bytes(save({"b.weight": torch.ones(512, 1024), "a.bias": torch.zeros(3, dtype=torch.bfloat16)},
                          metadata={"format": "pt"}))  # fmt: skip
    parsed = SafetensorsFile(real)
    meta = SimpleNamespace(
        metadata=parsed.metadata,
        tensors={n: SimpleNamespace(dtype=t.dtype, shape=list(t.shape),
                                    data_offsets=(t.start - parsed.header_bytes, t.end - parsed.header_bytes))
                 for n, t in parsed.tensors.items()},
    )  # fmt: skip
    standin = tmp_path / "standin.safetensors"
    write_standin(standin, meta)
    assert standin.read_bytes()[: parsed.header_bytes] == real.read_bytes()[: parsed.header_bytes]
    assert standin.stat().st_size == real.stat().st_size
    assert standin.stat().st_blocks * 512 < real.stat().st_size // 4


def test_headers_are_encoded_and_decoded_only_by_the_codec():
    """No second copy of the 8-byte length prefix in the package (the test Hub server parses headers on its own
    on purpose: it stands in for the real Hub, so it must not share the code it is testing)."""
    offenders = []
    for path in sorted((ROOT / "converter").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "converter/io/safetensors_header.py" or rel.startswith("converter/testing/hub/"):
            continue
        text = path.read_text()
        if ".to_bytes(8" in text or "int.from_bytes(" in text:
            offenders.append(rel)
    assert offenders == []


def test_the_shard_writers_header_is_the_librarys():
    """A shard header (written before its data is streamed in) is what the library writes for the same tensors."""
    from converter.engine.writer import OutSpec, _header

    tensors = {"a.wéight": torch.ones(3, 5), "b.bias": torch.zeros(7), "c": torch.ones(1)}
    blob = save(tensors, metadata={"format": "pt"})
    specs = [OutSpec(n, "F32", tuple(t.shape)) for n, t in tensors.items()]
    assert _header(specs) == blob[: len(_header(specs))]
