"""`converter convert ADAPTER --to gguf --base BASE` (and `converter.convert(..., "gguf")`): LoRA adapters as GGUF
adapter files that llama.cpp applies at run time, proven.

Oracles: gguf's own reader must read back every lora_a / lora_b equal to the adapter's A / B (lora_b with the
base's Q/K row order for the Llama line, computed here from the adapter's file); llama.cpp (llama-cpp-python) must
load the base GGUF with the adapter and give PEFT's logits (base + adapter, unmerged). An embedding LoRA's lora_a
must read back as A transposed (one row per token). Sabotaged files (Q lora_b not reordered, a wrong alpha, an
embedding lora_a laid out wrong) must fail the proof with nothing written; what llama.cpp cannot apply is one line.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from model_helpers import make_adapter
from safetensors.numpy import load_file, save_file
from test_gguf import needs_llama, smollm2, tiny

import converter
from converter.errors import BadInputError, UsageError, VerificationFailed
from converter.gguf import adapter as gguf_adapter
from converter.gguf import adapter_proof, arch, llama
from converter.gguf.adapter_export import export_adapter

pytestmark = needs_llama


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def llama_lora(tiny_llama, tmp_path_factory) -> Path:
    """A PEFT LoRA whose modules differ in rank and alpha (llama.cpp has one alpha per file: the rest is in B)."""
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("lora") / "lora", r=4, lora_alpha=8,
                        rank_pattern={"o_proj": 2}, alpha_pattern={"v_proj": 2})  # fmt: skip


def peft_factors(adapter: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """module (Hugging Face name) -> (A, B) as the adapter's file holds them."""
    tensors = load_file(adapter / "adapter_model.safetensors")
    out = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            out[module] = (a, tensors[key.replace("lora_A", "lora_B")])
    return out


def read_adapter_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    keys = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    tensors = {t.name: np.asarray(t.data).reshape(tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors
               if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)}  # fmt: skip
    return keys, tensors


def test_a_peft_lora_on_llama_is_applied_by_llama_cpp_as_peft_applies_it(tiny_llama, llama_lora, tmp_path, cli):
    code, out, err = cli("convert", "--adapter", llama_lora, "--to", "gguf", "--base", tiny_llama,
                         "--out", tmp_path / "out")  # fmt: skip
    assert code == 0, err
    assert "behaviour: ok: llama.cpp's logits with the adapter differ from PEFT's by" in out
    path = tmp_path / "out" / "lora-F32.gguf"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["lora-F32.gguf"]
    keys, tensors = read_adapter_gguf(path)
    assert keys["general.architecture"] == "llama" and keys["general.type"] == "adapter"
    assert keys["adapter.type"] == "lora" and keys["adapter.lora.alpha"] == 8.0
    config = json.loads((tiny_llama / "config.json").read_text())
    heads = {
        "q_proj": config["num_attention_heads"],
        "k_proj": config.get("num_key_value_heads") or config["num_attention_heads"],
    }
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    factors = peft_factors(llama_lora)
    for module, (a, b) in factors.items():
        name = tmap.get_name(module + ".weight", try_suffixes=(".weight",))
        part = module.rsplit(".", 1)[1]
        if part in heads:  # llama.cpp's rope order: the rows of each head interleaved, as for the base weights
            b = b.reshape(heads[part], 2, -1, b.shape[1]).swapaxes(1, 2).reshape(b.shape)
        if part == "v_proj":  # alpha 2 where the file says 8: the ratio is in B
            b = b * np.float32(0.25)
        assert np.array_equal(tensors[f"{name}.lora_a"], a), name
        assert np.array_equal(tensors[f"{name}.lora_b"], b), name
    assert len(tensors) == 2 * len(factors)
    assert tensors["blk.0.attn_output.weight.lora_a"].shape[0] == 2  # rank_pattern: its own rank


# Gemma 3: query_pre_attn_scalar as llama.cpp computes it for a model of this size (test_gguf.TINY); GPT-2: n_ctx
OVERRIDES = {"gemma3_text": {"query_pre_attn_scalar": 16}, "gpt2": {"n_ctx": 128}}


@pytest.mark.parametrize("model_type, type_name", [("qwen3", "Q8_0"), ("gpt2", "F16"), ("gemma3_text", "BF16")])
def test_other_architectures_and_types_are_proven(model_type, type_name, tmp_path):
    base = tiny(tmp_path / model_type, model_type, **OVERRIDES.get(model_type, {}))
    lora = make_adapter(base, tmp_path / "lora", r=8, lora_alpha=16, use_rslora=model_type == "qwen3")
    result = export_adapter(str(lora), str(base), tmp_path / "a.gguf", type_name=type_name, log=lambda _: None)
    assert [p.name for p in result.parts] == ["file", "behaviour"] and all(p.passed for p in result.parts)
    keys, _ = read_adapter_gguf(tmp_path / "a.gguf")
    reader = gguf.GGUFReader(tmp_path / "a.gguf")
    types = {t.tensor_type.name for t in reader.tensors}
    # Q8_0: lora_b of rank 8 has rows of 8 values, fewer than a Q8_0 block: F16 there, as llama.cpp's converter does
    assert types == ({"Q8_0", "F16"} if type_name == "Q8_0" else {type_name})
    assert keys["general.architecture"] == arch.arch_name(arch.FAMILIES[model_type])


def split_phi3_lora(base: Path, folder: Path) -> Path:
    """A PEFT LoRA trained on a "llamafied" Phi-3 (q_proj, k_proj, v_proj, gate_proj and up_proj on their own):
    on the real Phi-3 they land on rows of the fused qkv_proj and gate_up_proj."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d, ff = h // heads, config["intermediate_size"]
    sizes = {"self_attn.q_proj": heads * d, "self_attn.k_proj": kv * d, "self_attn.v_proj": kv * d,
             "mlp.gate_proj": ff, "mlp.up_proj": ff}  # fmt: skip
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for module, rows in sizes.items():
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, h, generator=g) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, 4, generator=g) * 0.1
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]}))  # fmt: skip
    return folder


def test_a_lora_on_phi3s_split_q_k_v_becomes_the_fused_tensors_lora(tmp_path):
    base = tiny(tmp_path / "phi3", "phi3", tokenizer_class="GPT2Tokenizer")
    lora = split_phi3_lora(base, tmp_path / "lora")
    result = export_adapter(str(lora), str(base), tmp_path / "a.gguf", log=lambda _: None)
    assert all(p.passed for p in result.parts) and len(result.parts) == 2
    _, tensors = read_adapter_gguf(tmp_path / "a.gguf")
    assert sorted(tensors) == [f"blk.{i}.{t}.weight.lora_{x}" for i in range(2) for t in ("attn_qkv", "ffn_up")
                               for x in "ab"]  # fmt: skip
    a, b = tensors["blk.0.attn_qkv.weight.lora_a"], tensors["blk.0.attn_qkv.weight.lora_b"]
    assert a.shape[0] == 12 and b.shape[1] == 12  # q, k, v stacked: rank 3 x 4, B block-diagonal
    assert not b[: b.shape[0] // 2, 4:].any()


def test_the_real_smollm2_with_a_lora_made_by_peft_is_applied_by_llama_cpp(tmp_path):
    lora = make_adapter(
        smollm2(),
        tmp_path / "lora",
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    result = export_adapter(str(lora), str(smollm2()), tmp_path / "out", type_name="F16", log=lambda _: None)
    assert result.path == tmp_path / "out" / "lora-F16.gguf" and result.pairs == 30 * 7
    assert all(p.passed for p in result.parts) and result.parts[-1].name == "behaviour"


def test_a_kohya_llm_lora_is_converted_with_its_base(tiny_llama, llama_lora, tmp_path, cli):
    """kohya's flattened names (lora_te_model_layers_0_self_attn_q_proj) are looked up on the base's real keys."""
    code, _, err = cli("convert", "--adapter", llama_lora, "--to", "kohya", "--component", "text_encoder",
                       "--out", tmp_path / "k.safetensors")  # fmt: skip
    assert code == 0, err
    code, out, err = cli("convert", "--adapter", tmp_path / "k.safetensors", "--to", "gguf", "--base", tiny_llama,
                         "--out", tmp_path / "k.gguf", "--type", "bf16")  # fmt: skip
    assert code == 0, err
    assert "behaviour: ok" in out and (tmp_path / "k.gguf").is_file()


# Sabotage: each must fail the proof, with nothing written.


def failed(tiny_llama: Path, lora: Path, out: Path) -> str:
    with pytest.raises(VerificationFailed) as caught:
        export_adapter(str(lora), str(tiny_llama), out / "new" / "a.gguf", log=lambda _: None)
    assert list(out.iterdir()) == []  # the staging folder is gone, and the folder made for the file
    return str(caught.value)


def test_an_unpermuted_q_lora_b_fails_the_file_proof(tiny_llama, llama_lora, tmp_path, monkeypatch):
    monkeypatch.setattr(arch, "permute", lambda w, n: w)  # the writer forgets; the proof's unpermute stays
    message = failed(tiny_llama, llama_lora, tmp_path)
    assert re.search(
        r"file proof failed: blk\.0\.attn_[qk]\.weight\.lora_b "
        r"\(model\.layers\.0\.self_attn\.[qk]_proj\): \d+ values differ from the adapter's B as F32",
        message,
    ), message


def test_an_unpermuted_q_lora_b_read_back_the_same_wrong_way_fails_the_behaviour_proof(tiny_llama, tmp_path,
                                                                                       monkeypatch):  # fmt: skip
    lora = make_adapter(tiny_llama, tmp_path / "lora", r=8, lora_alpha=32, target_modules=["q_proj"])
    monkeypatch.setattr(arch, "permute", lambda w, n: w)
    monkeypatch.setattr(arch, "unpermute", lambda w, n: w)
    (tmp_path / "out").mkdir()
    assert "behaviour proof failed" in failed(tiny_llama, lora, tmp_path / "out")


def double_the_alpha(monkeypatch) -> None:
    """Sabotage: the file's alpha twice the adapter's (its factors right), as the file proof's plan too."""
    plan = gguf_adapter.plan_adapter

    def doubled(*args, **kwargs):
        planned = plan(*args, **kwargs)
        return gguf_adapter.AdapterPlan(planned.alpha * 2, planned.pairs, planned.relaid)

    monkeypatch.setattr("converter.gguf.adapter_export.plan_adapter", doubled)


def test_a_wrong_alpha_fails_the_behaviour_proof(tiny_llama, llama_lora, tmp_path, monkeypatch):
    double_the_alpha(monkeypatch)
    message = failed(tiny_llama, llama_lora, tmp_path)
    assert "behaviour proof failed: llama.cpp's logits with the adapter differ from PEFT's" in message


def test_an_alpha_written_other_than_planned_fails_the_file_proof(tiny_llama, llama_lora, tmp_path, monkeypatch):
    add = gguf.GGUFWriter.add_float32
    monkeypatch.setattr(gguf.GGUFWriter, "add_float32", lambda w, key, v: add(w, key, v + 1))
    assert "file proof failed: adapter.lora.alpha is 9.0, the adapter's alpha is 8.0" in \
        failed(tiny_llama, llama_lora, tmp_path)  # fmt: skip


# What llama.cpp cannot apply: one line, exit 2, nothing written.


@pytest.mark.parametrize("lora, words", [
    ({"use_dora": True}, "is DoRA: llama.cpp applies plain LoRA only"),
    ({"lora_bias": True}, "has a bias delta (PEFT lora_bias)"),
    ({"modules_to_save": ["lm_head"]}, "carries whole tensors or token rows (PEFT modules_to_save"),
    ({"target_modules": ["q_proj", "v_proj"], "alora_invocation_tokens": [5, 6]}, "an activated LoRA (aLoRA"),
])  # fmt: skip
def test_what_llama_cpp_cannot_apply_is_one_line(tiny_llama, lora, words, tmp_path, cli):
    adapter = make_adapter(tiny_llama, tmp_path / "lora", r=4, **lora)
    code, out, err = cli("convert", "--adapter", adapter, "--to", "gguf", "--base", tiny_llama,
                         "--out", tmp_path / "out")  # fmt: skip
    assert code == 2 and not (tmp_path / "out").exists()
    assert err.startswith(f"error: {adapter}: ") and words in err, err and err.endswith("nothing was written\n")
    assert err.count("\n") == 1


def test_gguf_without_a_base_is_a_usage_error(llama_lora, tmp_path, cli):
    code, out, err = cli("convert", "--adapter", llama_lora, "--to", "gguf", "--out", tmp_path / "a.gguf")
    assert code == 2 and out == "" and not (tmp_path / "a.gguf").exists()
    assert err == "error: --to gguf needs --base: the base model gives the architecture and llama.cpp's tensor names\n"


def test_a_lora_on_a_head_tied_to_the_embeddings_is_one_line(tmp_path, cli):
    base = tiny(tmp_path / "tied", "llama", tie_word_embeddings=True)
    adapter = make_adapter(base, tmp_path / "lora", r=4, target_modules=["q_proj", "lm_head"])
    weights = adapter / "adapter_model.safetensors"  # PEFT saves the tied embeddings too: keep its LoRAs only
    save_file({k: v for k, v in load_file(weights).items() if ".lora_" in k}, weights)
    code, out, err = cli("convert", "--adapter", adapter, "--to", "gguf", "--base", base, "--out", tmp_path / "a.gguf")
    assert code == 2 and not (tmp_path / "a.gguf").exists()
    assert err == (f"error: {adapter}: lm_head targets lm_head.weight, which the base's GGUF has no "
                   "tensor output.weight for (its weights are tied to the token embeddings there); llama.cpp could "
                   "not apply it; nothing was written\n")  # fmt: skip


def test_a_hub_adapter_on_a_hub_base_from_the_command_line_prints_only_its_own_lines(tiny_llama, llama_lora, tmp_path):
    """Both fetched from the (local) Hub; a real process, so anything llama.cpp, PEFT or transformers printed would
    show in its output."""
    from converter.testing.hub import HubServer, client_env

    token = "hf_fake_alice_gguf_lora_0123456789"
    server = HubServer(tmp_path / "hub").start()
    try:
        server.add_user("alice", token)
        server.seed_folder("alice/tiny-llama", tiny_llama)
        server.seed_folder("alice/tiny-lora", llama_lora)
        proc = subprocess.run(
            [sys.executable, "-m", "converter", "convert", "--adapter", "alice/tiny-lora", "--to", "gguf",
             "--base", "alice/tiny-llama", "--type", "F16", "--out", tmp_path / "o"],
            capture_output=True, text=True, env=client_env(server, token), timeout=600,
        )  # fmt: skip
    finally:
        server.stop()
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines()[0] == "tiny-lora-F16.gguf: 14 LoRA pairs, alpha 8, F16"
    assert "  behaviour: ok: " in proc.stdout
    assert proc.stdout.endswith(f"wrote {tmp_path / 'o' / 'tiny-lora-F16.gguf'}\n")


def test_without_llama_cpp_the_file_is_still_proven_and_the_extra_named(tiny_llama, llama_lora, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    monkeypatch.setattr(llama, "available", lambda: False)
    lines: list[str] = []
    result = export_adapter(str(llama_lora), str(tiny_llama), tmp_path / "a.gguf", log=lines.append)
    assert [p.name for p in result.parts] == ["file"] and result.parts[0].passed
    assert any(line.startswith("llama.cpp's behaviour proof needs llama-cpp-python: ") for line in lines)
    assert (tmp_path / "a.gguf").is_file()


def test_the_command_lines_help_offers_gguf(capsys):
    from converter.cli import main

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "{peft,diffusers,kohya,comfyui,gguf}" in out
    assert "--type TYPE --to gguf: F32 (default), F16, BF16 or Q8_0" in out


# The Python API: the CLI's conversion, its result and its typed errors.


def test_the_python_api_writes_a_proven_gguf_and_returns_its_proof(tiny_llama, llama_lora, tmp_path):
    lines: list[str] = []
    result = converter.convert(str(llama_lora), tmp_path / "api",
                               converter.ConvertOptions(to="gguf", base=str(tiny_llama), type="f16"),
                               log=lines.append)  # fmt: skip
    path = tmp_path / "api" / "lora-F16.gguf"
    assert (result.out, result.files, result.modules) == (path, ["lora-F16.gguf"], 14)
    assert (result.alpha, result.type, result.notes, result.svd_errors) == (8.0, "F16", [], {})
    assert result.verdict == "pass" and [p.name for p in result.proof] == ["file", "behaviour"]
    assert all(p.passed for p in result.proof) and lines[0] == "lora-F16.gguf: 14 LoRA pairs, alpha 8, F16"
    keys, tensors = read_adapter_gguf(path)
    assert keys["adapter.lora.alpha"] == 8.0 and len(tensors) == 28
    again = converter.convert(str(llama_lora), path, converter.ConvertOptions(to="gguf", base=str(tiny_llama),
                              type="F16", force=True, verify=False), log=lambda _: None)  # fmt: skip
    assert again.verdict == "skipped" and again.proof == [] and again.out == path


@pytest.mark.parametrize("to, with_base, options, words", [
    ("gguf", False, {}, "--to gguf needs --base: the base model gives the architecture and llama.cpp's tensor names"),
    ("gguf", True, {"type": "Q4_K"}, "--type Q4_K: an adapter GGUF is one of F32, F16, BF16, Q8_0"),
    ("gguf", True, {"component": "unet"}, "--component is for diffusion adapters; --to gguf takes language-model"),
    ("peft", True, {"type": "F16"}, "--type is for --to gguf (the GGUF type of the adapter file)"),
    ("onnx", True, {}, "--to onnx: choose one of peft, diffusers, kohya, comfyui, gguf"),
])  # fmt: skip
def test_the_python_api_refuses_with_the_clis_usage_errors(tiny_llama, llama_lora, to, with_base, options, words,
                                                           tmp_path):  # fmt: skip
    base = str(tiny_llama) if with_base else None
    with pytest.raises(UsageError) as caught:
        converter.convert(str(llama_lora), tmp_path / "a.gguf", converter.ConvertOptions(to=to, base=base, **options),
                          log=lambda _: None)  # fmt: skip
    assert str(caught.value).startswith(words) and list(tmp_path.iterdir()) == []


def test_the_python_api_names_what_llama_cpp_cannot_apply_as_the_cli_does(tiny_llama, tmp_path, cli):
    adapter = make_adapter(tiny_llama, tmp_path / "dora", r=4, use_dora=True)
    with pytest.raises(BadInputError) as caught:
        converter.convert(str(adapter), tmp_path / "out", converter.ConvertOptions(to="gguf", base=str(tiny_llama)),
                          log=lambda _: None)  # fmt: skip
    assert caught.value.file == str(adapter) and "is DoRA: llama.cpp applies plain LoRA only" in str(caught.value)
    code, _, err = cli("convert", "--adapter", adapter, "--to", "gguf", "--base", tiny_llama, "--out", tmp_path / "o")
    assert code == 2 and err == f"error: {caught.value}\n" and not (tmp_path / "out").exists()


# A LoRA on the token embeddings: llama.cpp gathers lora_a by token, so lora_a is A transposed.


@pytest.fixture(scope="module")
def embedding_lora(tiny_llama, tmp_path_factory) -> Path:
    """PEFT's embedding LoRA (lora_embedding_A/B, and the embedding saved whole beside it) with its own alpha."""
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("emb") / "lora", r=4, lora_alpha=8,
                        target_modules=["embed_tokens", "q_proj"], alpha_pattern={"embed_tokens": 2})  # fmt: skip


def test_an_embedding_lora_is_applied_by_llama_cpp_as_peft_applies_it(tiny_llama, embedding_lora, tmp_path):
    result = export_adapter(str(embedding_lora), str(tiny_llama), tmp_path / "a.gguf", log=lambda _: None)
    assert [p.name for p in result.parts] == ["file", "behaviour"] and all(p.passed for p in result.parts)
    _, tensors = read_adapter_gguf(tmp_path / "a.gguf")
    saved = load_file(embedding_lora / "adapter_model.safetensors")
    a = saved["base_model.model.model.embed_tokens.lora_embedding_A"]  # (rank, vocab)
    b = saved["base_model.model.model.embed_tokens.lora_embedding_B"]  # (dim, rank)
    assert a.shape == (4, 49152) and b.shape == (64, 4)
    assert np.array_equal(tensors["token_embd.weight.lora_a"], a.T)  # one row of rank values per token
    assert np.array_equal(tensors["token_embd.weight.lora_b"], b * np.float32(0.25))  # alpha 2 where the file says 8
    # the embedding PEFT saved whole is the base's: left out; q_proj's two pairs are there
    assert sorted(tensors) == sorted(["token_embd.weight.lora_a", "token_embd.weight.lora_b"] +
                                     [f"blk.{i}.attn_q.weight.lora_{x}" for i in range(2) for x in "ab"])  # fmt: skip


def test_an_embedding_lora_in_q8_0_is_quantized_one_row_per_token(tiny_llama, tmp_path):
    """Rank 32: lora_a's rows (one per token) are one Q8_0 block each; quantized the other way round it would not
    read back as gguf's reference quantization of A transposed."""
    lora = make_adapter(tiny_llama, tmp_path / "lora", r=32, lora_alpha=16, target_modules=["embed_tokens"])
    result = export_adapter(str(lora), str(tiny_llama), tmp_path / "a.gguf", type_name="Q8_0", log=lambda _: None)
    assert all(p.passed for p in result.parts) and len(result.parts) == 2
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "a.gguf").tensors}
    assert types == {"token_embd.weight.lora_a": "Q8_0", "token_embd.weight.lora_b": "Q8_0"}


def reshaped(a: np.ndarray) -> np.ndarray:
    """A transposed layout that is not a transpose: the right shape, the values in the wrong places."""
    return np.ascontiguousarray(a.reshape(a.shape[1], a.shape[0]))


def test_an_embedding_lora_a_laid_out_wrong_fails_the_file_proof(tiny_llama, embedding_lora, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    monkeypatch.setattr(gguf_adapter, "token_rows", reshaped)
    message = failed(tiny_llama, embedding_lora, tmp_path)
    assert re.search(
        r"file proof failed: token_embd\.weight\.lora_a \(model\.embed_tokens\): \d+ values differ "
        r"from the adapter's A as F32 \(one row per token\)",
        message,
    ), message


def test_an_embedding_lora_a_read_back_the_same_wrong_way_fails_the_behaviour_proof(tiny_llama, embedding_lora,
                                                                                    tmp_path, monkeypatch):  # fmt: skip
    monkeypatch.setattr(gguf_adapter, "token_rows", reshaped)
    monkeypatch.setattr(adapter_proof, "expected_token_rows", reshaped)
    assert "behaviour proof failed: llama.cpp's logits with the adapter differ from PEFT's" in \
        failed(tiny_llama, embedding_lora, tmp_path)  # fmt: skip


def test_an_embedding_lora_with_its_embedding_saved_changed_is_one_line(tiny_llama, embedding_lora, tmp_path, cli):
    """The embedding saved whole is not the base's (a token row trained or added): no LoRA adapter can carry it."""
    adapter = tmp_path / "lora"
    shutil.copytree(embedding_lora, adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.embed_tokens.base_layer.weight"
    tensors[key] = tensors[key].copy()
    tensors[key][7, 3] += 1
    save_file(tensors, adapter / "adapter_model.safetensors")
    code, _, err = cli("convert", "--adapter", adapter, "--to", "gguf", "--base", tiny_llama, "--out", tmp_path / "o")
    assert code == 2 and not (tmp_path / "o").exists() and err.count("\n") == 1
    assert err.startswith(f"error: {adapter}: model.embed_tokens carries whole tensors or token rows"), err


def test_an_embedding_lora_on_a_base_with_its_head_tied_to_the_embeddings_is_one_line(tmp_path, cli):
    """llama.cpp reads token_embd.weight for the output head too, and would apply the LoRA there (and abort)."""
    base = tiny(tmp_path / "tied", "llama", tie_word_embeddings=True)
    adapter = make_adapter(base, tmp_path / "lora", r=4, target_modules=["embed_tokens", "q_proj"])
    code, _, err = cli("convert", "--adapter", adapter, "--to", "gguf", "--base", base, "--out", tmp_path / "a.gguf")
    assert code == 2 and not (tmp_path / "a.gguf").exists()
    assert err == (f"error: {adapter}: model.embed_tokens is an embedding LoRA on a base whose output head is its "
                   "token embeddings (tied weights: one tensor, token_embd.weight, in its GGUF); llama.cpp would "
                   "apply the LoRA to the output head too, where its shapes do not fit (llama.cpp aborts); merge it "
                   "instead (converter merge --gguf); nothing was written\n")  # fmt: skip


def test_on_a_moe_base_router_near_ties_are_left_out_of_the_behaviour_proof_which_still_fails_a_wrong_alpha(
        tmp_path, monkeypatch):  # fmt: skip
    """A Mixtral whose router rows of experts 2 and 3 agree to 1e-8 (and expert 3's output is 30x expert 2's):
    wherever they are the last chosen and the first left out, llama.cpp and PEFT may pick either, and a right
    adapter failed at 0.016 against 0.01 before near ties were left out. Each text is compared up to its first near
    tie of base + adapter's routers; a doubled alpha still fails on the positions compared."""
    base = tiny(tmp_path / "mixtral", "mixtral")
    tensors = load_file(base / "model.safetensors")
    rng = np.random.default_rng(0)
    for key in [k for k in tensors if k.endswith("block_sparse_moe.gate.weight")]:
        tensors[key][3] = tensors[key][2] + np.float32(1e-8) * rng.standard_normal(tensors[key].shape[1])
        down = key.replace("gate.weight", "experts.3.w2.weight")
        tensors[down] = tensors[down] * np.float32(30)
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    lora = make_adapter(base, tmp_path / "lora", seed=1, r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    result = export_adapter(str(lora), str(base), tmp_path / "a.gguf", log=lambda _: None)
    behaviour = result.parts[-1]
    assert behaviour.passed and behaviour.judged, behaviour.detail
    assert re.search(r"; \d+ of \d+ positions compared \(each text up to its first near tie", behaviour.detail)
    double_the_alpha(monkeypatch)
    (tmp_path / "wrong").mkdir()
    message = failed(base, lora, tmp_path / "wrong")
    assert "behaviour proof failed: llama.cpp's logits with the adapter differ from PEFT's" in message, message
