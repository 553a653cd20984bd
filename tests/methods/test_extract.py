"""`converter extract`: the oracles are numpy's float64 SVD (each module's truncation and its reported error and
energy) and PEFT itself: the extracted adapter loaded through PEFT on the base must give the tuned model's logits,
within the float32 noise measured for PEFT's own unmerged-vs-merged forward plus what the reported error allows.
A diffusion base (UNet convs) goes through diffusers' own `load_lora_weights`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from model_helpers import load_merged, logits, make_adapter, make_base, reference_model, token_ids
from safetensors.torch import load_file, save_file

from converter.methods.extraction import extract_factors
from converter.methods.ranks import choose_rank

EPS32 = float(np.finfo(np.float32).eps)
NORM = "model.layers.0.input_layernorm"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """base; `merged` = base + a rank-6 LoRA (4 strong directions, 2 weak) merged by PEFT; `tuned` = merged with
    one norm changed too; and the float32 noise of PEFT's unmerged forward against its own merge."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("extract")
    base = make_base(root / "base")
    adapter = make_adapter(base, root / "lora", r=6, lora_alpha=12)
    lora = load_file(adapter / "adapter_model.safetensors")  # two weak directions: a rank-4 cut loses ~3 %
    for k, v in lora.items():
        if "lora_B" in k:
            v[:, 4:] *= 0.03
    save_file(lora, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    model.merge_and_unload().save_pretrained(root / "merged")
    shutil.copytree(root / "merged", root / "tuned")
    sd = load_file(root / "tuned" / "model.safetensors")
    sd[f"{NORM}.weight"] = sd[f"{NORM}.weight"] + 0.05
    save_file(sd, root / "tuned" / "model.safetensors", metadata={"format": "pt"})
    ids = token_ids()
    noise = float(
        (logits(reference_model(base, [adapter]), ids) - logits(load_merged(root / "merged"), ids)).abs().max()
    )
    return base, root / "tuned", noise


def _peft_logits(base, adapter, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    return logits(model.eval(), ids), model


@pytest.mark.parametrize("rank,rule", [(8, []), (4, []), (8, ["--rank-rule", "sv_fro", "--rank-param", "0.99999"])])
def test_extracted_adapter_through_peft_gives_the_tuned_logits(tuned, tmp_path, cli, rank, rule):
    base, tuned_dir, noise = tuned
    code, out, err = cli("extract", "--base", base, "--tuned", tuned_dir, "--rank", rank, *rule,
                         "--out", tmp_path / "x", "--report", tmp_path / "r.json")  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    config = json.loads((tmp_path / "x" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == [NORM] and "1 modules differ but have no low-rank form" in out
    assert len(report) == 14  # every linear layer of the 2-layer Llama (7 each)
    ids = token_ids()
    got, model = _peft_logits(base, tmp_path / "x", ids)
    want, bare = logits(load_merged(tuned_dir), ids), logits(load_merged(base), ids)
    worst = max(v["relative_error"] for v in report.values())
    effect = float((want - bare).abs().max())
    # the float32 noise of this path too: PEFT's unmerged forward of the extracted adapter against its own merge
    layers = {k.removeprefix("base_model.model."): m for k, m in model.named_modules() if hasattr(m, "lora_A")}
    deltas = {k: m.get_delta_weight("default").double() for k, m in layers.items() if "default" in m.lora_A}
    saved_norm = dict(model.named_modules())[f"base_model.model.{NORM}"].modules_to_save["default"].weight.clone()
    own = float((got - logits(model.merge_and_unload(), ids)).abs().max())
    diff = float((got - want).abs().max())
    # to first order each module's ΔW error moves the logits by at most its relative error times the effect of
    # the whole ΔW; the modules' shares add up
    total = sum(v["relative_error"] for v in report.values())
    assert diff <= 2 * (noise + own) + total * effect, (diff, total, noise, own)
    if rank == 4:  # truncated below the true rank 6: the error is real and reported as such
        assert worst > 1e-3 and all(v["rank"] == 4 for v in report.values()) and diff > 2 * (noise + own)
    else:  # the true rank is 6: nothing but rounding is lost, and sv_fro finds rank 6 by itself
        assert worst < 64 * EPS32
        assert all(v["rank"] == (6 if rule else 8) for v in report.values())
    # each module's reported error is what PEFT's own ΔW of the extracted adapter misses of tuned - base
    tuned_sd, base_sd = load_file(tuned_dir / "model.safetensors"), load_file(base / "model.safetensors")
    for key, facts in report.items():
        delta = tuned_sd[key].double() - base_sd[key].double()
        peft_delta = deltas[key.removesuffix(".weight")]
        measured = float(torch.linalg.norm(delta - peft_delta) / torch.linalg.norm(delta))
        assert abs(measured - facts["relative_error"]) <= 8 * EPS32, (key, measured, facts)
    assert torch.equal(saved_norm, tuned_sd[f"{NORM}.weight"])
    assert NORM not in deltas


@pytest.mark.parametrize("shape", [(48, 32), (20, 8, 3, 3)])
def test_module_factors_equal_numpy_float64_svd(shape):
    """The truncation, its error and its energy against numpy's float64 SVD, within float32's backward error."""
    g = torch.Generator().manual_seed(5)
    delta = torch.randn(shape, generator=g) * torch.logspace(0, -2, shape[1], dtype=torch.float32)[None, :, *(
        [None] * (len(shape) - 2))]  # fmt: skip
    mat = delta.reshape(shape[0], -1).double().numpy()
    u, s, vh = np.linalg.svd(mat, full_matrices=False)
    for rule, param in (("fixed", None), ("sv_ratio", 4.0), ("sv_fro", 0.9), ("sv_cumulative", 0.7)):
        down, up, facts = extract_factors(delta, 12, rule, param)
        r = facts["rank"]
        assert down.shape == (r, *shape[1:]) and up.shape == (shape[0], r, *([1] * (len(shape) - 2)))
        want = (u[:, :r] * s[:r]) @ vh[:r]
        got = (up.flatten(1).double() @ down.flatten(1).double()).numpy()
        gap = s[r - 1] - s[r]
        tol = np.sqrt(max(mat.shape)) * EPS32 * s[0] * (1 + 2 * s[0] / gap)
        assert np.linalg.norm(got - want) <= tol, (rule, r)
        error = np.sqrt((s[r:] ** 2).sum() / (s**2).sum())
        assert abs(facts["relative_error"] - error) <= tol / np.linalg.norm(mat), rule
        assert facts["retained_energy"] == pytest.approx((s[:r] ** 2).sum() / (s**2).sum(), abs=8 * EPS32)
        assert r == _numpy_rule(s, 12, rule, param)


def _numpy_rule(s, cap, rule, p) -> int:
    """The documented rules, spelt out in numpy: sd-scripts' resize_lora.py (without its len - 1 clamp) and a cap."""
    if rule == "fixed":
        keep = cap
    elif rule == "sv_ratio":
        keep = int((s > s[0] / p).sum())
    elif rule == "sv_fro":
        keep = int(np.argmax(np.cumsum(s**2) / (s**2).sum() >= p**2)) + 1
    else:
        keep = int(np.argmax(np.cumsum(s) / s.sum() >= p)) + 1
    return max(1, min(keep, cap, len(s)))


def test_sv_epsilon_is_mergekits_rule():
    s = torch.tensor([5.0, 2.0, 0.5, 0.1, 0.0])
    assert choose_rank(s, 8, "sv_epsilon", 0.0) == 4 and choose_rank(s, 8, "sv_epsilon", 0.5) == 2
    assert choose_rank(s, 3, "sv_epsilon", 0.0) == 3  # capped by --rank


def test_refusals_are_one_line_and_write_nothing(tuned, tmp_path, cli):
    base, tuned_dir, _ = tuned
    out = tmp_path / "x"
    code, _, err = cli("extract", "--base", base, "--tuned", tuned_dir, "--rank", "4", "--no-modules-to-save",
                       "--out", out)  # fmt: skip
    assert code == 2 and f"{NORM}.weight differs" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    code, _, err = cli("extract", "--base", base, "--tuned", tuned_dir, "--rank", "4", "--to", "kohya",
                       "--out", tmp_path / "k.safetensors")  # fmt: skip
    assert code == 2 and "use --to peft" in err and not (tmp_path / "k.safetensors").exists()
    code, _, err = cli("extract", "--base", base, "--tuned", tuned_dir, "--rank", "4", "--rank-rule", "sv_fro",
                       "--out", out)  # fmt: skip
    assert code == 2 and "needs --rank-param" in err
    code, _, err = cli("extract", "--base", base, "--tuned", base, "--rank", "4", "--out", out)
    assert code == 2 and "nothing to extract" in err and not out.exists()


def test_exclude_and_include(tuned, tmp_path, cli):
    """--exclude drops the norm and the MLP, --include keeps layer 1 only: no modules_to_save, fewer modules."""
    base, tuned_dir, _ = tuned
    code, _, err = cli("extract", "--base", base, "--tuned", tuned_dir, "--rank", "4", "--exclude", "norm",
                       "--exclude", r"\.mlp\.", "--include", r"layers\.1\.", "--out", tmp_path / "x")  # fmt: skip
    assert code == 0, err
    config = json.loads((tmp_path / "x" / "adapter_config.json").read_text())
    assert config["modules_to_save"] is None and config["r"] == config["lora_alpha"] == 4
    assert sorted(config["target_modules"]) == [f"model.layers.1.self_attn.{p}_proj" for p in "koqv"]


def test_unet_convs_through_diffusers_load_lora_weights(tmp_path, cli):
    """A tiny SD pipeline whose UNet got low-rank changes on a 3x3 conv, a 1x1 conv and an attention linear:
    the extracted diffusers file, loaded by diffusers itself, rebuilds the tuned UNet."""
    from convert_helpers import diffusers_load_lora_weights
    from diffusion_helpers import make_pipeline

    models = make_pipeline(tmp_path / "base")
    shutil.copytree(tmp_path / "base", tmp_path / "tuned")
    path = tmp_path / "tuned" / "unet" / "diffusion_pytorch_model.safetensors"
    sd = load_file(path)
    g = torch.Generator().manual_seed(9)
    changed = [k for k in sd if k.endswith("conv1.weight") and sd[k].dim() == 4][:1]
    changed += [k for k in sd if k.endswith("conv_shortcut.weight")][:1]
    changed += [k for k in sd if k.endswith("attn1.to_q.weight")][:1]
    assert len(changed) == 3
    for k in changed:
        w = sd[k]
        low = torch.randn(w.shape[0], 2, generator=g) @ torch.randn(2, w[0].numel(), generator=g)
        sd[k] = w + 0.01 * low.reshape(w.shape)
    save_file(sd, path, metadata={"format": "pt"})
    code, out, err = cli("extract", "--base", tmp_path / "base", "--tuned", tmp_path / "tuned", "--rank", "2",
                         "--to", "diffusers", "--out", tmp_path / "lora")  # fmt: skip
    assert code == 0, err
    merged = diffusers_load_lora_weights(models, tmp_path / "lora", "pytorch_lora_weights.safetensors")["unet"]
    base_sd = load_file(tmp_path / "base" / "unet" / "diffusion_pytorch_model.safetensors")
    for k, want in sd.items():
        got = merged[k]
        if k in changed:
            tol = 16 * EPS32 * float(want.abs().max())
            assert float((got - want).abs().max()) <= tol, k
            assert not torch.equal(got, base_sd[k])
        else:
            assert torch.equal(got, want), k


def test_gpt2_conv1d_is_refused_with_a_way_out(tmp_path, cli):
    make_base(tmp_path / "base", arch="gpt2")
    shutil.copytree(tmp_path / "base", tmp_path / "tuned")
    path = tmp_path / "tuned" / "model.safetensors"
    sd = load_file(path)
    for k in sd:
        if k.endswith(("c_attn.weight", "c_proj.weight")) or k == "lm_head.weight":
            sd[k] = sd[k] + 0.01
    save_file(sd, path, metadata={"format": "pt"})
    code, _, err = cli("extract", "--base", tmp_path / "base", "--tuned", tmp_path / "tuned", "--rank", "2",
                       "--out", tmp_path / "x")  # fmt: skip
    assert code == 2 and "stored transposed" in err and "--exclude" in err and not (tmp_path / "x").exists()


def test_changed_embedding_is_saved_whole_and_peft_reproduces_the_logits(tmp_path, cli):
    """An (untied) embedding that changed goes to modules_to_save; with an exact-rank q_proj change, PEFT on the
    base with the extracted adapter gives the tuned logits up to float32 noise (measured: PEFT's own merge)."""
    base = make_base(tmp_path / "base", tie_word_embeddings=False)
    shutil.copytree(base, tmp_path / "tuned")
    path = tmp_path / "tuned" / "model.safetensors"
    sd = load_file(path)
    g = torch.Generator().manual_seed(4)
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] + 0.05 * torch.randn(256, 64, generator=g)
    q = "model.layers.1.self_attn.q_proj.weight"
    sd[q] = sd[q] + 0.05 * torch.randn(64, 2, generator=g) @ torch.randn(2, 64, generator=g)
    save_file(sd, path, metadata={"format": "pt"})
    code, out, err = cli("extract", "--base", base, "--tuned", tmp_path / "tuned", "--rank", "2", "--out",
                         tmp_path / "x")  # fmt: skip
    assert code == 0, err
    config = json.loads((tmp_path / "x" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.embed_tokens"] and config["target_modules"] == [q[:-7]]
    ids = token_ids()
    got, model = _peft_logits(base, tmp_path / "x", ids)
    noise = float((got - logits(model.merge_and_unload(), ids)).abs().max())
    want = logits(load_merged(tmp_path / "tuned"), ids)
    assert float((got - want).abs().max()) <= 2 * noise + 64 * EPS32 * float(want.abs().max())
    assert float((logits(load_merged(base), ids) - want).abs().max()) > 1e-2  # the change is visible
