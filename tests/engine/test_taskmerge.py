"""`converter merge --method ties|dare|dare_ties|magnitude_prune`: each merged tensor must be base + the ΔW that
PEFT's own `add_weighted_adapter` builds with the same method on the full deltas (`<method>_svd` at full rank, so
its SVD truncates nothing), within float32 rounding. DARE: PEFT is handed our masks (see test_combine.py)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import make_adapter, make_base, read_tensors

from converter.engine.ties_dare import dare_mask

EPS32 = torch.finfo(torch.float32).eps
PEFT_METHOD = {"ties": "ties_svd", "dare": "dare_linear_svd", "dare_ties": "dare_ties_svd",
               "magnitude_prune": "magnitude_prune_svd"}  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("taskmerge")
    base = make_base(root / "base")
    a = make_adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    b = make_adapter(base, root / "b", seed=2, r=2, lora_alpha=2, target_modules=["q_proj", "o_proj"])
    return base, a, b


@pytest.mark.parametrize("method", ["ties", "magnitude_prune", "dare", "dare_ties"])
def test_merged_tensors_are_base_plus_peft_add_weighted_adapter(pair, tmp_path, cli, monkeypatch, method):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, a, b = pair
    code, _, err = cli("merge", "--base", base, "--adapter", a, "--adapter", b, "--weight", "0.7", "--weight", "-0.5",
                       "--method", method, "--density", "0.4", "--seed", "3", "--out", tmp_path / "m")  # fmt: skip
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    model = PeftModel.from_pretrained(model, a, adapter_name="a0")
    model.load_adapter(b, adapter_name="a1")
    layers = {k.removeprefix("base_model.model."): m for k, m in model.named_modules() if hasattr(m, "lora_A")}
    queue = []
    if method.startswith("dare"):  # PEFT's draw order: modules in model order, one ΔW mask per adapter there
        for key, layer in layers.items():
            for i, n in enumerate(["a0", "a1"]):
                if n in layer.lora_A:
                    queue.append(dare_mask(tuple(layer.weight.shape), 0.4, 3, f"{key}.weight", "delta", i))

        def bernoulli(p, *args, **kwargs):
            return queue.pop(0).to(p.dtype)

        monkeypatch.setattr(torch, "bernoulli", bernoulli)
    model.add_weighted_adapter(
        ["a0", "a1"], [0.7, -0.5], "t", combination_type=PEFT_METHOD[method], density=0.4, svd_rank=64
    )  # every targeted matrix has min(out, in) = 64: the SVD truncates nothing
    monkeypatch.undo()
    assert not queue
    merged, original = read_tensors(tmp_path / "m"), read_tensors(base)
    changed = 0
    for key, w in original.items():
        module = key.removesuffix(".weight")
        if module not in layers or "t" not in layers[module].lora_A:
            assert torch.equal(merged[key], w), key  # untouched tensors are copied
            continue
        layer = layers[module]
        want = w.double() + layer.get_delta_weight("t").double()
        bound = sum(abs(wt * layer.scaling[n]) * (layer.lora_B[n].weight.abs() @ layer.lora_A[n].weight.abs())
                    for n, wt in (("a0", 0.7), ("a1", -0.5)) if n in layer.lora_A)  # fmt: skip
        rank = sum(layer.lora_A[n].weight.shape[0] for n in ("a0", "a1") if n in layer.lora_A)
        tol = EPS32 * want.abs() + (rank + 4) * EPS32 * bound / 0.4  # DARE divides by the density
        assert float(((merged[key].double() - want).abs() - tol).max()) <= 0, key
        assert not torch.equal(merged[key], w)
        changed += 1
    assert changed == 6  # q_proj (both adapters), down_proj (a), o_proj (b), in 2 layers


def test_bad_method_options_fail_before_anything_is_read(pair, tmp_path, cli):
    base, a, b = pair
    code, _, err = cli("merge", "--base", base, "--adapter", a, "--method", "ties", "--out", tmp_path / "m")
    assert code == 2 and "needs --density" in err and not (tmp_path / "m").exists()
    code, _, err = cli("merge", "--base", base, "--adapter", a, "--density", "0.5", "--out", tmp_path / "m")
    assert code == 2 and "--density applies to --method" in err


def test_ties_merge_is_verified_by_its_tensors(pair, tmp_path, cli):
    """A TIES merge is not meant to equal PEFT's unmerged sum: its tensors are proven against PEFT's own TIES rule
    (tests/verification/test_verify_tensors.py has the sabotages) and its behaviour is not compared, which the card
    says."""
    base, a, b = pair
    code, out, err = cli("merge", "--base", base, "--adapter", a, "--adapter", b, "--method", "ties", "--density",
                         "0.5", "--out", tmp_path / "m", verify=True)  # fmt: skip
    assert code == 0, err
    assert "every tensor within rounding of base + ΔW (referee: PEFT)" in out and "no unmerged PEFT forward" in out
    code, out, err = cli("verify", tmp_path / "m")
    assert code == 0, err
