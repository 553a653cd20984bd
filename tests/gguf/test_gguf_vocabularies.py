"""Tokenizers as released, in GGUF: llama.cpp's own test vocabularies on tiny models of every architecture.

llama.cpp ships the real vocabularies of the models it runs (`models/ggml-vocab-*.gguf` in the llama-cpp-python source
distribution), each with test texts (`.inp`) and the token ids the model's own tokenizer gives them (`.out`). From each
one we rebuild the tokenizer folder as its model was released (tokenizer.json with the normalizer / pre-tokenizer of
the release, tokenizer.model where the release had one), check that transformers tokenizes the `.inp` texts into the
`.out` ids (so the folder is faithful), attach it to a tiny model of the matching architecture, export F16 with the
full proof, and check that llama.cpp tokenizes the `.inp` texts of the exported file into the `.out` ids too.

Covered (vocabulary -> architectures): Llama 2 SentencePiece -> llama (as Meta released it, tokenizer.model and the
legacy tokenizer.json), mixtral (tokenizer.json only, as transformers 5 saves it), mistral (tokenizer.json with
Metaspace "first", as transformers 5 makes it from a bare tokenizer.model); Llama 3 BPE -> llama; Qwen2 -> qwen2,
qwen2_moe, qwen3, qwen3_moe; Phi-3 SentencePiece -> phi3; GPT-2 -> gpt2. Gemma's only vocabulary there is Gemma 4's
(llama.cpp's `gemma4` tokenizer type, which transformers cannot load): gemma2 / gemma3_text stay covered by
test_gguf.py's SentencePiece tokenizer trained in the test.
"""

from __future__ import annotations

import json
import shutil
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from model_helpers import make_base

from converter.errors import VerificationFailed
from converter.gguf import export, fileio, llama, vocab
from converter.gguf import proof as gguf_proof
from converter.testing import llama_convert

pytestmark = pytest.mark.skipif(not llama.available(), reason="llama-cpp-python (converter[gguf]) not installed")

MODELS = "/vendor/llama.cpp/models/"
SEPARATOR = "\n__ggml_vocab_test__\n"  # between two texts of a `.inp` file (llama.cpp's test-tokenizer-0)
# the normalizer of Llama 2's and Phi-3's released tokenizer.json: a "▁" before every piece of text, spaces as "▁"
LEGACY_NORMALIZER = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "\u2581"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
]}  # fmt: skip


@dataclass(frozen=True)
class Released:
    """A released tokenizer: llama.cpp's vocabulary file, how the folder is written, the architecture it goes on."""

    vocab: str  # ggml-vocab-{vocab}.gguf
    model_type: str
    form: str = "as-is"  # tokenizer.json's normalizer: "legacy" (Llama 2's, Phi-3's), "metaspace" (transformers 5's)
    spm_model: bool = False  # a tokenizer.model beside tokenizer.json, as the release has it
    tokenizer_class: str = "PreTrainedTokenizerFast"  # a Llama class makes transformers 5 read it with Metaspace
    legacy: bool | None = None  # tokenizer_config's `legacy` (Metaspace "always" if true, else "first")
    bos: bool = False  # the release's post-processor puts BOS first (Llama 3's)


LLAMA = "LlamaTokenizer"
# transformers 5 reads these with Metaspace: llama.cpp's space after special tokens differs, and the proof says so
SPACED = {"llama2", "mistral"}
CASES = {
    # Meta's Llama 2 release: tokenizer.model, the legacy tokenizer.json, LlamaTokenizer with legacy true
    "llama2": Released("llama-spm", "llama", "legacy", spm_model=True, tokenizer_class=LLAMA, legacy=True),
    # a Llama 2 fine-tune saved by transformers 5: tokenizer.json only (Metaspace "first"), legacy false
    "mistral": Released("llama-spm", "mistral", "metaspace", tokenizer_class=LLAMA, legacy=False),
    # tokenizer.json only, read as written (no Llama class): the legacy normalizer, as llama.cpp tokenizes
    "mixtral": Released("llama-spm", "mixtral", "legacy"),
    "llama3": Released("llama-bpe", "llama", bos=True),
    "qwen2": Released("qwen2", "qwen2", tokenizer_class="Qwen2Tokenizer"),
    "qwen2_moe": Released("qwen2", "qwen2_moe", tokenizer_class="Qwen2Tokenizer"),
    "qwen3": Released("qwen2", "qwen3", tokenizer_class="Qwen2Tokenizer"),
    "qwen3_moe": Released("qwen2", "qwen3_moe", tokenizer_class="Qwen2Tokenizer"),
    # Microsoft's Phi-3 release: tokenizer.model, the legacy tokenizer.json, LlamaTokenizer with legacy false
    "phi3": Released("phi-3", "phi3", "legacy", spm_model=True, tokenizer_class=LLAMA, legacy=False),
    "gpt2": Released("gpt-2", "gpt2", tokenizer_class="GPT2Tokenizer"),
}


@pytest.fixture(scope="session")
def vocab_files(tmp_path_factory) -> Path:
    """The vocabulary files the cases use, with their `.inp` / `.out`, extracted once from the sdist."""
    sdist = llama_convert.default_sdist()
    if not sdist.is_file():
        pytest.fail(f"llama-cpp-python's sdist missing at {sdist}: `make test` downloads it")
    wanted = {f"ggml-vocab-{c.vocab}.gguf{ext}" for c in CASES.values() for ext in ("", ".inp", ".out")}
    out = tmp_path_factory.mktemp("vocab")
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name.rsplit("/", 1)[-1]
            if MODELS in member.name and name in wanted:
                (out / name).write_bytes(tar.extractfile(member).read())
    return out


def cases(vocab_files: Path, name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test texts of a vocabulary and the ids its model's own tokenizer gives them."""
    raw = (vocab_files / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    texts = raw.removesuffix(SEPARATOR).split(SEPARATOR)
    ids = [
        [int(i) for i in line.split()]
        for line in (vocab_files / f"ggml-vocab-{name}.gguf.out").read_text().splitlines()
    ]
    assert len(texts) == len(ids) > 10
    return list(zip(texts, ids, strict=True))


def _spm_model(keys: dict, size: int) -> bytes:
    """tokenizer.model from the vocabulary's SentencePiece pieces, scores and types (GGUF's token types are
    SentencePiece's), with Llama's settings: BPE, byte fallback, a dummy prefix, no whitespace clean-up."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    for token, score, kind in zip(keys["tokenizer.ggml.tokens"][:size], keys["tokenizer.ggml.scores"][:size],
                                  keys["tokenizer.ggml.token_type"][:size], strict=True):  # fmt: skip
        model.pieces.add(piece=token, score=score, type=kind)
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.trainer_spec.vocab_size = size
    model.trainer_spec.unk_id, model.trainer_spec.bos_id, model.trainer_spec.eos_id = 0, 1, 2
    model.trainer_spec.pad_id = -1
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = True
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = True
    return model.SerializeToString()


def tokenizer_folder(vocab_files: Path, case: Released, folder: Path) -> Path:
    """The tokenizer as released: transformers' reading of llama.cpp's file (its vocabulary, merges and special
    tokens), written with the release's normalizer / pre-tokenizer, class and flags, and its tokenizer.model."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    path = vocab_files / f"ggml-vocab-{case.vocab}.gguf"
    architecture, tokenizer_dict, config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    folder.mkdir(parents=True)
    backend.save(str(folder / "tokenizer.json"))
    data = json.loads((folder / "tokenizer.json").read_text())
    if case.form == "legacy":
        data["normalizer"], data["pre_tokenizer"] = LEGACY_NORMALIZER, None
    elif case.form == "metaspace":
        data["normalizer"] = None
        data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                                 "split": False}  # fmt: skip
    if case.bos:
        bos, seq = {"SpecialToken": {"id": config["bos_token"], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
        ids = {"id": config["bos_token"], "ids": [tokenizer_dict["bos_token_id"]], "tokens": [config["bos_token"]]}
        data["post_processor"] = {"type": "TemplateProcessing", "single": [bos, seq], "pair": [bos, seq],
                                  "special_tokens": {config["bos_token"]: ids}}  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    keys = {k: f.contents() for k, f in fileio.Reader(path).fields.items() if k.startswith("tokenizer.")}
    specials = {name: config.get(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    tok_config = {"tokenizer_class": case.tokenizer_class, **{k: v for k, v in specials.items() if v is not None},
                  "add_bos_token": bool(config.get("add_bos_token") or case.bos),
                  "add_eos_token": False, "model_max_length": 4096}  # fmt: skip
    if case.legacy is not None:
        tok_config["legacy"] = case.legacy
    if config.get("chat_template"):
        tok_config["chat_template"] = config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if case.spm_model:
        types = keys["tokenizer.ggml.token_type"]  # the tokens added after the SentencePiece model are not in it
        n = next((i for i, t in enumerate(types) if t in (3, 4) and i > 2), len(types))
        (folder / "tokenizer.model").write_bytes(_spm_model(keys, n))
    return folder


@pytest.fixture(scope="session")
def released(vocab_files, tmp_path_factory):
    """The tiny model of a case (built once per session): its released tokenizer (one folder per way of writing it,
    shared by the architectures that take it), vocab_size the vocabulary's."""
    tokenizers: dict[Released, tuple[Path, int]] = {}
    built: dict[str, Path] = {}

    def tokenizer(case: Released) -> tuple[Path, int]:
        key = replace(case, model_type="")
        if key not in tokenizers:
            folder = tokenizer_folder(vocab_files, case, tmp_path_factory.mktemp("tokenizer") / "tokenizer")
            data = json.loads((folder / "tokenizer.json").read_text())
            size = max([len(data["model"]["vocab"]), *(t["id"] + 1 for t in data["added_tokens"])])
            tokenizers[key] = folder, size
        return tokenizers[key]

    def build(name: str) -> Path:
        if name not in built:
            case = CASES[name]
            source, size = tokenizer(case)
            folder = tmp_path_factory.mktemp(name) / "model"
            shutil.copytree(source, folder)
            fields = fileio.Reader(vocab_files / f"ggml-vocab-{case.vocab}.gguf").fields
            ids = {k: fields[f"tokenizer.ggml.{k}"].contents() for k in ("bos_token_id", "eos_token_id")
                   if f"tokenizer.ggml.{k}" in fields}  # fmt: skip
            extra = {"n_ctx": 128} if case.model_type == "gpt2" else {}
            if case.model_type == "qwen3_moe":
                extra["norm_topk_prob"] = True  # as Qwen3's MoE models (llama.cpp assumes it)
            tied = not case.model_type.endswith("_moe")  # llama.cpp's MoE architectures need their own head
            make_base(folder, case.model_type, vocab_size=size, tie_word_embeddings=tied, **ids, **extra)
            built[name] = folder
        return built[name]

    return build


@pytest.mark.parametrize("name", list(CASES))
def test_released_vocabulary_is_exported_and_proven(name, released, vocab_files, tmp_path):
    """F16 with the whole proof (tokenizer and behaviour by llama.cpp), and llama.cpp's own test texts tokenized by
    the exported file into the ids the model's own tokenizer gives them."""
    case = CASES[name]
    result = export.export(released(name), ["F16"], tmp_path / "out", name="tiny", log=lambda _: None)
    proof = result.proofs[0]
    assert proof.passed and [p.name for p in proof.parts] == ["metadata", "tensors", "tokenizer", "behaviour"]
    tokenizer_part = proof.parts[2].detail
    assert (gguf_proof.SPM_SPACE in tokenizer_part) == (name in SPACED), tokenizer_part
    tokenizer = llama.tokenizer(result.files[0])
    try:
        wrong = [text for text, ids in cases(vocab_files, case.vocab)
                 if tokenizer.tokenize(text.encode(), add_bos=False, special=False) != ids]  # fmt: skip
    finally:
        tokenizer.close()
    assert wrong == []


@pytest.mark.parametrize("name", ["mixtral", "mistral"])
def test_a_sentencepiece_tokenizer_json_without_merge_scores_is_refused(name, released, monkeypatch, tmp_path):
    """tokenizer.json only: without scores from its merges every token scores alike, llama.cpp merges left to right
    and tokenizes differently; the proof refuses, also where transformers' Metaspace differs from llama.cpp by the
    stated space (that leniency does not hide a real mismatch)."""
    monkeypatch.setattr(vocab, "_merge_scores", lambda folder, tokens, scores: scores)
    with pytest.raises(VerificationFailed, match="tokenizer proof failed"):
        export.export(released(name), ["F16"], tmp_path / "out", name="tiny", log=lambda _: None)
    assert not list((tmp_path / "out").glob("*.gguf"))


def test_a_released_bpe_vocabulary_with_another_pre_tokenizer_is_refused(released, tmp_path):
    """GPT-2's vocabulary with Llama 3's pre-tokenizer name: llama.cpp splits the text otherwise, the proof refuses."""
    with pytest.raises(VerificationFailed, match="tokenizer proof failed"):
        export.export(released("gpt2"), ["F16"], tmp_path / "out", name="tiny", log=lambda _: None, pre="llama-bpe")
