"""`converter resize`: each module's ΔW truncated as numpy's float64 SVD truncates it (rank by the chosen rule),
alphas rescaled like sd-scripts' resize_lora.py (alpha / rank unchanged), the reported error the true one. PEFT
reads the resized PEFT adapter; converter's own patch math (tested against diffusers elsewhere) the kohya files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from model_helpers import make_adapter, make_base
from safetensors.torch import load_file

EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("resize")
    base = make_base(root / "base")
    return base, make_adapter(base, root / "lora", r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"])


def _peft_deltas(base, adapter) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64), adapter)
    return {k.removeprefix("base_model.model."): m.get_delta_weight("default").double()
            for k, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}  # fmt: skip


def _truncate(delta: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    u, s, vh = np.linalg.svd(delta, full_matrices=False)
    return (u[:, :r] * s[:r]) @ vh[:r], s


@pytest.mark.parametrize("args", [["--rank", "3"], ["--rank", "6", "--rank-rule", "sv_fro", "--rank-param", "0.8"]])
def test_resized_peft_adapter_is_numpys_truncation(llm, tmp_path, cli, args):
    base, adapter = llm
    code, out, err = cli("resize", "--adapter", adapter, *args, "--out", tmp_path / "x",
                         "--report", tmp_path / "r.json")  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    config = json.loads((tmp_path / "x" / "adapter_config.json").read_text())
    before, after = _peft_deltas(base, adapter), _peft_deltas(base, tmp_path / "x")
    assert before.keys() == after.keys() == report.keys() and len(before) == 4
    for name, facts in report.items():
        want_full = before[name].numpy()
        r = facts["rank"]
        want, s = _truncate(want_full, r)
        if "--rank-rule" in args:  # sv_fro 0.8: the fewest singular values with ΣS² >= 0.64 of the total
            assert r == min(6, int(np.argmax(np.cumsum(s**2) / (s**2).sum() >= 0.64)) + 1)
        else:
            assert r == 3
        got = after[name].numpy()
        gap = s[r - 1] - s[r]
        tol = np.sqrt(max(got.shape)) * EPS32 * s[0] * (1 + 2 * s[0] / gap)
        assert np.linalg.norm(got - want) <= tol, name
        error = np.linalg.norm(want_full - got) / np.linalg.norm(want_full)
        assert abs(error - facts["relative_error"]) <= tol / np.linalg.norm(want_full), name
        # kohya's alpha rule: alpha / rank stays 16 / 8
        rank = config["rank_pattern"].get(name, config["r"])
        alpha = config["alpha_pattern"].get(name, config["lora_alpha"])
        assert rank == r and alpha / rank == pytest.approx(2.0)
    assert "relative error" in out


def test_kohya_lora_and_locon_resized_to_kohya(tmp_path, cli):
    """A kohya file with 3x3 conv modules, resized without a base (its flattened names are kept as they are)."""
    from convert_helpers import deltas
    from diffusion_helpers import UNET_TARGETS, kohya_lora, kohya_modules, make_pipeline, save

    models = make_pipeline(tmp_path / "base")
    lora = kohya_lora(kohya_modules(models["unet"], "lora_unet", UNET_TARGETS, convs=True), rank=4, conv_rank=4)
    src = save(lora, tmp_path / "lora.safetensors")
    code, _, err = cli("resize", "--adapter", src, "--rank", "2", "--to", "kohya", "--out", tmp_path / "k.safetensors")
    assert code == 0, err
    out = load_file(tmp_path / "k.safetensors")
    assert out.keys() == lora.keys()
    for k in lora:
        if k.endswith(".alpha"):
            assert float(out[k]) == pytest.approx(float(lora[k]) / 4 * 2)
        elif k.endswith("lora_down.weight"):
            assert out[k].shape == (2, *lora[k].shape[1:])
    original, resized = deltas(src, tmp_path / "base"), deltas(tmp_path / "k.safetensors", tmp_path / "base")
    assert original.keys() == resized.keys() and any(v.dim() == 4 and v.shape[-1] == 3 for v in original.values())
    for key, delta in original.items():
        mat = delta.double().reshape(delta.shape[0], -1).numpy()
        want, s = _truncate(mat, 2)
        got = resized[key].double().reshape(mat.shape).numpy()
        tol = np.sqrt(max(mat.shape)) * EPS32 * s[0] * (1 + 2 * s[0] / (s[1] - s[2]))
        assert np.linalg.norm(got - want) <= tol, key


def test_modules_at_or_below_the_new_rank_are_copied(llm, tmp_path, cli):
    base, adapter = llm
    code, out, err = cli("resize", "--adapter", adapter, "--rank", "8", "--out", tmp_path / "x")
    assert code == 0, err
    src, dst = load_file(adapter / "adapter_model.safetensors"), load_file(tmp_path / "x" / "adapter_model.safetensors")
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)
    code, _, err = cli("resize", "--adapter", adapter, "--rank", "0", "--out", tmp_path / "y")
    assert code == 2 and "positive rank" in err and not (tmp_path / "y").exists()
    code, _, err = cli("resize", "--adapter", adapter, "--rank", "4", "--rank-rule", "sv_ratio", "--rank-param",
                       "0.5", "--out", tmp_path / "y")  # fmt: skip
    assert code == 2 and "at least 1" in err and not (tmp_path / "y").exists()
