"""LyCORIS algorithms (LoHa, LoKr, full, Tucker LoCon, DoRA) and the malformed-file / detection paths of every
community format.

diffusers cannot load LoHa/LoKr/full and drops `dora_scale`, so the references here are the published formulas
(docs/FORMATS.md §3 and §6), computed in float64 with plain tensor algebra.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusion_helpers import make_pipeline, read_component, save

Q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"  # linear (16 -> 16)
CONV = "down_blocks.1.resnets.0.conv1"  # 3x3 conv (16 -> 32)
PROJ = "down_blocks.0.attentions.0.proj_in"  # 1x1 conv (16 -> 16)
K = "lora_unet_" + Q.replace(".", "_")
KC = "lora_unet_" + CONV.replace(".", "_")
KP = "lora_unet_" + PROJ.replace(".", "_")


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd15") / "base"
    make_pipeline(folder, "sd15")
    return folder, read_component(folder, "unet")


def rnd(*shape, seed=[0]):  # noqa: B006 - a running seed, so every tensor differs
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0])) * 0.2


def tucker(t, wa, wb):
    """rebuild_tucker written out: sum_ij t[i, j, ...] * wa[i, p] * wb[j, r] -> (p, r, ...)."""
    out = torch.zeros(wa.shape[1], wb.shape[1], *t.shape[2:], dtype=torch.float64)
    for i in range(t.shape[0]):
        for j in range(t.shape[1]):
            out += t[i, j] * torch.outer(wa[i], wb[j]).reshape(wa.shape[1], wb.shape[1], *[1] * (t.dim() - 2))
    return out


def kron(a, b):
    """Kronecker product by its definition, on the first two axes (trailing axes of b kept)."""
    while a.dim() < b.dim():
        a = a[..., None]
    rows = [torch.cat([a[i, j] * b for j in range(a.shape[1])], dim=1) for i in range(a.shape[0])]
    return torch.cat(rows, dim=0)


def _d(t):
    return t.double()


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def loha_linear_and_conv():
    f = {}
    for name, (out, flat) in {K: (16, 16), KC: (32, 16 * 9)}.items():
        f |= {
            f"{name}.hada_w1_a": rnd(out, 2),
            f"{name}.hada_w1_b": rnd(2, flat),
            f"{name}.hada_w2_a": rnd(out, 2),
            f"{name}.hada_w2_b": rnd(2, flat),
            f"{name}.alpha": torch.tensor(1.0),
        }

    def delta(base):
        out = {}
        for name, key, shape in ((K, Q, (16, 16)), (KC, CONV, (32, 16, 3, 3))):
            m1 = _d(f[f"{name}.hada_w1_a"]) @ _d(f[f"{name}.hada_w1_b"])
            m2 = _d(f[f"{name}.hada_w2_a"]) @ _d(f[f"{name}.hada_w2_b"])
            out[key] = (m1 * m2).reshape(shape) * (1.0 / 2)
        return out

    return f, delta


@case
def loha_tucker_conv():
    f = {
        f"{KC}.hada_w1_a": rnd(3, 32),
        f"{KC}.hada_w1_b": rnd(3, 16),
        f"{KC}.hada_t1": rnd(3, 3, 3, 3),
        f"{KC}.hada_w2_a": rnd(3, 32),
        f"{KC}.hada_w2_b": rnd(3, 16),
        f"{KC}.hada_t2": rnd(3, 3, 3, 3),
        f"{KC}.alpha": torch.tensor(6.0),
    }

    def delta(base):
        r1 = tucker(_d(f[f"{KC}.hada_t1"]), _d(f[f"{KC}.hada_w1_a"]), _d(f[f"{KC}.hada_w1_b"]))
        r2 = tucker(_d(f[f"{KC}.hada_t2"]), _d(f[f"{KC}.hada_w2_a"]), _d(f[f"{KC}.hada_w2_b"]))
        return {CONV: r1 * r2 * 2.0}

    return f, delta


@case
def lokr_full_factors_ignore_alpha():
    f = {f"{K}.lokr_w1": rnd(4, 2), f"{K}.lokr_w2": rnd(4, 8), f"{K}.alpha": torch.tensor(123.0)}

    def delta(base):  # both factors full: LyCORIS forces alpha = rank, scale 1
        return {Q: kron(_d(f[f"{K}.lokr_w1"]), _d(f[f"{K}.lokr_w2"]))}

    return f, delta


@case
def lokr_decomposed_and_conv():
    f = {
        f"{K}.lokr_w1": rnd(2, 4),
        f"{K}.lokr_w2_a": rnd(8, 2),
        f"{K}.lokr_w2_b": rnd(2, 4),
        f"{K}.alpha": torch.tensor(1.0),
        f"{KC}.lokr_w1": rnd(4, 4),
        f"{KC}.lokr_w2": rnd(8, 4, 3, 3),
    }

    def delta(base):
        w2 = _d(f[f"{K}.lokr_w2_a"]) @ _d(f[f"{K}.lokr_w2_b"])
        return {Q: kron(_d(f[f"{K}.lokr_w1"]), w2) * 0.5, CONV: kron(_d(f[f"{KC}.lokr_w1"]), _d(f[f"{KC}.lokr_w2"]))}

    return f, delta


@case
def full_diff_and_bias():
    f = {f"{K}.diff": rnd(16, 16), f"{KP}.diff": rnd(16, 16, 1, 1), f"{KP}.diff_b": rnd(16)}

    def delta(base):
        return {Q: _d(f[f"{K}.diff"]), PROJ: _d(f[f"{KP}.diff"]), PROJ + ".bias": _d(f[f"{KP}.diff_b"])}

    return f, delta


@case
def locon_tucker_mid():
    f = {
        f"{KC}.lora_down.weight": rnd(2, 16, 1, 1),
        f"{KC}.lora_mid.weight": rnd(2, 2, 3, 3),
        f"{KC}.lora_up.weight": rnd(32, 2, 1, 1),
        f"{KC}.alpha": torch.tensor(1.0),
    }

    def delta(base):
        up, down = _d(f[f"{KC}.lora_up.weight"]).flatten(1), _d(f[f"{KC}.lora_down.weight"]).flatten(1)
        return {CONV: tucker(_d(f[f"{KC}.lora_mid.weight"]), up.T, down) * 0.5}

    return f, delta


def dora(axis: str):
    def make():
        down, up = rnd(2, 16), rnd(16, 2)
        scale_shape = (16, 1) if axis == "out" else (1, 16)
        m = rnd(*scale_shape).abs() + 1
        f = {
            f"{K}.lora_down.weight": down,
            f"{K}.lora_up.weight": up,
            f"{K}.alpha": torch.tensor(4.0),
            f"{K}.dora_scale": m,
        }

        def delta(base):
            w0 = _d(base[f"{Q}.weight"])
            w = w0 + 2.0 * _d(up) @ _d(down)
            norm = w.norm(dim=1, keepdim=True) if axis == "out" else w.norm(dim=0, keepdim=True)
            return {Q: w * _d(m) / norm - w0}

        return f, delta

    return make


CASES["dora_output_axis"] = dora("out")
CASES["dora_input_axis_old_files"] = dora("in")


@pytest.mark.parametrize("name", list(CASES))
def test_lycoris_algorithms_follow_the_published_math(name, sd15, tmp_path, cli):
    base, before = sd15
    tensors, delta = CASES[name]()
    save(tensors, tmp_path / "lyco.safetensors", {"ss_network_module": "lycoris.kohya"})
    code, out, err = cli("merge", "--base", base, "--adapter", tmp_path / "lyco.safetensors", "--out", tmp_path / "m")
    assert code == 0, err
    ours = read_component(tmp_path / "m", "unet")
    expected = {k if k.endswith(".bias") else f"{k}.weight": v for k, v in delta(before).items()}
    for key, d in expected.items():
        assert d.abs().max() > 1e-3
        torch.testing.assert_close(ours[key].double(), _d(before[key]) + d, atol=2e-6, rtol=1e-5)
    assert {k for k in ours if not torch.equal(ours[k], before[k])} == set(expected)


def test_lycoris_dora_strength_interpolates_the_rescale(sd15, tmp_path, cli):
    """LyCORIS/ComfyUI DoRA strength m: W' = (W + ΔW) * (m * (s/‖W+ΔW‖ - 1) + 1), ΔW without m (§3 DoRA)."""
    base, before = sd15
    tensors, _ = CASES["dora_output_axis"]()
    save(tensors, tmp_path / "lyco.safetensors")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {base}\nadapters: [{{source: {tmp_path / 'lyco.safetensors'}, weight: 0.5}}]\n")
    assert cli("merge", "--recipe", recipe, "--out", tmp_path / "m")[0] == 0
    w = _d(before[f"{Q}.weight"]) + 2.0 * _d(tensors[f"{K}.lora_up.weight"]) @ _d(tensors[f"{K}.lora_down.weight"])
    factor = 0.5 * (_d(tensors[f"{K}.dora_scale"]) / w.norm(dim=1, keepdim=True) - 1) + 1
    ours = read_component(tmp_path / "m", "unet")[f"{Q}.weight"].double()
    torch.testing.assert_close(ours, w * factor, atol=2e-6, rtol=1e-5)


# ---------------------------------------------------------------- detection and malformed files


def assert_refused(cli, tmp_path, base, adapter, message):
    out = tmp_path / "merged"
    code, stdout, err = cli("merge", "--base", base, "--adapter", adapter, "--out", out)
    assert code == 2, (stdout, err)
    assert message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".merged.*"))
    return err


LORA = {
    f"{K}.lora_down.weight": torch.ones(2, 16),
    f"{K}.lora_up.weight": torch.ones(16, 2),
    f"{K}.alpha": torch.tensor(1.0),
}


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({f"lora_unet_{k}": v for k, v in LORA.items()}, "doubled prefix"),
        (
            {f"unet.unet.{Q}.lora_A.weight": torch.ones(2, 16), f"unet.unet.{Q}.lora_B.weight": torch.ones(16, 2)},
            "doubled prefix",
        ),
        ({f"{K}.lora_down.weight": torch.ones(2, 16), f"{K}.alpha": torch.tensor(1.0)}, "lora_up/lora_B"),
        ({f"unet.{Q}.lora_B.weight": torch.ones(16, 2)}, "lora_down/lora_A"),
        (
            {
                f"{K}.alpha": torch.tensor(1.0),
                **{k: v for k, v in LORA.items() if "lora_unet_down_blocks_0_a" not in k},
            },
            "no weights to merge",
        ),
        ({f"{K}.lora_down.weight": torch.ones(2, 16), f"{K}.lora_up.weight": torch.ones(16, 3)}, "ranks"),
        (
            {f"{K}.lora_down.weight": torch.ones(2, 24), f"{K}.lora_up.weight": torch.ones(16, 2)},
            "different model size",
        ),
        ({f"{K}.hada_w1_a": torch.ones(16, 2), f"{K}.hada_w1_b": torch.ones(2, 16)}, "hada_w2_a"),
        ({f"{K}.lokr_w1": torch.ones(4, 4)}, "lokr_w2"),
        ({f"{K}.lokr_w1": torch.ones(4, 4), f"{K}.lokr_w2": torch.ones(4, 8)}, "different model size"),
        ({f"{K}.oft_blocks": torch.ones(4, 4, 4), f"{K}.alpha": torch.tensor(1.0)}, "OFT/BOFT"),
        (
            {
                **LORA,
                "lora_unet_no_such_module.lora_down.weight": torch.ones(2, 16),
                "lora_unet_no_such_module.lora_up.weight": torch.ones(16, 2),
            },
            "lora_unet_no_such_module.lora_down.weight",
        ),
        ({**LORA, f"{K}.something_else": torch.ones(2)}, "not part of any adapter format"),
    ],
    ids=[
        "doubled-kohya",
        "doubled-diffusers",
        "no-up",
        "no-down",
        "alpha-only",
        "rank-mismatch",
        "wrong-shape",
        "loha-half",
        "lokr-half",
        "lokr-shape",
        "oft",
        "unknown-module",
        "unknown-suffix",
    ],
)
def test_malformed_files_are_refused_with_the_reason(tensors, message, sd15, tmp_path, cli):
    base, _ = sd15
    save(tensors, tmp_path / "bad.safetensors")
    err = assert_refused(cli, tmp_path, base, tmp_path / "bad.safetensors", message)
    assert "bad.safetensors" in err


def test_unknown_file_lists_sample_keys_and_formats_tried(sd15, tmp_path, cli):
    base, _ = sd15
    save({"foo.bar": torch.ones(2), "baz": torch.ones(3)}, tmp_path / "what.safetensors")
    err = assert_refused(cli, tmp_path, base, tmp_path / "what.safetensors", "not a recognised adapter")
    assert "foo.bar" in err and "kohya" in err and "PEFT" in err and "diffusers" in err


def test_ambiguous_flattened_name_is_an_error_not_a_guess(tmp_path, cli):
    """Two base tensors that flatten to one kohya name (a_b.c vs a.b_c): naming either is refused."""
    from converter.formats import load_adapter  # noqa: F401 - the CLI path is what is tested

    folder = tmp_path / "base"
    (folder / "transformer").mkdir(parents=True)
    save(
        {"blocks.x_y.weight": torch.ones(4, 4), "blocks_x.y.weight": torch.ones(4, 4)},
        folder / "transformer" / "diffusion_pytorch_model.safetensors",
    )
    (folder / "transformer" / "config.json").write_text("{}")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    save(
        {
            "lora_unet_blocks_x_y.lora_down.weight": torch.ones(1, 4),
            "lora_unet_blocks_x_y.lora_up.weight": torch.ones(4, 1),
        },
        tmp_path / "a.safetensors",
    )
    err = assert_refused(cli, tmp_path, folder, tmp_path / "a.safetensors", "matches several base tensors")
    assert "blocks.x_y.weight" in err and "blocks_x.y.weight" in err


@pytest.mark.parametrize(
    "keys, flavour, components",
    [
        ([f"{K}.lora_down.weight", f"{K}.lora_up.weight", f"{K}.alpha"], "kohya-lora", ["denoiser"]),
        ([f"{K}.hada_w1_a", f"{K}.hada_w1_b", f"{K}.hada_w2_a", f"{K}.hada_w2_b"], "lycoris-loha", ["denoiser"]),
        ([f"{K}.lokr_w1", f"{K}.lokr_w2"], "lycoris-lokr", ["denoiser"]),
        (
            [f"lycoris_{Q.replace('.', '_')}.lokr_w1", f"lycoris_{Q.replace('.', '_')}.lokr_w2"],
            "lycoris-wrapper-lokr",
            ["denoiser"],
        ),
        (
            [
                f"lora_transformer_{Q.replace('.', '_')}.lora_down.weight",
                f"lora_transformer_{Q.replace('.', '_')}.lora_up.weight",
            ],
            "onetrainer-lora",
            ["denoiser"],
        ),
        ([f"unet.{Q}.lora_A.weight", f"unet.{Q}.lora_B.weight"], "diffusers-lora", ["denoiser"]),
        (
            [
                f"{Q.rsplit('.', 1)[0]}.processor.to_q_lora.down.weight",
                f"{Q.rsplit('.', 1)[0]}.processor.to_q_lora.up.weight",
            ],
            "diffusers-lora",
            ["denoiser"],
        ),
        (
            [
                f"diffusion_model.{Q}.lora_down.weight",
                f"diffusion_model.{Q}.lora_up.weight",
                f"diffusion_model.{Q}.alpha",
            ],
            "comfyui-lora",
            ["denoiser"],
        ),
        (
            [
                "text_encoder.text_model.encoder.layers.0.mlp.fc1.lora_linear_layer.down.weight",
                "text_encoder.text_model.encoder.layers.0.mlp.fc1.lora_linear_layer.up.weight",
            ],
            "diffusers-lora",
            ["text_encoder"],
        ),
        (
            ["double_blocks.0.processor.qkv_lora1.down.weight", "double_blocks.0.processor.qkv_lora1.up.weight"],
            "xlabs-lora",
            ["denoiser"],
        ),
        (
            [
                "lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight",
                "lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_up.weight",
            ],
            "kohya-lora",
            ["text_encoder_3"],
        ),
    ],
)
def test_detection_of_each_flavour(keys, flavour, components, tmp_path, cli):
    tensors = {}
    for k in keys:
        tensors[k] = torch.tensor(2.0) if k.endswith("alpha") else torch.ones(2, 2)
    save(tensors, tmp_path / "a.safetensors")
    code, out, err = cli("inspect", tmp_path / "a.safetensors", "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    assert info["kind"] == "adapter" and info["format"] == flavour and info["components"] == components
    from converter.formats import load_adapter

    adapter = load_adapter(tmp_path / "a.safetensors")  # every patch keeps the file's own spelling of its module
    assert all(any(k.startswith(ap.native) for k in keys) for ap in adapter.patches) and adapter.patches


def test_old_diffusers_attention_processor_layout_merges(sd15, tmp_path, cli):
    """`...attn1.processor.to_q_lora.down.weight` and `to_out_lora` (diffusers before PEFT) land on to_q / to_out.0."""
    base, before = sd15
    stem = Q.rsplit(".", 1)[0]
    f = {
        f"{stem}.processor.to_q_lora.down.weight": rnd(2, 16),
        f"{stem}.processor.to_q_lora.up.weight": rnd(16, 2),
        f"{stem}.processor.to_out_lora.down.weight": rnd(2, 16),
        f"{stem}.processor.to_out_lora.up.weight": rnd(16, 2),
    }
    save(f, tmp_path / "old.safetensors")
    assert cli("merge", "--base", base, "--adapter", tmp_path / "old.safetensors", "--out", tmp_path / "m")[0] == 0
    ours = read_component(tmp_path / "m", "unet")
    for proc, target in (("to_q_lora", f"{stem}.to_q.weight"), ("to_out_lora", f"{stem}.to_out.0.weight")):
        d = f[f"{stem}.processor.{proc}.up.weight"] @ f[f"{stem}.processor.{proc}.down.weight"]
        torch.testing.assert_close(ours[target], before[target] + d, atol=1e-6, rtol=1e-6)
