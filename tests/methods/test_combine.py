"""`converter combine`: PEFT's own `add_weighted_adapter` is the oracle. Same adapters, same weights, same method:
the ΔW PEFT builds for its combined adapter must be the ΔW of our output loaded back through PEFT, within the
rounding of our float32 math (PEFT runs in float64 here). DARE's masks are random: PEFT draws them from torch's
global generator, we from a per-module seeded one, so for DARE PEFT is handed our masks and must then agree; the
masks themselves are checked for what DARE means (density, reproducible by seed, independent of module order)."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import make_adapter, make_base
from safetensors.torch import load_file

from converter.engine.ties_dare import dare_mask

EPS32 = torch.finfo(torch.float32).eps
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    root = tmp_path_factory.mktemp("combine")
    base = make_base(root / "base")
    a = make_adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=TARGETS)
    b = make_adapter(base, root / "b", seed=2, r=4, lora_alpha=2, target_modules=TARGETS)
    c = make_adapter(base, root / "c", seed=3, r=6, lora_alpha=6, target_modules=["q_proj", "o_proj"])
    return base, a, b, c


def _peft(base, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    model = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:], 1):
        model.load_adapter(path, adapter_name=f"a{i}")
    return model


def _lora_layers(model, name):
    return {k.removeprefix("base_model.model."): m for k, m in model.named_modules()
            if hasattr(m, "lora_A") and name in m.lora_A}  # fmt: skip


def _delta(layer, name) -> torch.Tensor:
    return layer.get_delta_weight(name).detach().double()


def _bound(layer, names, weights) -> torch.Tensor:
    """Elementwise rounding bound of a float32 ΔW built from these factors: (terms + 4) · eps32 · Σ|w·s|·|B|@|A|."""
    total = 0.0
    terms = 0
    for n, w in zip(names, weights, strict=True):
        if n in layer.lora_A:
            a, b = layer.lora_A[n].weight.double(), layer.lora_B[n].weight.double()
            total = total + abs(w * layer.scaling[n]) * (b.abs() @ a.abs())
            terms += a.shape[0]
    return (terms + 4) * EPS32 * total


def _compare(peft_model, ours_dir, names, weights, combined="combined", svd_inputs=None):
    """Every module PEFT combined must carry our ΔW (loaded through PEFT itself) within the rounding bound.
    `svd_inputs`: the matrices PEFT's SVD truncated, in module order (svd methods)."""
    peft_model.load_adapter(ours_dir, adapter_name="ours")
    theirs, ours = _lora_layers(peft_model, combined), _lora_layers(peft_model, "ours")
    assert theirs.keys() == ours.keys() and theirs
    if svd_inputs is not None:
        assert len(svd_inputs) == len(theirs)
    for n, (key, layer) in enumerate(theirs.items()):
        expected, got = _delta(layer, combined), _delta(ours[key], "ours")
        if svd_inputs is not None:  # a truncated SVD moves by at most ~ (1 + 2σ₁/gap) times the input's error
            s = torch.linalg.svdvals(svd_inputs[n])
            rank = ours[key].lora_A["ours"].weight.shape[0]
            gap = float(s[rank - 1] - s[rank]) if rank < s.numel() else float(s[0])
            # ours: float32 ΔW (its rounding bound) and, for the pruned methods, a float32 SVD (backward error)
            noise = float(torch.linalg.norm(_bound(layer, names, weights))) + max(
                s.shape[0], 64
            ) ** 0.5 * EPS32 * float(s[0])
            tol = noise * (1 + 2 * float(s[0]) / gap) + 8 * EPS32 * float(torch.linalg.norm(expected))
            assert float(torch.linalg.norm(got - expected)) <= tol, key
        else:
            bound = _bound(layer, names, weights) + 4 * EPS32 * expected.abs()
            excess = (got - expected).abs() - bound
            assert float(excess.max()) <= 0, (key, float((got - expected).abs().max()))
        assert float(expected.abs().max()) > 0


def _recording_svd(monkeypatch) -> list[torch.Tensor]:
    """Record what PEFT hands torch.linalg.svd (its full combined ΔW per module, before truncation)."""
    seen: list[torch.Tensor] = []
    svd = torch.linalg.svd

    def record(a, *args, **kwargs):
        seen.append(a.detach().clone())
        return svd(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", record)
    return seen


@pytest.mark.parametrize(
    "method,extra",
    [
        ("cat", []),
        ("linear", []),
        ("svd", []),
        ("ties", ["--density", "0.5"]),
        ("ties", ["--density", "0.3", "--majority-sign", "frequency"]),
        ("magnitude_prune", ["--density", "0.4"]),
        ("ties_svd", ["--density", "0.5"]),
        ("magnitude_prune_svd", ["--density", "0.7"]),
    ],
)
def test_deterministic_methods_equal_peft_add_weighted_adapter(trio, tmp_path, cli, monkeypatch, method, extra):
    base, a, b, _ = trio
    weights = [0.7, -0.4]
    code, out, err = cli("combine", "--adapter", a, "--adapter", b, "--weight", "0.7", "--weight", "-0.4",
                         "--method", method, *extra, "--out", tmp_path / "out")  # fmt: skip
    assert code == 0, err
    model = _peft(base, [a, b])
    density = float(extra[1]) if extra else None
    sign = extra[3] if len(extra) > 2 else "total"
    seen = _recording_svd(monkeypatch)
    model.add_weighted_adapter(["a0", "a1"], weights, "combined", combination_type=method, density=density,
                               majority_sign_method=sign)  # fmt: skip
    monkeypatch.undo()
    _compare(model, tmp_path / "out", ["a0", "a1"], weights, svd_inputs=seen if method.endswith("svd") else None)


def test_cat_is_the_exact_weighted_sum_with_different_ranks_and_modules(trio, tmp_path, cli):
    """cat over adapters of different ranks and target sets: ΔW = Σ wᵢ ΔWᵢ on every module either has."""
    base, a, _, c = trio
    code, _, err = cli("combine", "--adapter", a, "--adapter", c, "--weight", "1.5", "--weight", "0.5",
                       "--method", "cat", "--out", tmp_path / "out")  # fmt: skip
    assert code == 0, err
    model = _peft(base, [a, c])
    model.add_weighted_adapter(["a0", "a1"], [1.5, 0.5], "combined", combination_type="cat")
    _compare(model, tmp_path / "out", ["a0", "a1"], [1.5, 0.5])
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["rank_pattern"]  # q_proj has rank 4 + 6, the others 4 or 6: not all one rank


def _dare_queue(layers, names, density, seed, svd):
    """Our masks in the order PEFT draws them: modules in model order, A for each adapter then B (or ΔW)."""
    queue = []
    for key, layer in layers.items():
        for side in ["delta"] if svd else ["A", "B"]:
            for i, n in enumerate(names):
                if n in layer.lora_A:
                    shape = tuple(_delta(layer, n).shape) if svd else tuple(
                        (layer.lora_A if side == "A" else layer.lora_B)[n].weight.shape)  # fmt: skip
                    queue.append(dare_mask(shape, density, seed, None, key, side, i))
    return queue


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties", "dare_linear_svd", "dare_ties_svd"])
def test_dare_equals_peft_given_the_same_masks(trio, tmp_path, cli, monkeypatch, method):
    base, a, b, _ = trio
    weights = [0.8, 0.6]
    code, _, err = cli("combine", "--adapter", a, "--adapter", b, "--weight", "0.8", "--weight", "0.6",
                       "--method", method, "--density", "0.6", "--seed", "5", "--out", tmp_path / "out")  # fmt: skip
    assert code == 0, err
    model = _peft(base, [a, b])
    queue = _dare_queue(_lora_layers(model, "a0") | _lora_layers(model, "a1"), ["a0", "a1"], 0.6, 5,
                        method.endswith("svd"))  # fmt: skip

    def bernoulli(p, *args, **kwargs):
        mask = queue.pop(0)
        assert mask.shape == p.shape and float(p.flatten()[0]) == pytest.approx(0.6)
        return mask.to(p.dtype)

    monkeypatch.setattr(torch, "bernoulli", bernoulli)
    seen = _recording_svd(monkeypatch)
    model.add_weighted_adapter(["a0", "a1"], weights, "combined", combination_type=method, density=0.6)
    monkeypatch.undo()
    assert not queue  # PEFT drew exactly as many masks as we made, of the same shapes
    _compare(model, tmp_path / "out", ["a0", "a1"], weights, svd_inputs=seen if method.endswith("svd") else None)


def test_dare_masks_are_seeded_per_module_and_keep_the_density():
    m = dare_mask((200, 300), 0.3, 7, None, "model.layers.0.mlp.down_proj", "A", 0)
    assert set(m.unique().tolist()) == {0.0, 1.0}
    kept = float(m.mean())
    assert abs(kept - 0.3) < 4 * (0.3 * 0.7 / m.numel()) ** 0.5  # within 4 standard deviations of a Bernoulli(0.3)
    assert torch.equal(m, dare_mask((200, 300), 0.3, 7, None, "model.layers.0.mlp.down_proj", "A", 0))
    assert not torch.equal(m, dare_mask((200, 300), 0.3, 8, None, "model.layers.0.mlp.down_proj", "A", 0))
    assert not torch.equal(m, dare_mask((200, 300), 0.3, 7, None, "model.layers.1.mlp.down_proj", "A", 0))
    assert not torch.equal(m, dare_mask((200, 300), 0.3, 7, None, "model.layers.0.mlp.down_proj", "A", 1))


def test_dare_rescales_survivors_and_reproduces_by_seed(trio, tmp_path, cli):
    """One adapter kept with DARE density d: every value is 0 or value/d (PEFT switches one adapter to linear, so
    this goes through combine_module directly); the same seed gives the same file, another seed another."""
    from converter.conversion.modules import LoraModule
    from converter.methods.combination import combine_module

    g = torch.Generator().manual_seed(0)
    m = LoraModule(None, "x", torch.randn(4, 16, generator=g), torch.randn(8, 4, generator=g), 4.0, "x")
    down, up, _ = combine_module([(0, 1.0, m), (1, 0.0, m)], "dare_linear", rank=4, density=0.5, seed=3)
    nz = down != 0
    torch.testing.assert_close(down[nz], m.down[nz] / 0.5, rtol=EPS32 * 4, atol=0)
    assert 0 < int(nz.sum()) < down.numel()
    _, a, b, _ = trio
    runs = []
    for seed in ("1", "1", "2"):
        out = tmp_path / f"s{len(runs)}"
        code, _, err = cli("combine", "--adapter", a, "--adapter", b, "--method", "dare_ties", "--density", "0.5",
                           "--seed", seed, "--out", out)  # fmt: skip
        assert code == 0, err
        runs.append(load_file(out / "adapter_model.safetensors"))
    same = lambda x, y: x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)  # noqa: E731
    assert same(runs[0], runs[1]) and not same(runs[0], runs[2])


def test_bad_combinations_are_one_line_errors(trio, tmp_path, cli):
    _, a, _, c = trio
    code, _, err = cli("combine", "--adapter", a, "--adapter", c, "--method", "linear", "--out", tmp_path / "o")
    assert code == 2 and "ranks [4, 6] differ" in err and "use cat or svd" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()
    code, _, err = cli("combine", "--adapter", a, "--adapter", c, "--method", "ties", "--out", tmp_path / "o")
    assert code == 2 and "needs --density" in err
    code, _, err = cli("combine", "--adapter", a, "--adapter", c, "--weight", "1", "--out", tmp_path / "o")
    assert code == 2 and "1 --weight for 2 --adapter" in err
    code, _, err = cli("combine", "--adapter", a, "--adapter", c, "--method", "cat", "--rank", "3",
                       "--out", tmp_path / "o")  # fmt: skip
    assert code == 2 and "svd methods only" in err
    assert not (tmp_path / "o").exists()


def test_python_api_names_the_functions(trio, tmp_path):
    """`from converter.methods import combine` is the function even after its module was imported."""
    import converter.methods.combination  # noqa: F401
    from converter.methods import combine, extract, resize
    from converter.methods.options import CombineOptions

    assert all(callable(f) and f.__module__.startswith("converter.methods.") for f in (combine, extract, resize))
    _, a, b, _ = trio
    result = combine([str(a), str(b)], tmp_path / "o", CombineOptions(weights=(1.0, 0.5)), log=lambda m: None)
    assert result.modules == 6 and (tmp_path / "o" / "adapter_model.safetensors").is_file()


def test_building_the_parser_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, converter.cli.commands as c; c.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
