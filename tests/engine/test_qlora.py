"""QLoRA: merging onto the 4-bit-dequantized base reproduces the QLoRA setting (4-bit base + adapter in PEFT)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from model_helpers import (
    assert_proven,
    assert_round_trips,
    load_merged,
    logits,
    make_adapter,
    make_base,
    read_tensors,
    reference_model,
    shown,
    token_ids,
)


def qlora_reference(base, adapter, quant="nf4", double_quant=True):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, quantization_config=config)
    return PeftModel.from_pretrained(model, adapter).eval()


def test_dequantized_base_matches_the_qlora_setting(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama", hidden_size=128, intermediate_size=256)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8)
    run = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "deq", "--qlora-base", "dequantized",
              verify=True)  # fmt: skip
    assert_proven(run)  # against the 4-bit reference
    assert "nf4 4-bit base" in run[1]
    assert cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "orig")[0] == 0
    ids = token_ids()
    qlora = logits(qlora_reference(base, adapter), ids)
    full = logits(reference_model(base, [adapter]), ids)
    deq, orig = logits(load_merged(tmp_path / "deq"), ids), logits(load_merged(tmp_path / "orig"), ids)
    # bitsandbytes' CPU 4-bit matmul is itself ~4e-3 off a float32 matmul (measured on one layer), so the QLoRA
    # reference is matched to that precision, and far closer than the merge onto the original weights.
    assert (deq - qlora).abs().max() < 0.05
    assert (orig - qlora).abs().max() > 5 * (deq - qlora).abs().max()
    torch.testing.assert_close(orig, full, atol=2e-5, rtol=1e-5)  # the default: the original weights
    provenance = json.loads((tmp_path / "deq" / "converter_provenance.json").read_text())
    assert "NF4 4-bit quantization" in provenance["precision"]
    assert "NF4 4-bit quantization" in (tmp_path / "deq" / "README.md").read_text()


def test_fp4_without_double_quant(tmp_path, cli):
    base = make_base(tmp_path / "base", "qwen2", hidden_size=128, intermediate_size=256)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8)
    code, out, err = cli(
        "merge",
        "--base",
        base,
        "--adapter",
        adapter,
        "--out",
        tmp_path / "m",
        "--qlora-base",
        "dequantized",
        "--qlora-quant",
        "fp4",
        "--no-double-quant",
        verify=True,
    )
    assert code == 0, out + err
    ids = token_ids()
    expected = logits(qlora_reference(base, adapter, "fp4", False), ids)
    assert (logits(load_merged(tmp_path / "m"), ids) - expected).abs().max() < 0.05
    assert (
        "FP4 4-bit quantization (block size 64, double quantization off)" in (tmp_path / "m" / "README.md").read_text()
    )


def test_qlora_adapters_are_recognised(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama")
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    (adapter / "README.md").write_text("Trained with QLoRA: bitsandbytes 4-bit NF4, double quantization.\n")
    code, out, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m")
    assert code == 0 and "looks like a QLoRA adapter" in out and "--qlora-base dequantized" in out
    # No card, but the base it declares is a bitsandbytes 4-bit repo (by name, or by its local config).
    (adapter / "README.md").unlink()
    config = json.loads((adapter / "adapter_config.json").read_text())
    for declared in ("unsloth/llama-3-8b-bnb-4bit", str(quantize_with_transformers(base, tmp_path / "four"))):
        config["base_model_name_or_path"] = declared
        (adapter / "adapter_config.json").write_text(json.dumps(config))
        code, out, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", "--force")
        assert code == 0 and "looks like a QLoRA adapter" in out, declared
    config["base_model_name_or_path"] = str(base)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    code, out, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", "--force")
    assert code == 0 and "QLoRA" not in out, out


def quantize_with_transformers(folder: Path, out: Path, quant: str = "nf4", double_quant: bool = True) -> Path:
    """transformers' own load_in_4bit + save_pretrained: the serialization our 4-bit output must reproduce."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=config).save_pretrained(out)
    return out


@pytest.mark.parametrize("quant", ["nf4", "fp4"])
def test_4bit_output_is_transformers_serialization(tmp_path, cli, quant):
    base = make_base(tmp_path / "base", "llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8)
    code, out, err = cli(
        "merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "q", "--dtype", f"bnb-{quant}"
    )
    assert code == 0, out + err
    assert cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "full")[0] == 0
    expected = read_tensors(quantize_with_transformers(tmp_path / "full", tmp_path / "tq", quant))
    ours = read_tensors(tmp_path / "q")
    assert set(ours) == set(expected)
    blob = f"quant_state.bitsandbytes__{quant}"
    for name, t in expected.items():
        if name.endswith(blob):  # JSON, padded with spaces to a size known before the value
            assert json.loads(bytes(ours[name].tolist())) == json.loads(bytes(t.tolist())), name
        else:
            assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["bnb_4bit_quant_type"] == quant and config["load_in_4bit"]
    # Loads with no arguments, as a 4-bit model, and computes what transformers' own 4-bit model computes.
    ids = token_ids()
    model = load_merged(tmp_path / "q", torch.bfloat16)
    assert model.model.layers[0].self_attn.q_proj.__class__.__name__ == "Linear4bit"
    assert torch.equal(logits(model, ids), logits(load_merged(tmp_path / "tq", torch.bfloat16), ids))


def test_4bit_output_refused_for_conv1d_layouts(tmp_path, cli):
    base = make_base(tmp_path / "base", "gpt2")
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, fan_in_fan_out=True)
    code, out, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "q", "--dtype", "bnb-nf4")
    assert code == 2 and "Conv1D" in err and not (tmp_path / "q").exists()


def test_prequantized_base_is_dequantized_for_merging(tmp_path, cli):
    full = make_base(tmp_path / "full", "llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    adapter = make_adapter(full, tmp_path / "lora", r=4, lora_alpha=8)
    base = quantize_with_transformers(full, tmp_path / "base-bnb-4bit")
    (base / "README.md").write_text("---\nbase_model: org/full-precision\n---\n4-bit\n")
    run = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", verify=True)
    assert_proven(run)  # against PEFT on the 4-bit base itself, the QLoRA setting
    assert "NF4 4-bit checkpoint: dequantizing" in run[1] and "probably org/full-precision" in run[1]
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "quantization_config" not in config
    # The oracle: PEFT's unmerged forward on the 4-bit model transformers loads from that repo.
    ids = token_ids()
    merged = logits(load_merged(tmp_path / "m"), ids)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    qlora = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    assert (merged - logits(qlora.eval(), ids)).abs().max() < 0.05
    provenance = json.loads((tmp_path / "m" / "converter_provenance.json").read_text())
    assert [f["name"] for f in provenance["base"]["files"]] == ["model.safetensors"]
    assert (
        provenance["base"]["files"][0]["sha256"]
        == hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()
    )


def test_other_prequantized_bases_are_refused(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama")
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (base / "config.json").write_text(json.dumps(config))
    code, out, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "q")
    assert code == 2 and "pre-quantized (gptq) base cannot be dequantized" in err and not (tmp_path / "q").exists()


def kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    lr, lo = ref.double().log_softmax(-1), other.double().log_softmax(-1)
    return (lr.exp() * (lr - lo)).sum(-1).mean().item()


@pytest.mark.parametrize("mode", ["original", "dequantized"])
def test_verification_measures_both_merge_bases_for_qlora_adapters(tmp_path, cli, mode):
    base = make_base(tmp_path / "base", "llama", hidden_size=128, intermediate_size=256)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8)
    args = ["merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", "--qlora", "--qlora-base", mode]
    code, out, err = cli(*args, verify=True)
    assert code == 0, out + err
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert assert_round_trips(tmp_path / "m").behaviour.qlora.closer in ("original", "dequantized")  # typed
    q = report["qlora"]
    assert (
        q["modes"][mode]["this_merge"]
        and not q["modes"][{"original": "dequantized"}.get(mode, "original")]["this_merge"]
    )
    # Recomputed independently on other inputs: the QLoRA reference through PEFT, both merges loaded as users do.
    other = tmp_path / "other"
    flip = "dequantized" if mode == "original" else "original"
    assert cli("merge", "--base", base, "--adapter", adapter, "--out", other, "--qlora-base", flip)[0] == 0
    ids = token_ids()
    qlora = logits(qlora_reference(base, adapter), ids)
    measured = {
        mode: kl(qlora, logits(load_merged(tmp_path / "m"), ids)),
        flip: kl(qlora, logits(load_merged(other), ids)),
    }
    assert q["closer"] == min(measured, key=measured.get) == "dequantized"
    kls = {m: q["modes"][m]["vs_qlora_reference"]["mean_kl"] for m in ("original", "dequantized")}
    assert q["kl_ratio"] == pytest.approx(kls["original"] / kls["dequantized"])
    assert q["dequantized_perplexity_change"] == pytest.approx(
        q["modes"]["dequantized"]["perplexity"] / q["modes"]["original"]["perplexity"] - 1
    )
    assert "Closer to the 4-bit reference: **dequantized**" in (tmp_path / "m" / "README.md").read_text()


def test_plain_adapters_get_no_qlora_study(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama")
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    assert cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", verify=True)[0] == 0
    assert json.loads((tmp_path / "m" / "verification.json").read_text())["qlora"] is None


def test_4bit_output_is_verified_and_a_4bit_base_is_caught(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    adapter = make_adapter(base, tmp_path / "lora", r=8, lora_alpha=32)
    assert_proven(cli(
        "merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "q", "--dtype", "bnb-nf4", verify=True
    ), proofs=1)  # (its behaviour: packed 4-bit weights are not compared tensor by tensor)  # fmt: skip
    report = json.loads((tmp_path / "q" / "verification.json").read_text())
    assert report["output_dtype"] == "NF4" and "quantized to NF4 by transformers" in report["reference"]
    # Sabotage: the bare base quantized (the adapter "merged" as nothing) must fail against base + adapter.
    noop = quantize_with_transformers(base, tmp_path / "noop")
    for name in ("converter_recipe.yaml", "converter_provenance.json"):
        (noop / name).write_bytes((tmp_path / "q" / name).read_bytes())
    code, out, err = cli("verify", noop)
    assert code == 3 and "as far from the reference as the bare base" in out + err


def test_dequantized_merge_threshold_is_the_references_measured_noise(tmp_path, cli):
    """A right --qlora-base dequantized merge passes against the 4-bit reference whatever its kernels' noise (the
    threshold is that noise, measured), and wrong merges fail by orders of magnitude."""
    import shutil

    from safetensors.torch import load_file, save_file

    from converter.verification import NOISE_MARGIN, tolerance

    base = make_base(tmp_path / "base", "llama", hidden_size=128, intermediate_size=256)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8)
    args = ["merge", "--base", base, "--adapter", adapter, "--qlora-base", "dequantized", "--max-new-tokens", "2"]
    code, out, err = cli(*args, "--out", tmp_path / "right", verify=True)
    assert code == 0, out + err
    report = json.loads((tmp_path / "right" / "verification.json").read_text())
    tol, noise = report["tolerance"], report["tolerance"]["kernel_noise_mean_kl"]
    # bitsandbytes computes in bfloat16 only where the CPU has bf16 instructions; elsewhere its kernels are exact
    # and the measured noise is 0 (the threshold is then rounding alone)
    assert report["verdict"] == "pass" and noise >= 0
    assert tol["mean_kl"] == pytest.approx(tolerance("F32", "F32")["mean_kl"] + NOISE_MARGIN * noise)
    right = report["merged_vs_reference"]["mean_kl"]
    assert right <= tol["mean_kl"] and "4-bit kernels, measured" in shown(report)
    # Wrong: merged onto the original weights (dequantization forgotten), and one tensor off.
    assert cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "orig")[0] == 0
    wrong = {}
    for kind in ("forgot_dequantize", "perturbed"):
        folder = tmp_path / kind
        shutil.copytree(tmp_path / "right", folder)
        if kind == "forgot_dequantize":
            shutil.copyfile(tmp_path / "orig" / "model.safetensors", folder / "model.safetensors")
        else:
            tensors = load_file(folder / "model.safetensors")
            tensors["model.layers.1.mlp.up_proj.weight"] += 0.2
            save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        code, out, err = cli("verify", folder, "--max-new-tokens", "2")
        assert code == 3 and "4-bit round trip" not in err, out + err  # the tensor proof fails it first ...
        code, out, err = cli("verify", folder, "--max-new-tokens", "2", "--proof", "behaviour")  # ... and so does this
        assert code == 3, out + err
        wrong[kind] = json.loads((folder / "verification.json").read_text())["merged_vs_reference"]["mean_kl"]
    print(f"QLoRA margins: right {right:.3g}, threshold {tol['mean_kl']:.3g} (noise {noise:.3g}), wrong {wrong}")
    assert min(wrong.values()) > 100 * tol["mean_kl"]
    assert "model.layers.1.mlp.up_proj" in err  # the perturbed module is named, past the kernels' own noise
