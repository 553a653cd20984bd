"""Every PEFT feature, each checked against PEFT's own unmerged forward (the oracle)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from model_helpers import load_merged, logits, make_adapter, make_base, read_tensors, reference_model, token_ids


def merge_and_compare(tmp_path, cli, base, adapters, weights=None, atol=2e-5, extra=()):
    args = ["merge", "--base", base, "--out", tmp_path / "merged", *extra]
    for a in adapters:
        args += ["--adapter", a]
    for w in weights or []:
        args += ["--weight", str(w)]
    code, out, err = cli(*args)
    assert code == 0, err
    ids = token_ids()
    ref = logits(reference_model(base, adapters, weights), ids)
    merged_model, info = load_merged_with_info(tmp_path / "merged")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(logits(merged_model, ids), ref, atol=atol, rtol=1e-5)
    bare = logits(load_merged(base), ids)
    assert (ref - bare).abs().max() > 1e-2
    return out


def load_merged_with_info(folder):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


@pytest.fixture
def llama(tmp_path):
    return make_base(tmp_path / "base", "llama")


@pytest.mark.parametrize(
    "lora",
    [
        dict(r=4, lora_alpha=16, use_rslora=True),
        dict(
            r=8,
            lora_alpha=8,
            rank_pattern={"q_proj": 2, r"layers\.1\.mlp\.down_proj": 6},
            alpha_pattern={"v_proj": 32, "down_proj": 3},
        ),
        dict(r=4, lora_alpha=8, use_dora=True),
        dict(r=4, lora_alpha=8, use_dora=True, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
        dict(r=4, lora_alpha=8, target_modules=r".*\.(q_proj|up_proj)"),
        dict(r=4, lora_alpha=8, target_modules=["k_proj", "gate_proj"]),
        dict(r=4, lora_alpha=8, target_modules=["q_proj"], layers_to_transform=[1]),
    ],
    ids=[
        "rslora",
        "rank-alpha-patterns",
        "dora",
        "dora-rslora",
        "regex-targets",
        "list-targets",
        "layers-to-transform",
    ],
)
def test_lora_variants(lora, llama, tmp_path, cli):
    adapter = make_adapter(llama, tmp_path / "lora", **lora)
    merge_and_compare(tmp_path, cli, llama, [adapter])


def test_lora_bias(tmp_path, cli):
    base = make_base(tmp_path / "base", "qwen2")  # Qwen2 has q/k/v biases
    adapter = make_adapter(
        base, tmp_path / "lora", r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj", "v_proj"]
    )
    merge_and_compare(tmp_path, cli, base, [adapter])


def test_dora_magnitude_without_weight_suffix(llama, tmp_path, cli):
    """Older PEFT saved `lora_magnitude_vector` with no `.weight` suffix; both spellings merge the same."""
    from safetensors.torch import load_file, save_file

    adapter = make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8, use_dora=True)
    f = adapter / "adapter_model.safetensors"
    tensors = load_file(f)
    renamed = {k.removesuffix(".weight") if "lora_magnitude_vector" in k else k: v for k, v in tensors.items()}
    assert renamed != tensors or any(k.endswith("lora_magnitude_vector") for k in tensors)
    save_file(renamed, f, metadata={"format": "pt"})
    assert cli("merge", "--base", llama, "--adapter", adapter, "--out", tmp_path / "m2")[0] == 0
    save_file(tensors, f, metadata={"format": "pt"})
    merge_and_compare(tmp_path, cli, llama, [adapter])
    a, b = read_tensors(tmp_path / "m2"), read_tensors(tmp_path / "merged")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gpt2_conv1d_fan_in_fan_out(tmp_path, cli):
    base = make_base(tmp_path / "base", "gpt2")
    adapter = make_adapter(
        base,
        tmp_path / "lora",
        r=4,
        lora_alpha=8,
        target_modules=["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,
        use_dora=True,
    )
    merge_and_compare(tmp_path, cli, base, [adapter])


def test_embedding_lora_and_untied_head(tmp_path, cli):
    """LoRA on the embedding of a tied model: PEFT's forward leaves the head alone, so the output unties."""
    base = make_base(tmp_path / "base", "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in read_tensors(base)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])
    merge_and_compare(tmp_path, cli, base, [adapter])
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    out = read_tensors(tmp_path / "merged")
    assert torch.equal(out["lm_head.weight"], read_tensors(base)["model.embed_tokens.weight"])


def test_lm_head_lora_on_tied_model(tmp_path, cli):
    base = make_base(tmp_path / "base", "qwen2", tie_word_embeddings=True)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["lm_head", "v_proj"])
    merge_and_compare(tmp_path, cli, base, [adapter])
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False


def test_tied_model_untouched_embeddings_stay_tied(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama", tie_word_embeddings=True)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    merge_and_compare(tmp_path, cli, base, [adapter])
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in read_tensors(tmp_path / "merged")


def test_modules_to_save(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama")
    adapter = make_adapter(
        base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head", "norm"]
    )
    merge_and_compare(tmp_path, cli, base, [adapter])


@pytest.mark.parametrize("tied", [False, True])
def test_trainable_tokens(tied, tmp_path, cli):
    base = make_base(tmp_path / "base", "llama", tie_word_embeddings=tied)
    adapter = make_adapter(
        base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[5, 17, 200]
    )
    merge_and_compare(tmp_path, cli, base, [adapter])
    if tied:  # PEFT applies trainable tokens to both sides of a tie: the tie survives
        assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is True


def test_resized_vocabulary(tmp_path, cli):
    """The adapter was trained on a base with added tokens: its full embedding/head replace the base's."""
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    base = make_base(tmp_path / "base", "llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(260)
    with torch.no_grad():
        model.model.embed_tokens.weight[256:].normal_()
        model.lm_head.weight[256:].normal_()
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        modules_to_save=["embed_tokens", "lm_head"],
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, lora)
    peft_model.save_pretrained(tmp_path / "lora")
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.save_pretrained(tmp_path / "lora")
    code, out, err = cli("merge", "--base", base, "--adapter", tmp_path / "lora", "--out", tmp_path / "merged")
    assert code == 0, err
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["vocab_size"] == 260
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    merged = load_merged(tmp_path / "merged")
    ids = torch.tensor([[3, 257, 259, 100]])
    torch.testing.assert_close(logits(merged, ids), logits(peft_model.eval(), ids), atol=2e-5, rtol=1e-5)


def test_several_adapters_with_weights(llama, tmp_path, cli):
    a = make_adapter(llama, tmp_path / "a", seed=1, r=4, lora_alpha=8)
    b = make_adapter(llama, tmp_path / "b", seed=2, r=8, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    merge_and_compare(tmp_path, cli, llama, [a, b], weights=[0.7, 0.3])


def test_several_dora_adapters(llama, tmp_path, cli):
    """Two DoRA adapters and a plain LoRA on the same modules, weighted: DoRA composes in order, as in PEFT."""
    a = make_adapter(
        llama, tmp_path / "a", seed=1, r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "up_proj"]
    )
    b = make_adapter(llama, tmp_path / "b", seed=2, r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"])
    c = make_adapter(llama, tmp_path / "c", seed=3, r=2, lora_alpha=8, target_modules=["q_proj", "up_proj"])
    merge_and_compare(tmp_path, cli, llama, [a, b, c], weights=[1.0, 0.5, 0.8])


def test_recipe_with_include_exclude(llama, tmp_path, cli):
    make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "base": "base",
                "out": "merged",
                "adapters": [{"source": "lora", "weight": 0.5, "include": [r"self_attn"], "exclude": [r"layers\.1\."]}],
            }
        )
    )
    code, out, err = cli("merge", "--recipe", recipe)
    assert code == 0, err
    merged, base = read_tensors(tmp_path / "merged"), read_tensors(llama)
    changed = {k for k in merged if not torch.equal(merged[k], base[k])}
    assert changed == {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    recorded = yaml.safe_load((tmp_path / "merged" / "converter_recipe.yaml").read_text())
    assert recorded["adapters"][0]["weight"] == 0.5 and recorded["adapters"][0]["exclude"] == [r"layers\.1\."]
    # The recorded recipe re-runs to the same bytes.
    code, _, err = cli("merge", "--recipe", tmp_path / "merged" / "converter_recipe.yaml", "--out", tmp_path / "again")
    assert code == 0, err
    again = read_tensors(tmp_path / "again")
    assert all(torch.equal(again[k], merged[k]) for k in merged)


def test_output_dtype_and_byte_copies(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama", dtype=torch.float32)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    assert cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "same")[0] == 0
    assert cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "bf16", "--dtype", "bfloat16")[0] == 0
    src, same, bf16 = read_tensors(base), read_tensors(tmp_path / "same"), read_tensors(tmp_path / "bf16")
    for name in src:
        if "q_proj" not in name:
            assert torch.equal(same[name], src[name])
        assert bf16[name].dtype == torch.bfloat16
        torch.testing.assert_close(bf16[name], same[name].to(torch.bfloat16), atol=0, rtol=0)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_sharded_output_and_provenance(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama")
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8)
    code, _, err = cli(
        "merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", "--max-shard-size", "200KB"
    )
    assert code == 0, err
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    from safetensors import safe_open

    with safe_open(tmp_path / "m" / shards[0], "pt") as f:
        assert f.metadata() == {"format": "pt"}
    prov = json.loads((tmp_path / "m" / "converter_provenance.json").read_text())
    import hashlib

    assert prov["base"]["files"][0]["sha256"] == hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()
    assert prov["adapters"][0]["coverage"]["unmatched"] == 0
    assert prov["adapters"][0]["settings"]["r"] == 4
    merge_and_compare(tmp_path / "again", cli, base, [adapter], extra=("--max-shard-size", "100KB"))


def test_dry_run_writes_nothing(llama, tmp_path, cli):
    adapter = make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    code, out, err = cli("merge", "--base", llama, "--adapter", adapter, "--out", tmp_path / "merged", "--dry-run")
    assert code == 0, err
    assert "4/4 tensors land on the base" in out
    assert "2 changed" in out and "bytes to write" in out
    assert not (tmp_path / "merged").exists()


def test_pickle_adapter_needs_permission(llama, tmp_path, cli):
    from safetensors.torch import load_file

    adapter = make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    f = adapter / "adapter_model.safetensors"
    torch.save(load_file(f), adapter / "adapter_model.bin")
    f.unlink()
    code, _, err = cli("merge", "--base", llama, "--adapter", adapter, "--out", tmp_path / "merged")
    assert code == 2 and "--allow-pickle" in err and not (tmp_path / "merged").exists()
    merge_and_compare(tmp_path, cli, llama, [adapter], extra=("--allow-pickle",))


def test_phi3_split_adapter_lands_on_fused_rows(tmp_path, cli):
    """An adapter trained with split q/k/v and gate/up names merges into Phi-3's fused projections (keymap data)."""
    from safetensors.torch import load_file

    phi = make_base(tmp_path / "phi", "phi3")
    llama = make_base(tmp_path / "llama", "llama", num_key_value_heads=2)
    adapter = make_adapter(
        llama,
        tmp_path / "lora",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
    )
    code, _, err = cli("merge", "--base", phi, "--adapter", adapter, "--out", tmp_path / "merged")
    assert code == 0, err
    lora, base, merged = (
        load_file(adapter / "adapter_model.safetensors"),
        read_tensors(phi),
        read_tensors(tmp_path / "merged"),
    )
    sizes = {"q": 64, "k": 32, "v": 32}
    start = 0
    for part in "qkv":
        p = f"base_model.model.model.layers.0.self_attn.{part}_proj"
        delta = 2 * lora[f"{p}.lora_B.weight"] @ lora[f"{p}.lora_A.weight"]
        w = base["model.layers.0.self_attn.qkv_proj.weight"][start : start + sizes[part]]
        torch.testing.assert_close(
            merged["model.layers.0.self_attn.qkv_proj.weight"][start : start + sizes[part]], w + delta
        )
        start += sizes[part]
    p = "base_model.model.model.layers.1.mlp.up_proj"
    up = (
        base["model.layers.1.mlp.gate_up_proj.weight"][128:]
        + 2 * lora[f"{p}.lora_B.weight"] @ lora[f"{p}.lora_A.weight"]
    )
    torch.testing.assert_close(merged["model.layers.1.mlp.gate_up_proj.weight"][128:], up)


def test_convert_peft_weights_without_config_needs_and_keeps_a_stated_alpha(llama, tmp_path, cli):
    """`convert` follows merge's rule for PEFT weights shared without adapter_config.json: refused unless
    --lora-alpha states the scale, which then travels as each kohya module's `.alpha` (ΔW unchanged)."""
    import shutil

    from safetensors.torch import load_file

    adapter = make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    (tmp_path / "bare").mkdir()
    shutil.copy(adapter / "adapter_model.safetensors", tmp_path / "bare" / "adapter_model.safetensors")
    out = tmp_path / "k.safetensors"
    code, _, err = cli("convert", "--adapter", tmp_path / "bare", "--to", "kohya", "--out", out)
    assert code == 2 and "adapter_config.json" in err and not out.exists(), err
    code, _, err = cli("convert", "--adapter", tmp_path / "bare", "--to", "kohya", "--out", out, "--lora-alpha", "8")
    assert code == 0, err
    kohya, peft = load_file(out), load_file(adapter / "adapter_model.safetensors")
    stem = "lora_unet_model_layers_0_self_attn_q_proj"
    assert float(kohya[f"{stem}.alpha"]) == 8.0
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    ours = kohya[f"{stem}.lora_up.weight"].float() @ kohya[f"{stem}.lora_down.weight"].float() * 8 / 4
    theirs = peft[f"{module}.lora_B.weight"] @ peft[f"{module}.lora_A.weight"] * 8 / 4
    torch.testing.assert_close(ours, theirs)
