"""Property-based fuzzing of what reads untrusted files: the safetensors header parser (SafetensorsFile) and adapter
format detection + parsing (converter.formats.load_adapter).

The property: whatever the bytes, the result is a parsed file (whose byte ranges are then sound) or a
ConverterError with a one-line message naming the file; never another exception. Bounded example counts,
derandomized and without a database, so CI runs the same examples every time and fast.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from converter.engine.recipe import Recipe
from converter.errors import ConverterError, RecipeError
from converter.formats import load_adapter
from converter.formats.patches import DeltaPatch
from converter.io.dtypes import ITEMSIZE
from converter.io.safetensors_file import SafetensorsFile

SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
RUNS: dict[str, int] = {}  # examples actually run per property (printed with -s)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _count(name: str) -> None:
    RUNS[name] = RUNS.get(name, 0) + 1


def _one_line(err: ConverterError, path: Path) -> None:
    text = str(err)
    assert text and "\n" not in text, text
    assert str(path) in text or path.name in text, text


def _parse(path: Path) -> SafetensorsFile | None:
    """Parse, read every tensor; a ConverterError is an accepted outcome, anything else fails the property."""
    try:
        f = SafetensorsFile(path)
        for name in f.tensors:
            f.read(name)
    except ConverterError as e:
        _one_line(e, path)
        return None
    spans = sorted((t.start, t.end) for t in f.tensors.values() if t.end > t.start)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "overlapping tensors accepted"
    assert all(t.end <= f.size and t.start >= f.header_bytes for t in f.tensors.values())
    for t in f.tensors.values():
        assert t.end - t.start == t.numel * ITEMSIZE[t.dtype]
    return f


def _valid_file(path: Path) -> bytes:
    save_file(
        {
            "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "b.bias": torch.ones(5, dtype=torch.float16),
            "c.ids": torch.arange(3, dtype=torch.int64),
            "d.empty": torch.zeros(0, 2),
        },
        path,
        metadata={"format": "pt", "note": "fuzz"},
    )
    return path.read_bytes()


@settings(max_examples=300, **SETTINGS)
@given(data=st.binary(max_size=256))
def test_arbitrary_bytes(scratch, data):
    _count("arbitrary bytes")
    path = scratch / "bytes.safetensors"
    path.write_bytes(data)
    _parse(path)


@settings(max_examples=300, **SETTINGS)
@given(
    edits=st.lists(
        st.tuples(
            st.sampled_from(["flip", "set", "cut", "insert", "length"]), st.integers(0, 2**16), st.integers(0, 255)
        ),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_valid_file(scratch, edits):
    _count("mutated valid file")
    path = scratch / "mutated.safetensors"
    data = bytearray(_valid_file(path))
    for kind, at, value in edits:
        at %= len(data) + 1
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << (value % 8)
        elif kind == "set" and at < len(data):
            data[at] = value
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = bytes([value])
        elif kind == "length" and len(data) >= 8:
            n = struct.unpack("<Q", data[:8])[0]
            data[:8] = struct.pack("<Q", max(0, n + value - 128))
        if not data:
            break
    path.write_bytes(bytes(data))
    _parse(path)


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8))
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_DTYPES = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F64", "Q4", "f32", ""]) | _JSON
_ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "dtype": _DTYPES,
        "shape": st.lists(st.integers(-2, 6), max_size=3) | _JSON,
        "data_offsets": st.lists(st.integers(-4, 200), min_size=0, max_size=3) | _JSON,
    },
)


@settings(max_examples=300, **SETTINGS)
@given(
    header=st.dictionaries(st.text(max_size=10), _ENTRY | _JSON, max_size=4),
    metadata=st.none() | _JSON,
    data_len=st.integers(0, 256),
)
def test_structured_headers(scratch, header, metadata, data_len):
    """Headers that are valid JSON with entries of every shape and type: the checks, not the JSON parser, decide."""
    _count("structured headers")
    if metadata is not None:
        header = {**header, "__metadata__": metadata}
    raw = json.dumps(header).encode()
    path = scratch / "structured.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_len))
    _parse(path)


# --- adapter format detection ---------------------------------------------------------------------------------------

_PREFIXES = ["lora_unet_", "lora_te_", "lora_te2_", "lycoris_", "lora_transformer_", "unet.", "transformer.",
             "text_encoder.", "diffusion_model.", "base_model.model.", "lora_unet_lora_unet_", ""]  # fmt: skip
_STEMS = ["down_blocks_0_proj", "x", "double_blocks.0.img_attn.qkv", "model.layers.0.self_attn.q_proj", "a.b"]
_SUFFIXES = [".lora_down.weight", ".lora_up.weight", ".lora_mid.weight", ".alpha", ".dora_scale", ".hada_w1_a",
             ".hada_w1_b", ".hada_w2_a", ".hada_w2_b", ".hada_t1", ".lokr_w1", ".lokr_w2", ".lokr_w1_a", ".lokr_w1_b",
             ".lokr_w2_a", ".lokr_w2_b", ".lokr_t2", ".diff", ".diff_b", ".lora_A.weight", ".lora_B.weight",
             ".lora_A.default.weight", ".lora_B.bias", ".lora_magnitude_vector", ".oft_blocks", ".weird",
             ""]  # fmt: skip
_KEY = st.builds(
    lambda p, s, x: p + s + x, st.sampled_from(_PREFIXES), st.sampled_from(_STEMS), st.sampled_from(_SUFFIXES)
)
_SHAPE = st.lists(st.integers(0, 5), min_size=0, max_size=4)
_SMALL_SHAPE = st.lists(st.integers(1, 3), min_size=1, max_size=4)
# Every algorithm's full set of tensors (shapes drawn independently: mostly inconsistent, sometimes not).
_ALGORITHMS = [
    (".lora_down.weight", ".lora_up.weight", ".alpha"),
    (".lora_down.weight", ".lora_up.weight", ".lora_mid.weight"),
    (".lora_down.weight", ".lora_up.weight", ".dora_scale"),
    (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b"),
    (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b", ".hada_t1", ".hada_t2"),
    (".lokr_w1", ".lokr_w2"),
    (".lokr_w1_a", ".lokr_w1_b", ".lokr_w2_a", ".lokr_w2_b", ".alpha"),
    (".lokr_w1", ".lokr_w2_a", ".lokr_w2_b", ".lokr_t2"),
    (".diff", ".diff_b"),
    (".lora_A.weight", ".lora_B.weight", ".lora_B.bias", ".lora_magnitude_vector"),
]


@settings(max_examples=250, **SETTINGS)
@given(
    tensors=st.one_of(
        st.dictionaries(_KEY, _SHAPE, min_size=0, max_size=8),
        st.lists(  # whole modules: one name with a set of suffixes, as real files have them
            st.tuples(
                st.sampled_from(_PREFIXES),
                st.sampled_from(_STEMS),
                st.one_of(
                    st.dictionaries(st.sampled_from(_SUFFIXES), _SHAPE, min_size=1, max_size=5),
                    st.sampled_from(_ALGORITHMS).flatmap(
                        lambda parts: st.fixed_dictionaries({x: _SMALL_SHAPE for x in parts})
                    ),
                ),
            ),
            max_size=3,
        ).map(lambda modules: {p + s + x: shape for p, s, parts in modules for x, shape in parts.items()}),
    ),
    metadata=st.dictionaries(
        st.sampled_from(["lora_adapter_metadata", "ss_network_module", "format"]),
        st.text(max_size=20) | _JSON.map(json.dumps),
        max_size=2,
    ),
    lora_alpha=st.none() | st.floats(-4, 64, allow_nan=False),
)
def test_single_file_adapters(scratch, tensors, metadata, lora_alpha):
    """Random key sets from every format's vocabulary, with random shapes: detect + parse or a clean error."""
    _count("single-file adapters")
    path = scratch / "adapter.safetensors"
    save_file({k: torch.ones(shape) for k, shape in tensors.items()}, path, metadata=metadata or None)
    try:
        adapter = load_adapter(path, lora_alpha=lora_alpha)
    except ConverterError as e:
        assert str(e) and "\n" not in str(e), str(e)
        return
    assert adapter.patches or not tensors
    for ap in adapter.patches:  # what a merge computes from them: a parsed file has consistent factors
        if isinstance(ap.patch, DeltaPatch):
            shape = ap.patch.natural_shape()
            assert math.prod(ap.patch.raw_delta().shape) == math.prod(shape), (ap.name, shape)


@settings(max_examples=200, **SETTINGS)
@given(
    config=st.dictionaries(
        st.sampled_from(["r", "lora_alpha", "peft_type", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora",
                         "fan_in_fan_out", "trainable_token_indices", "base_model_name_or_path", "target_modules"]),
        _JSON,
        max_size=5,
    )
    | _JSON,
    keys=st.lists(st.sampled_from([".lora_A.weight", ".lora_B.weight", ".lora_B.bias", ".lora_magnitude_vector",
                                   ".lora_embedding_A", ".lora_embedding_B", ".token_adapter.trainable_tokens_delta",
                                   ".base_layer.weight", ".modules_to_save.default.weight",
                                   ".original_module.weight"]), max_size=4, unique=True),
    rank=st.integers(0, 3),
)  # fmt: skip
def test_peft_folders(scratch, config, keys, rank):
    """A PEFT folder with any adapter_config.json (any JSON at all) and a random subset of PEFT tensors."""
    _count("PEFT folders")
    folder = scratch / "peft"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    shapes = {".lora_A.weight": (rank, 4), ".lora_B.weight": (4, rank), ".lora_embedding_A": (rank, 6),
              ".lora_embedding_B": (4, rank), ".token_adapter.trainable_tokens_delta": (2, 4)}  # fmt: skip
    save_file({module + k: torch.ones(shapes.get(k, (4,))) for k in keys}, folder / "adapter_model.safetensors")
    try:
        load_adapter(folder)
    except ConverterError as e:
        assert str(e) and "\n" not in str(e), str(e)


_FIELDS = ["base", "adapters", "dtype", "out", "max_shard_size", "allow_unmatched", "allow_pickle", "qlora",
           "qlora_base", "qlora_quant", "qlora_blocksize", "qlora_double_quant", "extra"]  # fmt: skip
_ADAPTER_FIELDS = ["source", "weight", "include", "exclude", "lora_alpha", "strength"]


@settings(max_examples=200, **SETTINGS)
@given(
    data=st.one_of(
        _JSON,
        st.dictionaries(
            st.sampled_from(_FIELDS),
            _JSON | st.lists(st.dictionaries(st.sampled_from(_ADAPTER_FIELDS), _JSON, max_size=4), max_size=2),
            max_size=6,
        ),
    )
)
def test_recipes(data):
    """Any YAML a user can write (as the JSON-compatible values YAML gives): a Recipe or a one-line RecipeError."""
    _count("recipes")
    try:
        recipe = Recipe.from_dict(data)
    except RecipeError as e:
        assert str(e) and "\n" not in str(e), str(e)
        return
    assert isinstance(recipe.base, str) and recipe.adapters and all(isinstance(a.source, str) for a in recipe.adapters)


def test_report_how_many_examples_ran():
    """Runs last in this file: every property ran examples (hypothesis did not skip them all)."""
    if not RUNS:
        pytest.skip("selected without the properties above")
    print("fuzz examples run:", RUNS, "total", sum(RUNS.values()))
    assert all(n >= 50 for n in RUNS.values()), RUNS
