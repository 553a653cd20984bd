"""GGUF out: files written by `converter gguf` / `merge --gguf`, proven, and checked against llama.cpp itself.

Oracles: llama.cpp's own converter (`convert_hf_to_gguf.py` from the llama-cpp-python source distribution, which
`make test` downloads) must write the same keys and the same tensor bytes as we do; llama.cpp (llama-cpp-python)
must load, tokenize and run every file. Sabotaged files (Q/K rows not reordered, a wrong rope base, a wrong
pre-tokenizer, a dropped tensor) must each fail the proof, naming what is wrong, with nothing left in the output.
Files are read with the proof's reader (fileio.Reader: gguf's, with bulk paths for the vocabulary; seconds faster on
SmolLM2's), which one test holds to gguf's own reader on llama.cpp's own file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from model_helpers import make_adapter, make_base, run_cli

from converter.errors import BadInputError, MissingExtraError, VerificationFailed
from converter.gguf import arch, export, fileio, llama, proof, publish, write
from converter.testing import llama_convert

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from build_fixtures import cache_dir, is_complete  # noqa: E402

SMOLLM2 = cache_dir() / "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# general.* is descriptive (name, basename, finetune, size label; tags, licence and base models read from README.md)
# except these, which llama.cpp reads: the rest of general.* is compared for these only
GENERAL_READ = {"general.architecture", "general.type", "general.file_type", "general.quantization_version"}
# we always write these as transformers' tokenizer behaves; llama.cpp's converter only when tokenizer_config.json
# says (absent, llama.cpp's loader falls back to a default per tokenizer type)
ADD_FLAGS = {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"}

needs_llama = pytest.mark.skipif(not llama.available(), reason="llama-cpp-python (converter[gguf]) not installed")


def smollm2() -> Path:
    if not is_complete(SMOLLM2):
        pytest.fail(f"SmolLM2 fixture missing at {SMOLLM2}: run `make fixtures` (make test does it first)")
    return SMOLLM2


def tiny(folder: Path, model_type: str, tokenizer_class: str | None = None, **overrides) -> Path:
    """A tiny model of `model_type` with SmolLM2's tokenizer (so its vocab is a real BPE one llama.cpp knows)."""
    make_base(folder, model_type, vocab_size=49152, **overrides)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2() / name, folder / name)
    if tokenizer_class:  # Phi-3's converter reads a BPE tokenizer only when its class says GPT-2
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
    return folder


# Phi-3's long-context rope: one factor per rotary frequency (head_dim 16: 8), long and short. llama.cpp takes the
# long ones when its context (a multiple of 256) exceeds the original one, transformers when the sequence does: with an
# original context of 256 both take the short ones on the proof's texts.
LONGROPE = {"type": "longrope", "long_factor": [1.0 + i / 2 for i in range(8)],
            "short_factor": [1.0 + i / 8 for i in range(8)]}  # fmt: skip
# A tiny model of each architecture, with a real tokenizer llama.cpp knows; Gemma's query_pre_attn_scalar as
# llama.cpp computes it for models of this size (head_dim).
TINY = {
    "llama": lambda f: tiny(f, "llama"),
    "mistral": lambda f: tiny(f, "mistral"),
    "qwen3": lambda f: tiny(f, "qwen3"),
    "gemma2": lambda f: tiny_spm(f, "gemma2", query_pre_attn_scalar=16),
    "gemma3_text": lambda f: tiny(f, "gemma3_text", query_pre_attn_scalar=16),
    "phi3": lambda f: tiny(f, "phi3", tokenizer_class="GPT2Tokenizer"),  # as Phi-4's (BPE)
    "phi3_spm": lambda f: tiny_llama_spm(f, "phi3"),  # as Phi-3's (SentencePiece)
    "phi3_longrope": lambda f: tiny(
        f,
        "phi3",
        tokenizer_class="GPT2Tokenizer",
        max_position_embeddings=512,
        original_max_position_embeddings=256,
        rope_scaling=LONGROPE,
    ),  # as Phi-3.5's
    "gpt2": lambda f: tiny(f, "gpt2", n_ctx=128),  # llama.cpp's converter reads n_ctx, as GPT-2's own config has it
    "mixtral": lambda f: tiny(f, "mixtral"),  # 4 experts, 2 per token: saved one by one, stacked in the GGUF
    "qwen2_moe": lambda f: tiny(f, "qwen2_moe"),  # + a shared expert and its gate
    "qwen3_moe": lambda f: tiny(f, "qwen3_moe", norm_topk_prob=True),  # as Qwen3's MoE models (llama.cpp assumes it)
}


SPM_TEXT = [*proof.PROMPTS, proof.MIXED_TEXT, "The quick brown fox jumps over the lazy dog. 0123456789",
            "Sphinx of black quartz, judge my vow! Ça coûte 10€, naïve café, déjà vu."]  # fmt: skip


def tiny_spm(folder: Path, model_type: str, **overrides) -> Path:
    """A tiny Gemma-style model with a SentencePiece tokenizer (tokenizer.model with byte fallback, Gemma's special
    ids and turn tokens, tokenizer.json beside it) trained here on a few lines: llama.cpp's converter reads Gemma 2's
    tokenizer from tokenizer.model only."""
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    model = io.BytesIO()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_TEXT * 20), model_writer=model, vocab_size=400, hard_vocab_limit=False,
        model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=specials[4:], split_digits=True,
        add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity",
        allow_whitespace_only_pieces=True, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    tok_config = {
        "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>",
        "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>",
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                          "rstrip": False, "single_word": False} for i, t in enumerate(specials)},
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.save_pretrained(folder)  # tokenizer.json, as a Gemma repository has it
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    make_base(folder, model_type, vocab_size=len(tokenizer), bos_token_id=2, eos_token_id=1, pad_token_id=0,
              **overrides)  # fmt: skip
    return folder


def tiny_llama_spm(folder: Path, model_type: str, **overrides) -> Path:
    """A tiny model with a Llama-style SentencePiece tokenizer (`<unk>`, `<s>`, `</s>`, a dummy prefix, byte
    fallback) trained here, chat tokens added after it as Phi-3's are, and a vocab_size padded beyond them."""
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_TEXT * 20), model_writer=model, vocab_size=400, hard_vocab_limit=False,
        model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, split_digits=True,
        add_dummy_prefix=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    size = spm.SentencePieceProcessor(model_proto=model.getvalue()).vocab_size()
    added = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok_config = {
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
        "eos_token": "<|endoftext|>", "unk_token": "<unk>", "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(size + i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                                 "rstrip": False, "single_word": False} for i, t in enumerate(added)},
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    make_base(folder, model_type, vocab_size=len(tokenizer) + 4, bos_token_id=1, eos_token_id=size,
              pad_token_id=size, **overrides)  # fmt: skip
    return folder


# gguf's reader parses the whole vocabulary when it opens a file (seconds for SmolLM2's 49152 tokens): one reader
# per file, for its keys and its tensors.


def fields(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensor_bytes(reader: gguf.GGUFReader) -> dict[str, tuple[str, tuple, bytes]]:
    return {t.name: (t.tensor_type.name, tuple(t.shape), np.asarray(t.data).tobytes())
            for t in reader.tensors}  # fmt: skip


@pytest.fixture(scope="module")
def llama_converter(tmp_path_factory) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (with its conversion/ and gguf-py/), unpacked from the sdist (`unpack`
    names a missing one)."""
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece (converter[gguf])")
    return llama_convert.unpack(llama_convert.default_sdist(), tmp_path_factory.mktemp("llama.cpp"))


def their_ggufs(converter: Path, jobs: list[tuple[str, Path, Path]]) -> None:
    """llama.cpp's converter on each (outtype, out file, model folder), in one process (its imports cost ~15 s)."""
    proc = subprocess.run(llama_convert.command(jobs), cwd=converter, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_same_file(ours: Path, theirs: Path) -> None:
    """Key by key (descriptive general.* aside) and tensor by tensor, bytes included (read with the proof's reader,
    which reads what gguf's own does: test_our_reader_and_writer_are_ggufs_own_on_a_real_vocabulary)."""
    mine, other = fileio.Reader(ours), fileio.Reader(theirs)
    a, b = fields(mine), fields(other)
    keys = {k for k in set(a) | set(b) if not k.startswith("general.") or k in GENERAL_READ}
    keys = {k for k in keys if not (k in ADD_FLAGS and k not in b)}
    assert {k: a.get(k) for k in keys if a.get(k) != b.get(k)} == {k: b.get(k) for k in keys if a.get(k) != b.get(k)}
    ta, tb = tensor_bytes(mine), tensor_bytes(other)
    assert sorted(ta) == sorted(tb)
    assert [n for n in ta if ta[n] != tb[n]] == []


# The real model: SmolLM2 merged with a LoRA, to every type we write and one K-quant, in one export.


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("smol-gguf")
    adapter = make_adapter(smollm2(), root / "lora", r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "down_proj"])  # fmt: skip
    assert run_cli("merge", "--base", smollm2(), "--adapter", adapter, "--out", root / "merged", "--no-verify") == 0
    yield root / "merged"
    shutil.rmtree(root, ignore_errors=True)  # the module's models are gigabytes: the disk holds one module's


@pytest.fixture(scope="module")
def exported(merged, tmp_path_factory):
    lines: list[str] = []
    out = tmp_path_factory.mktemp("smol-out") / "gguf"
    types = ["F32", "F16", "BF16", "Q8_0", "Q4_K_M"] if llama.available() else ["F32", "F16", "BF16", "Q8_0"]
    result = export.export(merged, types, out, name="smol-merged", log=lines.append)
    yield result, lines
    shutil.rmtree(out.parent, ignore_errors=True)


def test_merged_smollm2_to_each_type_is_proven(exported):
    result, lines = exported
    parts = ["metadata", "tensors", "tokenizer", "behaviour"] if llama.available() else ["metadata", "tensors"]
    assert [p.type for p in result.proofs] == [p.name.rsplit("-", 1)[1][:-5] for p in result.files]
    for fp in result.proofs:
        assert fp.passed and [p.name for p in fp.parts] == parts, fp.to_json()
    assert sorted(p.name for p in result.out.iterdir()) == sorted([export.PROOF_FILE, *(p.name for p in result.files)])
    q8 = fileio.Reader(result.out / "smol-merged-Q8_0.gguf")
    types = {t.name: t.tensor_type.name for t in q8.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" not in types  # tied to token_embd, as llama.cpp expects
    assert any(line.startswith("  behaviour: ok") for line in lines) == llama.available()


@needs_llama
def test_the_q4_k_m_file_is_llama_cpps_quantization(exported):
    """The K-quant file was made by llama.cpp's quantizer (its file type, its K-quant tensors) and proven above."""
    result, _ = exported
    path = result.out / "smol-merged-Q4_K_M.gguf"
    reader = fileio.Reader(path)
    assert fields(reader)["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q4_K", "Q6_K"}


# (model_type, type) of the tiny models compared with llama.cpp's converter's files: each architecture in F32, and
# in Q8_0 those whose tensors change shape or values on the way (GPT-2's transposed, Gemma's norms, Phi-3's fused,
# the MoE models' stacked experts, Qwen2-MoE's shared expert gate kept F32)
TINY_FILES = [(t, "F32") for t in TINY if t != "phi3_spm"]
TINY_FILES += [("gpt2", "Q8_0"), ("gemma2", "Q8_0"), ("phi3", "Q8_0"), ("mixtral", "Q8_0"), ("qwen2_moe", "Q8_0")]


@pytest.fixture(scope="module")
def theirs(merged, llama_converter, tmp_path_factory) -> Iterator[dict[str, Path]]:
    """llama.cpp's files: the merged SmolLM2 as Q8_0, and the tiny models (their folders under `{type}-model`)."""
    root = tmp_path_factory.mktemp("theirs")
    folders = {t: make(root / t) for t, make in TINY.items()}
    jobs = [("q8_0", root / "smol-Q8_0.gguf", merged)]
    jobs += [(kind.lower(), root / f"{t}-{kind}.gguf", folders[t]) for t, kind in [*TINY_FILES, ("phi3_spm", "F32")]]
    their_ggufs(llama_converter, jobs)
    files = {path.name.removesuffix(".gguf"): path for _, path, _ in jobs}
    yield files | {f"{t}-model": folder for t, folder in folders.items()}
    shutil.rmtree(root, ignore_errors=True)


@needs_llama
def test_llama_cpp_prints_nothing_of_its_own(exported, capfd):
    """llama.cpp logs at the C level (model load, context, every decode); the CLI must stay quiet without -v."""
    result, _ = exported
    capfd.readouterr()
    llama.logits(result.out / "smol-merged-Q4_K_M.gguf", [[1, 2, 3]])
    llama.tokenizer(result.out / "smol-merged-Q8_0.gguf").close()
    assert capfd.readouterr() == ("", "")


def test_our_q8_0_is_llama_cpps_own_conversion(exported, theirs):
    """llama.cpp's convert_hf_to_gguf.py on the same merged folder writes the same keys and tensor bytes."""
    result, _ = exported
    assert_same_file(result.out / "smol-merged-Q8_0.gguf", theirs["smol-Q8_0"])


# Tiny models of each architecture: written, proven by llama.cpp, and identical to llama.cpp's converter's file.


@pytest.mark.parametrize(("model_type", "kind"), TINY_FILES)
def test_tiny_architectures_match_llama_cpps_converter(model_type, kind, theirs, tmp_path):
    """Written, proven (by llama.cpp too where it is installed), and key by key, tensor by tensor llama.cpp's own
    converter's file. The name keeps clear of llama.cpp's special case for files it takes for Microsoft's Phi-3."""
    lines: list[str] = []
    result = export.export(theirs[f"{model_type}-model"], [kind], tmp_path / "out", name="tiny", log=lines.append)
    assert result.proofs[0].passed
    assert any(line.startswith("  behaviour: ok") for line in lines) == llama.available()
    assert_same_file(result.files[0], theirs[f"{model_type}-{kind}"])


@needs_llama
def test_a_k_quant_of_a_moe_model_is_proven(tmp_path):
    """llama.cpp's quantizer from our F32 file: stacked experts, the shared expert and its (1, n) gate, which the
    quantizer stores as (n,)."""
    folder = TINY["qwen2_moe"](tmp_path / "moe")
    result = export.export(folder, ["Q4_K_M"], tmp_path / "out", name="tiny", log=lambda _: None)
    assert result.proofs[0].passed and [p.name for p in result.proofs[0].parts][-1] == "behaviour"
    types = {t.name: t.tensor_type.name for t in fileio.Reader(result.files[0]).tensors}
    assert types["blk.0.ffn_gate_inp_shexp.weight"] == "F32" and types["blk.0.ffn_gate_exps.weight"] != "F32"


def test_phi3_with_a_sentencepiece_tokenizer_is_written_as_llama_cpps_converter_writes_it(theirs, tmp_path):
    """Phi-3's own reading of tokenizer.model and the added tokens (added_tokens.json, tokenizer_config.json,
    tokenizer.json), key by key. Only written and compared here: with a SentencePiece tokenizer trained in the test,
    llama.cpp puts a space after each special token where transformers does not, and the tokenizer proof says so."""
    folder = theirs["phi3_spm-model"]
    src, family = export.open_source(folder), arch.FAMILIES["phi3"]
    write.write_gguf(src, family, "F32", tmp_path / "tiny-F32.gguf", name="tiny")
    assert_same_file(tmp_path / "tiny-F32.gguf", theirs["phi3_spm-F32"])
    keys = fields(fileio.Reader(tmp_path / "tiny-F32.gguf"))
    types = dict(zip(keys["tokenizer.ggml.tokens"], keys["tokenizer.ggml.token_type"], strict=True))
    assert keys["tokenizer.ggml.model"] == "llama" and types["<|end|>"] == gguf.TokenType.CONTROL
    assert keys["tokenizer.ggml.tokens"][-1] == f"[PAD{src.config['vocab_size'] - 1}]"  # padded to vocab_size


def test_our_reader_and_writer_are_ggufs_own_on_a_real_vocabulary(theirs, tmp_path):
    """The proof's reader and our writer take bulk paths for long arrays (fileio.py): on llama.cpp's own file of
    SmolLM2 (Q8_0, 49,152 tokens, their merges) the reader gives every key, part and tensor's bytes as gguf's
    reader does, and the writer packs those keys into the bytes gguf's writer packs."""
    plain, fast = gguf.GGUFReader(theirs["smol-Q8_0"]), fileio.Reader(theirs["smol-Q8_0"])
    assert fields(fast) == fields(plain) and len(fields(plain)["tokenizer.ggml.tokens"]) == 49152
    assert tensor_bytes(fast) == tensor_bytes(plain)
    for name, field in plain.fields.items():
        other = fast.fields[name]
        assert (other.types, other.data, len(other.parts)) == (field.types, field.data, len(field.parts)), name
        pairs = zip(other.parts, field.parts, strict=True)
        assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in pairs), name
    metadata = {k: f for k, f in plain.fields.items() if not k.startswith("GGUF.")}
    packed = []
    for cls in (gguf.GGUFWriter, fileio.Writer):
        w = cls(tmp_path / f"{cls.__name__}.gguf", "llama")
        for name, f in metadata.items():
            if name != "general.architecture":
                sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
                if sub is not None:  # as add_array does: the item type from the values
                    w.add_array(f"again.{name}", f.contents())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        packed.append((tmp_path / f"{cls.__name__}.gguf").read_bytes())
    assert packed[0] == packed[1] and len(packed[0]) > 1_000_000


def test_qwen2_with_a_tokenizer_llama_cpp_does_not_know_is_refused_and_its_weights_run(tmp_path):
    """transformers reads SmolLM2's vocabulary in a Qwen2 model with Qwen2's own pre-tokenizer, a combination
    llama.cpp has no name for: refused before writing. Forced to a name, the file's weights still prove and run."""
    folder = tiny(tmp_path / "model", "qwen2")
    with pytest.raises(BadInputError, match="llama.cpp does not know this BPE tokenizer's pre-tokenizer"):
        export.export(folder, ["F32"], tmp_path / "out", log=lambda _: None)
    assert list((tmp_path / "out").iterdir()) == []
    src, family = export.open_source(folder), arch.FAMILIES["qwen2"]
    path = tmp_path / "forced.gguf"
    write.write_gguf(src, family, "Q8_0", path, name="forced", pre="qwen2")
    reader = fileio.Reader(path)
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= {t.name for t in reader.tensors}
    assert proof.prove_metadata(reader, src, family).passed and proof.prove_tensors(reader, src, family, "Q8_0").passed
    if llama.available():
        assert proof.prove_behaviour(path, proof.reference(src, with_logits=True), "Q8_0").passed


# Sabotage: each kind of wrong file fails its proof, says what is wrong, and leaves nothing in --out.


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def failed_export(folder: Path, out: Path, **kwargs) -> str:
    with pytest.raises(VerificationFailed) as caught:
        export.export(folder, ["F32"], out, log=lambda _: None, **kwargs)
    assert list(out.iterdir()) == []  # the staging folder is gone, nothing was moved in
    return str(caught.value)


def test_unpermuted_q_k_rows_fail_the_tensor_proof(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(arch, "permute", lambda w, n: w)  # the writer forgets; the proof's unpermute stays
    message = failed_export(tiny_llama, tmp_path / "out")
    assert "tensors proof failed: blk.0.attn_k.weight (model.layers.0.self_attn.k_proj.weight)" in message


@pytest.mark.parametrize("type_name", ["F32", "BF16", "Q8_0"])
def test_one_changed_byte_fails_the_tensor_proof(type_name, tiny_llama, tmp_path):
    """The tensor proof compares the file's bits with the reference's: one byte of one row of a Q projection (whose
    rows the proof puts back in Hugging Face order first) is found, and named with the one value it changes."""
    src = export.open_source(tiny_llama)
    family = arch.family_of(src.config, tiny_llama)
    path = tmp_path / f"m-{type_name}.gguf"
    write.write_gguf(src, family, type_name, path, name="m")
    assert proof.prove_tensors(fileio.Reader(path), src, family, type_name).passed
    t = next(t for t in fileio.Reader(path).tensors if t.name == "blk.1.attn_q.weight")
    data = bytearray(path.read_bytes())
    data[int(t.data_offset) + 3 * t.data.shape[-1] * t.data.itemsize + 7] ^= 0x40  # row 3: an exponent, a Q8_0 quant
    path.write_bytes(bytes(data))
    part = proof.prove_tensors(fileio.Reader(path), src, family, type_name)
    assert not part.passed
    assert part.detail.startswith("blk.1.attn_q.weight (model.layers.1.self_attn.q_proj.weight): 1 values differ")


def test_a_wrong_rope_base_fails_the_metadata_proof(tiny_llama, tmp_path, monkeypatch):
    real = arch.add_model_metadata

    def wrong_rope(w, config, family):
        real(w, {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, family)

    monkeypatch.setattr(arch, "add_model_metadata", wrong_rope)
    message = failed_export(tiny_llama, tmp_path / "out")
    assert "metadata proof failed: llama.rope.freq_base is 500000.0, config.json says 10000.0" in message


@needs_llama
def test_a_wrong_pre_tokenizer_fails_the_tokenizer_proof(tiny_llama, tmp_path):
    message = failed_export(tiny_llama, tmp_path / "out", pre="llama-bpe")
    assert "tokenizer proof failed: digits and spaces: token" in message and "in llama.cpp" in message


def test_the_types_written_in_one_pass_are_the_types_written_alone_and_a_failure_leaves_none(tiny_llama, tmp_path,
                                                                                              monkeypatch):  # fmt: skip
    """write_ggufs reads each tensor once for every type: each file is the one write_gguf writes for its type alone;
    a failure finishing the last file removes the files already finished too."""
    src = export.open_source(tiny_llama)
    family = arch.family_of(src.config, tiny_llama)
    types = ["F32", "F16", "BF16", "Q8_0"]
    write.write_ggufs(src, family, {t: tmp_path / f"all-{t}.gguf" for t in types}, name="m")
    for t in types:
        write.write_gguf(src, family, t, tmp_path / f"one-{t}.gguf", name="m")
        assert (tmp_path / f"all-{t}.gguf").read_bytes() == (tmp_path / f"one-{t}.gguf").read_bytes(), t
    real = write.GGUFFile.finish

    def failing(self):
        if self.path.name == "bad-Q8_0.gguf":
            self.abort()
            raise OSError("disk full")
        real(self)

    monkeypatch.setattr(write.GGUFFile, "finish", failing)
    (tmp_path / "bad").mkdir()
    with pytest.raises(OSError, match="disk full"):
        write.write_ggufs(src, family, {t: tmp_path / "bad" / f"bad-{t}.gguf" for t in types}, name="m")
    assert list((tmp_path / "bad").iterdir()) == []


def test_a_dropped_tensor_fails_the_tensor_proof(tiny_llama, tmp_path, monkeypatch):
    real = write.plan
    monkeypatch.setattr(write, "plan", lambda *a: [p for p in real(*a) if p.name != "blk.1.ffn_up.weight"])
    message = failed_export(tiny_llama, tmp_path / "out")
    assert "blk.1.ffn_up.weight (model.layers.1.mlp.up_proj.weight) is missing from the file" in message


@pytest.mark.parametrize(("model_type", "named"), [
    ("gemma2", "blk.0.attn_norm.weight (model.layers.0.input_layernorm.weight)"),  # the + 1 forgotten
    ("gpt2", "blk.0.attn_qkv.weight (transformer.h.0.attn.c_attn.weight)"),  # the transpose forgotten
])  # fmt: skip
def test_a_tensor_written_as_hugging_face_stores_it_fails_the_tensor_proof(model_type, named, tmp_path, monkeypatch):
    """The writer forgets Gemma's norm shift or GPT-2's transpose; the proof applies them itself and says so."""
    folder = TINY[model_type](tmp_path / model_type)
    monkeypatch.setattr(write, "gguf_layout", lambda p, data: data)
    message = failed_export(folder, tmp_path / "out")
    assert f"tensors proof failed: {named}: " in message and "as llama.cpp stores it" in message


@needs_llama
def test_a_router_lora_near_ties_are_left_out_of_the_behaviour_proof_which_still_fails_a_wrong_file(
    tmp_path, monkeypatch
):
    """A LoRA on Mixtral's router (this seed made llama.cpp pick another expert at a near tie, and a right F32 file
    failed at 0.015 against 0.01): each text is compared up to its first near tie, and passes; the base's file
    proven against the merged model still fails on the positions compared."""
    base = TINY["mixtral"](tmp_path / "mixtral")
    adapter = make_adapter(base, tmp_path / "lora", seed=6, r=2, target_parameters=["gate_up_proj", "down_proj"],
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate"])  # fmt: skip
    assert run_cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", "--no-verify") == 0
    lines: list[str] = []
    result = export.export(tmp_path / "m", ["F32"], tmp_path / "out", name="m", log=lines.append)
    assert result.proofs[0].passed, lines
    ref = proof.reference(export.open_source(tmp_path / "m"), with_logits=True)
    compared = ref.compared("F32")
    assert sum(compared) < sum(len(i) for i in ref.inputs)  # this model has near ties, here left out
    for gaps, n in zip(ref.router_gaps, compared, strict=True):
        assert (gaps[:n] >= proof.ROUTER_TIE["F32"]).all() and (n == len(gaps) or gaps[n] < proof.ROUTER_TIE["F32"])
    assert any(f"{sum(compared)} of " in line and "near tie" in line for line in lines), lines
    unmerged = export.open_source(base)
    write.write_gguf(unmerged, arch.family_of(unmerged.config, base), "F32", tmp_path / "base.gguf", name="base")
    part = proof.prove_behaviour(tmp_path / "base.gguf", ref, "F32")
    assert not part.passed and f"{sum(compared)} of " in part.detail, part.detail
    # where every text begins with a near tie nothing is compared: not judged, and said so
    monkeypatch.setitem(proof.ROUTER_TIE, "F32", float("inf"))
    part = proof.prove_behaviour(tmp_path / "base.gguf", ref, "F32")
    assert (part.passed, part.judged, part.verdict) == (True, False, "not judged") and "no position" in part.detail
    fp = result.proofs[0]
    fp.parts[-1] = part
    text = publish.card(export.GGUFResult(result.out, result.files, [fp]), "alice/m", "alice/m-GGUF")
    assert "passed (metadata, tensors, tokenizer) |" in text and "behaviour (not judged): every text" in text
    assert fp.to_json()["parts"][-1]["judged"] is False


def test_a_moe_layer_missing_an_expert_is_refused_before_writing(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = TINY["mixtral"](tmp_path / "mixtral")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    wrong = r"layers.1.block_sparse_moe.experts.w3.weight has experts \[0, 1, 3\], config.json says 4$"
    with pytest.raises(BadInputError, match=wrong):
        export.export(folder, ["F32"], tmp_path / "out", log=lambda _: None)
    assert not (tmp_path / "out").exists()


@needs_llama
def test_unpermuted_rows_also_fail_the_behaviour_proof(merged, tmp_path, monkeypatch):
    """Even if the tensors were read back the same wrong way, llama.cpp's logits show it (on SmolLM2: a tiny random
    model's attention is too weak for its rope to matter)."""
    src = export.open_source(merged)
    ref = proof.reference(src, with_logits=True)
    monkeypatch.setattr(arch, "permute", lambda w, n: w)
    monkeypatch.setattr(arch, "unpermute", lambda w, n: w)  # the tensors read back the same wrong way: they pass
    path = tmp_path / "bad.gguf"
    family = arch.family_of(src.config, merged)
    write.write_gguf(src, family, "F16", path, name="bad")
    assert proof.prove_tensors(fileio.Reader(path), src, family, "F16").passed
    part = proof.prove_behaviour(path, ref, "F16")
    assert not part.passed and "limit 0.01 for F16" in part.detail


# The command line: refusals before anything is written.


def gpt_neox(folder: Path) -> Path:
    """A tiny model of an architecture llama.cpp runs but GGUF export does not write."""
    import torch
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=128)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_a_gemma_whose_attention_scale_llama_cpp_would_not_use_is_refused(tmp_path, cli):
    folder = make_base(tmp_path / "gemma", "gemma2")  # query_pre_attn_scalar 256, head_dim 16
    code, out, err = cli("gguf", folder, "--type", "F32", "--out", tmp_path / "out")
    assert code == 2 and out == "" and not (tmp_path / "out").exists()
    assert err == (f"error: {folder}: query_pre_attn_scalar is 256, but llama.cpp scales this model's attention by "
                   "16: a GGUF of it would not compute what the model computes\n")  # fmt: skip


def test_a_qwen3_moe_that_does_not_renormalize_its_experts_is_refused(tmp_path, cli):
    folder = make_base(tmp_path / "moe", "qwen3_moe", norm_topk_prob=False)
    code, out, err = cli("gguf", folder, "--type", "F32", "--out", tmp_path / "out")
    assert code == 2 and out == "" and not (tmp_path / "out").exists()
    assert err == (f"error: {folder}: norm_topk_prob is False, but llama.cpp's qwen3moe always renormalizes the chosen "
                   "experts' weights: a GGUF of it would not compute what the model computes\n")  # fmt: skip


def test_an_unsupported_architecture_is_one_line_before_anything_is_written(tmp_path, cli):
    folder = gpt_neox(tmp_path / "neox")
    code, out, err = cli("gguf", folder, "--type", "Q8_0", "--out", tmp_path / "out")
    assert code == 2 and out == ""
    assert err == (f"error: {folder}: GGUF export does not support model_type 'gpt_neox' yet "
                   "(supported: gemma2, gemma3_text, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, "
                   "qwen3_moe)\n")  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_an_unknown_type_is_a_usage_error(tmp_path, cli):
    code, _, err = cli("gguf", tmp_path, "--type", "Q9_X", "--out", tmp_path / "out")
    assert code == 2 and err.startswith("error: GGUF type 'Q9_X' is not one we make: F32, F16, BF16, Q8_0, ")


def test_without_llama_cpp_k_quants_name_the_extra_and_f16_is_still_written(tiny_llama, tmp_path, cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setattr(llama, "available", lambda: False)
    llama._llama_cpp.cache_clear()
    try:
        code, out, err = cli("gguf", tiny_llama, "--type", "F16,Q4_K_M", "--out", tmp_path / "out")
        assert code == 2 and out == "" and not (tmp_path / "out").exists()
        assert err == ("error: GGUF type Q4_K_M needs llama-cpp-python, which is not installed: "
                       "pip install 'converter[gguf]'\n")  # fmt: skip
        with pytest.raises(MissingExtraError):
            llama.tokenizer(tmp_path / "x.gguf")
        code, out, err = cli("gguf", tiny_llama, "--type", "F16", "--out", tmp_path / "out")
        assert code == 0, err
        assert out.splitlines()[0] == ("llama.cpp's proof (tokenizer, behaviour) needs llama-cpp-python: "
                                       "pip install 'converter[gguf]'")  # fmt: skip
        assert (tmp_path / "out" / "llama-F16.gguf").is_file()
    finally:
        llama._llama_cpp.cache_clear()


def test_merge_with_gguf_writes_proven_files_beside_the_merge(tiny_llama, tmp_path, cli):
    adapter = make_adapter(tiny_llama, tmp_path / "lora", r=2)
    code, out, err = cli("merge", "--base", tiny_llama, "--adapter", adapter, "--out", tmp_path / "m", "--gguf", "Q8_0")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "m-GGUF").iterdir()) == ["gguf-proof.json", "m-Q8_0.gguf"]
    assert "  tensors: ok: " in out and f"GGUF: m-Q8_0.gguf in {tmp_path / 'm-GGUF'}" in out
    merged = export.open_source(tmp_path / "m")
    reader = fileio.Reader(tmp_path / "m-GGUF" / "m-Q8_0.gguf")
    assert proof.prove_tensors(reader, merged, arch.FAMILIES["llama"], "Q8_0").passed  # the merge's, not the base's
    assert not proof.prove_tensors(reader, export.open_source(tiny_llama), arch.FAMILIES["llama"], "Q8_0").passed


def test_merge_with_gguf_refuses_an_unsupported_base_before_merging(tmp_path, cli):
    base = gpt_neox(tmp_path / "neox")
    adapter = make_adapter(base, tmp_path / "lora", r=2, target_modules=["query_key_value"])
    code, _, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", "--gguf", "F16")
    assert code == 2 and "GGUF export does not support model_type 'gpt_neox'" in err
    assert not (tmp_path / "m").exists() and not (tmp_path / "m-GGUF").exists()


def test_a_hub_model_to_gguf_from_the_command_line_prints_only_its_own_lines(tiny_llama, tmp_path):
    """`converter gguf org/name`: fetched from the (local) Hub, written, proven; a real process, so anything
    llama.cpp, transformers or gguf printed at any level would show in its output."""
    from converter.testing.hub import HubServer, client_env

    server = HubServer(tmp_path / "hub").start()
    try:
        server.add_user("alice", "hf_fake_alice_gguf_0123456789")
        server.seed_folder("alice/tiny-llama", tiny_llama)
        proc = subprocess.run(
            [sys.executable, "-m", "converter", "gguf", "alice/tiny-llama", "--type", "Q8_0", "--out", tmp_path / "o"],
            capture_output=True, text=True, env=client_env(server, "hf_fake_alice_gguf_0123456789"), timeout=600,
        )  # fmt: skip
    finally:
        server.stop()
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert all(line.startswith(("tiny-llama-", "  ", "wrote ", "proof: ")) for line in proc.stdout.splitlines())
    assert f"wrote {tmp_path / 'o' / 'tiny-llama-Q8_0.gguf'}" in proc.stdout


# The CLI in a subprocess: huggingface_hub reads HF_ENDPOINT when it is imported. A sabotaged run patches the writer
# (Q/K rows not reordered) in that process before the CLI starts.
SABOTAGED = """
import sys
from converter.gguf import arch
arch.permute = lambda w, n: w
from converter.cli import main
sys.exit(main())
"""


@pytest.fixture
def hub_cli(tmp_path):
    from converter.testing.hub import HubServer, client_env

    token = "hf_fake_alice_gguf_0123456789"
    server = HubServer(tmp_path / "hub").start()
    server.add_user("alice", token)
    env = client_env(server, token)

    def converter(*args, sabotaged: bool = False):
        head = ["-c", SABOTAGED] if sabotaged else ["-m", "converter"]
        return subprocess.run([sys.executable, *head, *map(str, args)], capture_output=True, text=True, env=env,
                              timeout=600)  # fmt: skip

    converter.server, converter.env = server, env
    yield converter
    server.stop()


def assert_gguf_repo(server, repo: str, base_repo: str, stem: str) -> None:
    """REPO-GGUF as a push makes it: the files, the proof and a card in the Hub's GGUF conventions, one commit."""
    assert set(server.files(repo)) - {".gitattributes"} == {"README.md", "gguf-proof.json", f"{stem}-Q8_0.gguf"}
    readme = server.read_file(repo, "README.md").decode()
    assert f"base_model: {base_repo}\n" in readme and "- gguf\n" in readme
    assert f"llama-cli -hf {repo}:Q8_0" in readme
    assert f"| `{stem}-Q8_0.gguf` | Q8_0 |" in readme and "tensors: " in readme
    titles = [c.title for c in server.repo(repo).commits.values()]
    assert titles.count("Upload GGUF files (converter)") == 1 and len(titles) <= 2  # (+ the Hub's initial commit)


def test_push_from_a_folder_with_gguf_publishes_proven_files_to_repo_gguf(tiny_llama, hub_cli):
    proc = hub_cli("push", "--repo", "alice/tiny", "--from", tiny_llama, "--no-verify", "--gguf", "Q8_0")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "GGUF: pushed: " in proc.stdout
    assert_gguf_repo(hub_cli.server, "alice/tiny-GGUF", "alice/tiny", "tiny")
    readme = hub_cli.server.read_file("alice/tiny-GGUF", "README.md").decode()
    assert ("behaviour: llama.cpp's logits differ" in readme) == llama.available()
    assert "config.json" in hub_cli.server.files("alice/tiny")  # the safetensors repo as a push makes it


PYTHON_PUSH = """
import sys
from converter import PushOptions, push
result = push("alice/tiny", PushOptions(verify=None, gguf="Q8_0"), folder=sys.argv[1], log=lambda _: None)
print([c.repo_id for c in result.companions], [(p.file, p.passed) for p in result.proofs.gguf])
"""


def test_the_python_api_s_push_publishes_its_gguf_repo_too(tiny_llama, hub_cli):
    """push() itself honours PushOptions.gguf, as `converter push --gguf` does: REPO-GGUF proven and published,
    its repo and its file's proof in the result."""
    proc = subprocess.run([sys.executable, "-c", PYTHON_PUSH, str(tiny_llama)], capture_output=True, text=True,
                          env=hub_cli.env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['alice/tiny-GGUF'] [('tiny-Q8_0.gguf', True)]"
    assert_gguf_repo(hub_cli.server, "alice/tiny-GGUF", "alice/tiny", "tiny")


def test_push_with_gguf_merges_verifies_proves_and_publishes_both_repos(tiny_llama, hub_cli, tmp_path):
    """base + LoRA on the Hub to a verified safetensors repo and a proven GGUF repo in one command; the GGUF is the
    merge's (its tensors are the merged ones), not the base's."""
    adapter = make_adapter(tiny_llama, tmp_path / "lora", r=2)
    hub_cli.server.seed_folder("alice/base", tiny_llama)
    hub_cli.server.seed_folder("alice/lora", adapter)
    proc = hub_cli("push", "--repo", "alice/merged", "--base", "alice/base", "--adapter", "alice/lora",
                   "--gguf", "Q8_0")  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "  tensors: ok: " in proc.stdout and "GGUF: pushed: " in proc.stdout
    assert "model.safetensors" in hub_cli.server.files("alice/merged")
    assert_gguf_repo(hub_cli.server, "alice/merged-GGUF", "alice/merged", "merged")
    merged = tmp_path / "merged"
    merged.mkdir()
    for name in ("config.json", "model.safetensors"):
        (merged / name).write_bytes(hub_cli.server.read_file("alice/merged", name))
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(hub_cli.server.read_file("alice/merged-GGUF", "merged-Q8_0.gguf"))
    family = arch.FAMILIES["llama"]
    reader = fileio.Reader(gguf_file)
    assert proof.prove_tensors(reader, export.open_source(merged), family, "Q8_0").passed
    assert not proof.prove_tensors(reader, export.open_source(tiny_llama), family, "Q8_0").passed


def test_push_with_gguf_whose_proof_fails_publishes_nothing(tiny_llama, hub_cli, tmp_path):
    adapter = make_adapter(tiny_llama, tmp_path / "lora", r=2)
    hub_cli.server.seed_folder("alice/base", tiny_llama)
    hub_cli.server.seed_folder("alice/lora", adapter)
    proc = hub_cli("push", "--repo", "alice/merged", "--base", "alice/base", "--adapter", "alice/lora", "--no-verify",
                   "--gguf", "Q8_0", sabotaged=True)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "tensors proof failed: blk.0.attn_k.weight (model.layers.0.self_attn.k_proj.weight)" in proc.stderr
    assert not hub_cli.server.exists("alice/merged") and not hub_cli.server.exists("alice/merged-GGUF")
    proc = hub_cli("push", "--repo", "alice/tiny", "--from", tiny_llama, "--no-verify", "--gguf", "Q8_0",
                   sabotaged=True)  # fmt: skip
    assert proc.returncode == 3 and "tensors proof failed" in proc.stderr
    assert not hub_cli.server.exists("alice/tiny") and not hub_cli.server.exists("alice/tiny-GGUF")
