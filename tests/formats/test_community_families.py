"""Community LoRAs of today's diffusion families (docs/FORMATS.md §12), one tiny transformer per family.

For each family: its original single file agrees with diffusers' single-file converter; every spelling its writers
use merges into both base layouts exactly like the published formula, and diffusers' own loader reads exactly the
spellings the keymap says it reads; `convert` to kohya, diffusers, PEFT and ComfyUI gives files that diffusers (or
PEFT), the formula referee and our merge all read as the same ΔW; `inspect` names the family, the spelling and the
tools that load it.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from diffusion_helpers import read_component, save
from family_cases import (
    CASES,
    RANK,
    diffusers_merge,
    expected,
    keymap,
    make_bases,
    make_lora,
    original_layout,
    tiny,
    write_spelling,
)
from safetensors.torch import load_file

ATOL = 1e-6


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each family's tiny model, both base layouts and its LoRA, built once per family on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            case = CASES[name]
            root = tmp_path_factory.mktemp(case.name)
            model = tiny(case)
            folder, single = make_bases(case, model, root)
            lora = make_lora(case, model)
            base = model.state_dict()
            cache[name] = (case, model, folder, single, lora, base, expected(base, lora), root)
        return cache[name]

    return get


FAMILIES = sorted(CASES)


def _wrapper_spellings(name: str) -> list[str]:
    """OneTrainer (`lora_transformer_`) and SimpleTuner's LyCORIS wrapper (`lycoris_`) name the diffusers model they
    wrap, flattened, whatever the family: every family gets both, besides its writers' own spellings."""
    case = CASES[name]
    naming = "" if keymap(case.family).one_naming else "/diffusers"
    return [s for s in (f"onetrainer{naming}", f"lycoris{naming}") if s not in case.spellings]


SPELLINGS = [(f, s) for f in FAMILIES for s in (*CASES[f].spellings, *_wrapper_spellings(f))]


def _close(ours: dict, reference: dict, what: str) -> None:
    assert set(ours) == set(reference), f"{what}: {sorted(set(ours) ^ set(reference))[:4]}"
    for k, v in reference.items():
        torch.testing.assert_close(ours[k], v, atol=ATOL, rtol=1e-5, msg=lambda m, k=k: f"{what}: {k}: {m}")


@pytest.mark.parametrize("name", FAMILIES)
def test_original_layout_is_diffusers_own(built, name):
    """The keymap's original names, built into a single file, are what diffusers' single-file converter reads back
    into the diffusers weights: the aliases carry diffusers' facts."""
    case, model, *_ = built(name)
    km = keymap(case.family)
    if km.one_naming:
        pytest.skip(f"{km.title}: the original checkpoint has diffusers' names")
    if case.no_single_file_check:
        pytest.skip(case.no_single_file_check)
    from diffusers.loaders import single_file_utils

    convert = getattr(single_file_utils, km.diffusers["single_file"])
    base = model.state_dict()
    config = {"config": dict(model.config)} if "config" in inspect.signature(convert).parameters else {}
    back = convert(original_layout(base, km), **config)
    _close(back, base, "diffusers' single-file converter")


@pytest.mark.parametrize("name, spelling", SPELLINGS)
def test_every_spelling_merges_like_the_formula_and_diffusers(built, name, spelling, cli, tmp_path):
    case, model, folder, single, lora, base, want, _ = built(name)
    km = keymap(case.family)
    adapter = write_spelling(lora, spelling, tmp_path)
    # diffusers reads exactly what the keymap says it reads
    listed = any(s == spelling or s == spelling.split("/")[0] for s in km.loaders.get("diffusers", []))
    try:
        theirs = diffusers_merge(case, model, adapter)
        agrees = all(torch.allclose(theirs[k], v, atol=ATOL, rtol=1e-5) for k, v in want.items())
    except Exception:  # noqa: BLE001 - a loader that refuses the file does not read it
        agrees = False
    if spelling not in case.unchecked:
        assert agrees == listed, f"diffusers {'does not read' if listed else 'reads'} {spelling} ({km.name} loaders)"
    # ours, into the diffusers folder and the original single file; `base_model.model.` weights without their
    # adapter_config.json need their alpha stated (here: the scale is folded in, alpha = rank)
    alpha = ["--lora-alpha", str(lora.rank)] if spelling.startswith("peft") else []
    code, _, err = cli("merge", "--base", folder, "--adapter", adapter, "--out", tmp_path / "f", *alpha)
    assert code == 0, err
    _close(read_component(tmp_path / "f", "transformer"), want, f"{spelling} into the folder")
    if single is not None:
        code, _, err = cli("merge", "--base", single, "--adapter", adapter, "--out", tmp_path / "s", *alpha)
        assert code == 0, err
        merged = load_file(tmp_path / "s" / single.name)
        _close(merged, {case.prefix + k: v for k, v in original_layout(want, km).items()}, f"{spelling} into the file")
    # inspect names the family, the spelling and who loads it
    code, out, err = cli("inspect", adapter, "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    if info["family"] is None:  # names other families share (FLUX.1 and HunyuanVideo name diffusers' blocks alike)
        assert case.family in info["family_candidates"] and len(info["family_candidates"]) > 1, info
        assert info["spelling"] in (spelling, spelling.split("/")[0]), info
    else:
        assert info["family"] == case.family and info["spelling"] == spelling, info
        assert ("diffusers" in info["loads_in"]) == listed, info


@pytest.mark.parametrize("to", ["kohya", "comfyui", "diffusers", "peft"])
@pytest.mark.parametrize("name", FAMILIES)
def test_convert_to_every_target_reads_back_everywhere(built, name, to, cli, tmp_path):
    """From the family's first spelling: the converted file is one the target's tool loads (by the keymap, whose
    diffusers claims the spelling test checks), diffusers (PEFT for a PEFT folder) reads it as the same ΔW where it
    reads it at all, and our merge of it, checked by the formula referee (verification on), gives the same weights."""
    case, model, folder, single, lora, base, want, _ = built(name)
    source = write_spelling(lora, case.spellings[0], tmp_path / "in")
    out = tmp_path / ("out.safetensors" if to in ("kohya", "comfyui") else "out")
    alpha = ["--lora-alpha", str(lora.rank)] if case.spellings[0].startswith("peft") else []  # scale folded in
    code, log, err = cli("convert", "--adapter", source, "--to", to, "--base", folder, "--out", out, *alpha)
    assert code == 0, err
    assert "ΔW identical" in log or "within float32 rounding" in log, log
    if to == "peft":
        _close(_peft_merge(model, out), want, "the PEFT folder read by PEFT")
    else:
        file = out if out.is_file() else out / "pytorch_lora_weights.safetensors"
        code, info, err = cli("inspect", file, "--json")
        assert code == 0, err
        info = json.loads(info)["details"]
        loads_in = info["loads_in"] if info["family"] else _tools(keymap(case.family), info["spelling"])
        assert to in loads_in or to not in keymap(case.family).loaders, info  # the target's tool reads it
        if "diffusers" in loads_in and info["spelling"] not in case.unchecked:
            _close(diffusers_merge(case, model, file), want, f"{to} read by diffusers")
    code, log, err = cli("merge", "--base", folder, "--adapter", out, "--out", tmp_path / "m", verify=True)
    assert code == 0, err + log
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert report["verdict"] == "pass", report
    _close(read_component(tmp_path / "m", "transformer"), want, f"{to} merged by us")


def _tools(km, spelling: str) -> list[str]:
    """The tools the keymap says read `spelling` (for names several families share)."""
    from converter.engine.family import Identity

    prefix, _, naming = spelling.partition("/")
    return Identity(km, [km.name], prefix, naming or None).loads_in()


def _peft_merge(model, folder):
    import copy

    from peft import PeftModel

    wrapped = PeftModel.from_pretrained(copy.deepcopy(model), folder)
    return {k: v for k, v in wrapped.merge_and_unload().state_dict().items()}


def test_lycoris_lokr_on_fused_bfl_modules_merges_by_rows_into_both_layouts(built, cli, tmp_path):
    """A LyCORIS LoKr on FLUX.2's fused qkv / linear1 (diffusion_model. + BFL names, as ai-toolkit writes it): its
    Kronecker delta lands whole on the single file and by rows on diffusers' to_q/to_k/to_v, as the published
    formula says (kron(w1, w2) · alpha / rank when a factor is decomposed); the formula referee passes it."""
    case, model, folder, single, lora, base, want, _ = built("flux2")
    g = torch.Generator().manual_seed(11)
    qkv, linear1 = base["transformer_blocks.0.attn.to_q.weight"].shape, base[
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"].shape  # fmt: skip
    sd = {  # (3h, h) = kron((3, 2), (h, h / 2)); w2 decomposed: scale alpha / rank
        "diffusion_model.double_blocks.0.img_attn.qkv.lokr_w1": torch.randn(3, 2, generator=g),
        "diffusion_model.double_blocks.0.img_attn.qkv.lokr_w2_a": torch.randn(qkv[0], 2, generator=g) * 0.3,
        "diffusion_model.double_blocks.0.img_attn.qkv.lokr_w2_b": torch.randn(2, qkv[1] // 2, generator=g) * 0.3,
        "diffusion_model.double_blocks.0.img_attn.qkv.alpha": torch.tensor(1.0),
        "diffusion_model.single_blocks.0.linear1.lokr_w1": torch.randn(linear1[0] // 8, 2, generator=g) * 0.3,
        "diffusion_model.single_blocks.0.linear1.lokr_w2": torch.randn(8, linear1[1] // 2, generator=g) * 0.3,
    }
    adapter = save(sd, tmp_path / "lokr.safetensors")
    d = sd["diffusion_model.double_blocks.0.img_attn.qkv.lokr_w2_a"] @ sd[
        "diffusion_model.double_blocks.0.img_attn.qkv.lokr_w2_b"]  # fmt: skip
    qkv_delta = torch.kron(sd["diffusion_model.double_blocks.0.img_attn.qkv.lokr_w1"], d) * 0.5
    l1_delta = torch.kron(sd["diffusion_model.single_blocks.0.linear1.lokr_w1"],
                          sd["diffusion_model.single_blocks.0.linear1.lokr_w2"])  # fmt: skip
    expect = dict(base)
    for i, x in enumerate(("q", "k", "v")):
        k = f"transformer_blocks.0.attn.to_{x}.weight"
        expect[k] = base[k] + qkv_delta[i * qkv[0] : (i + 1) * qkv[0]]
    k = "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"
    expect[k] = base[k] + l1_delta
    code, log, err = cli("merge", "--base", folder, "--adapter", adapter, "--out", tmp_path / "f", verify=True)
    assert code == 0, err + log
    assert json.loads((tmp_path / "f" / "verification.json").read_text())["verdict"] == "pass"
    _close(read_component(tmp_path / "f", "transformer"), expect, "LoKr into the folder")
    code, _, err = cli("merge", "--base", single, "--adapter", adapter, "--out", tmp_path / "s")
    assert code == 0, err
    in_file = {case.prefix + k: v for k, v in original_layout(expect, keymap("flux2")).items()}
    _close(load_file(tmp_path / "s" / single.name), in_file, "LoKr into the file")


def test_flux2_kohya_file_diffusers_cannot_read_whole_converts_to_one_it_reads(built, cli, tmp_path):
    """A FLUX.2 kohya file on every linear (the stream modulations and the final layer too): diffusers' kohya
    converter drops those modules ("Unsupported keys"), so it does not read the file as trained; converted with a
    base it becomes a diffusers file diffusers reads exactly, the final layer's [shift, scale] halves swapped."""
    from family_cases import Lora, linears, spell

    case, model, folder, single, lora, base, want, _ = built("flux2")
    g = torch.Generator().manual_seed(12)
    extra = {}
    for name in ("double_stream_modulation_img.linear", "single_stream_modulation.linear", "norm_out.linear"):
        out, inp = linears(model)[name]
        extra[name] = (torch.randn(lora.rank, inp, generator=g) * 0.3, torch.randn(out, lora.rank, generator=g) * 0.3)
    half = extra["norm_out.linear"][1].shape[0] // 2
    swapped = torch.cat([extra["norm_out.linear"][1][half:], extra["norm_out.linear"][1][:half]])
    original = dict(lora.original) | {
        "double_stream_modulation_img.lin": extra["double_stream_modulation_img.linear"],
        "single_stream_modulation.lin": extra["single_stream_modulation.linear"],
        "final_layer.adaLN_modulation.1": (extra["norm_out.linear"][0], swapped),  # BFL order: [shift, scale]
    }
    whole = Lora(original, dict(lora.diffusers) | extra)
    expect = expected(base, whole)
    sd, _ = spell(whole, "kohya/original")
    source = save(sd, tmp_path / "flux2_kohya.safetensors")
    theirs = diffusers_merge(case, model, source)
    assert any(not torch.allclose(theirs[k], v) for k, v in expect.items())  # the extra modules are lost
    code, log, err = cli("convert", "--adapter", source, "--to", "diffusers", "--base", folder, "--out", tmp_path / "d")
    assert code == 0, err
    _close(diffusers_merge(case, model, tmp_path / "d" / "pytorch_lora_weights.safetensors"), expect, "converted")
    code, _, err = cli("merge", "--base", folder, "--adapter", source, "--out", tmp_path / "m")
    assert code == 0, err
    _close(read_component(tmp_path / "m", "transformer"), expect, "merged")


# LyCORIS LoKr files as their writers spell them, each module: (spelled name, how its delta lands on diffusers'
# modules: the diffusers module, or the thirds of a fused BFL qkv)
LOKR_FILES = {
    "z_image ai-toolkit": ("z_image", "diffusion_model.", [
        ("layers.0.attention.to_q", "layers.0.attention.to_q"),
        ("layers.1.feed_forward.w1", "layers.1.feed_forward.w1"),
        ("noise_refiner.0.attention.to_out.0", "noise_refiner.0.attention.to_out.0"),
    ]),
    "z_image LyCORIS": ("z_image", "lycoris_", [  # diffusers' Z-Image loader does not read these
        ("noise_refiner.0.attention.to_v", "noise_refiner.0.attention.to_v"),
    ]),
    "z_image SimpleTuner": ("z_image", "", [
        ("context_refiner.0.attention.to_k", "context_refiner.0.attention.to_k"),
        ("layers.0.feed_forward.w2", "layers.0.feed_forward.w2"),
    ]),
    "flux2 LyCORIS": ("flux2", "lycoris_", [
        ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_q"),
        ("transformer_blocks.1.ff.linear_in", "transformer_blocks.1.ff.linear_in"),
        ("single_transformer_blocks.0.attn.to_qkv_mlp_proj", "single_transformer_blocks.0.attn.to_qkv_mlp_proj"),
    ]),
    "flux2 ai-toolkit BFL": ("flux2", "diffusion_model.", [
        ("double_blocks.0.img_attn.qkv", ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                                          "transformer_blocks.0.attn.to_v")),
        ("double_blocks.1.txt_mlp.0", "transformer_blocks.1.ff_context.linear_in"),  # SwiGLU: FLUX.2, not FLUX.1
        ("single_blocks.1.linear2", "single_transformer_blocks.1.attn.to_out"),
    ]),
    "flux2 PEFT BFL": ("flux2", "base_model.model.", [
        ("double_blocks.1.img_attn.proj", "transformer_blocks.1.attn.to_out.0"),
        ("double_blocks.0.img_mlp.0", "transformer_blocks.0.ff.linear_in"),
    ]),
    "flux2 SimpleTuner": ("flux2", "", [
        ("transformer_blocks.1.attn.add_k_proj", "transformer_blocks.1.attn.add_k_proj"),
        ("single_transformer_blocks.1.attn.to_qkv_mlp_proj", "single_transformer_blocks.1.attn.to_qkv_mlp_proj"),
    ]),
}  # fmt: skip


def _lokr_file(model, prefix: str, modules: list, tmp_path):
    """A LoKr file on `modules` (factors shaped as PEFT factors them, so diffusers can rebuild its config): the
    first module's w2 rank-decomposed (rank 1, alpha 0.5: scale 0.5), the others full (scale 1, alpha ignored);
    and its delta on each diffusers weight by the published formula."""
    from peft.tuners.lokr.layer import factorization

    sizes = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    g = torch.Generator().manual_seed(13)
    sd, deltas = {}, {}
    for i, (name, lands) in enumerate(modules):
        parts = (lands,) if isinstance(lands, str) else lands
        out, inp = sum(sizes[p][0] for p in parts), sizes[parts[0]][1]
        (a, b), (c, d) = factorization(out, -1), factorization(inp, -1)
        stem = prefix + (name.replace(".", "_") if prefix == "lycoris_" else name)
        w1 = torch.randn(a, c, generator=g) * 0.3
        sd[f"{stem}.lokr_w1"] = w1
        if i == 0:
            w2a, w2b = torch.randn(b, 1, generator=g) * 0.3, torch.randn(1, d, generator=g) * 0.3
            sd |= {f"{stem}.lokr_w2_a": w2a, f"{stem}.lokr_w2_b": w2b}
            delta = torch.kron(w1.double(), (w2a @ w2b).double()) * 0.5
        else:
            w2 = torch.randn(b, d, generator=g) * 0.3
            sd[f"{stem}.lokr_w2"] = w2
            delta = torch.kron(w1.double(), w2.double())
        sd[f"{stem}.alpha"] = torch.tensor(0.5)
        row = 0
        for p in parts:
            deltas[f"{p}.weight"] = delta[row : row + sizes[p][0]]
            row += sizes[p][0]
    return save(sd, tmp_path / "lokr.safetensors"), deltas


def _diffusers_lokr_merge(case, model, file):
    """diffusers' own reading of a LoKr file (its converter, LoKrConfig and PEFT's merge), as diffusers' weights:
    a fused qkv it made to take a BFL file's delta is split back into q, k, v."""
    from diffusers.loaders import lora_pipeline
    from peft.tuners.tuners_utils import BaseTunerLayer

    mixin = getattr(lora_pipeline, keymap(case.family).diffusers["loader"])
    sd = mixin.lora_state_dict(str(file.parent), weight_name=file.name)
    target = __import__("copy").deepcopy(model)
    mixin.load_lora_into_transformer(sd, transformer=target)
    for module in target.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    out = {k.replace(".base_layer.", "."): v for k, v in target.state_dict().items() if ".lokr_" not in k}
    for key in [k for k in out if ".to_qkv." in k or ".to_added_qkv." in k]:
        fused = out.pop(key)
        names = ("to_q", "to_k", "to_v") if ".to_qkv." in key else ("add_q_proj", "add_k_proj", "add_v_proj")
        for j, part in enumerate(fused.chunk(3)):
            out[key.replace(key.split(".")[-2], names[j])] = part
    return out


@pytest.mark.parametrize("which", sorted(LOKR_FILES))
def test_lokr_files_merge_as_diffusers_reads_them(built, which, cli, tmp_path):
    """LyCORIS LoKr files as ai-toolkit (ComfyUI names), LyCORIS, PEFT and SimpleTuner write them for Z-Image and
    FLUX.2: our merge into both base layouts and the published formula agree, and so does diffusers' own loader
    (its LoKr converters, fusing FLUX.2's qkv for a BFL file) exactly for the spellings the keymap's
    `lokr_loaders` list; inspect names the family and those loaders (kohya reads no LoKr)."""
    family, prefix, modules = LOKR_FILES[which]
    case, model, folder, single, _, base, _, _ = built(family)
    adapter, deltas = _lokr_file(model, prefix, modules, tmp_path)
    want = dict(base) | {k: (base[k].double() + d).to(base[k].dtype) for k, d in deltas.items()}
    code, out, err = cli("inspect", adapter, "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    assert info["family"] == family and "kohya" not in info["loads_in"], info
    assert info["convert_for"] and all("--rank RANK" in c for c in info["convert_for"].values()), info
    try:
        theirs = _diffusers_lokr_merge(case, model, adapter)
        agrees = all(torch.allclose(theirs[k], v, atol=ATOL, rtol=1e-5) for k, v in want.items())
    except Exception:  # noqa: BLE001 - a loader that refuses the file does not read it
        agrees = False
    assert agrees == ("diffusers" in info["loads_in"]), f"{which}: diffusers reads it: {agrees}; {info}"
    code, log, err = cli("merge", "--base", folder, "--adapter", adapter, "--out", tmp_path / "f")
    assert code == 0, err + log
    _close(read_component(tmp_path / "f", "transformer"), want, f"{which} into the folder")
    code, _, err = cli("merge", "--base", single, "--adapter", adapter, "--out", tmp_path / "s")
    assert code == 0, err
    in_file = {case.prefix + k: v for k, v in original_layout(want, keymap(family)).items()}
    _close(load_file(tmp_path / "s" / single.name), in_file, f"{which} into the file")


@pytest.mark.parametrize("family, module, lands", [
    ("z_image", "layers.0.attention.to_k", ("layers.0.attention.to_k",)),
    ("flux2", "double_blocks.0.img_attn.qkv", ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                                               "transformer_blocks.0.attn.to_v")),
])  # fmt: skip
def test_ai_toolkit_dora_magnitude_merges_by_peft_formula(built, family, module, lands, cli, tmp_path):
    """ai-toolkit's DoRA (`diffusion_model.` + lora_A/lora_B + `.magnitude`, one per output row as PEFT's): merged
    by PEFT's DoRA formula, W' = m ⊙ (W + ΔW) / ‖W + ΔW‖ per row, into both layouts; on FLUX.2's fused qkv the
    magnitude and the delta split by rows onto diffusers' q, k, v (the norm is per row, so the split is exact)."""
    case, model, folder, single, _, base, _, _ = built(family)
    ws = [base[f"{k}.weight"].double() for k in lands]
    w = torch.cat(ws)
    g = torch.Generator().manual_seed(17)
    down, up = torch.randn(RANK, w.shape[1], generator=g) * 0.3, torch.randn(w.shape[0], RANK, generator=g) * 0.3
    magnitude = torch.rand(w.shape[0], generator=g) + 0.5
    stem = f"diffusion_model.{module}"
    adapter = save({f"{stem}.lora_A.weight": down, f"{stem}.lora_B.weight": up, f"{stem}.magnitude": magnitude},
                   tmp_path / "dora.safetensors")  # fmt: skip
    merged = w + up.double() @ down.double()
    merged = magnitude.double()[:, None] * merged / merged.norm(dim=1, keepdim=True)
    want, row = dict(base), 0
    for k, part in zip(lands, ws, strict=True):
        want[f"{k}.weight"] = merged[row : row + part.shape[0]].to(base[f"{k}.weight"].dtype)
        row += part.shape[0]
    code, log, err = cli("merge", "--base", folder, "--adapter", adapter, "--out", tmp_path / "f")
    assert code == 0, err + log
    _close(read_component(tmp_path / "f", "transformer"), want, "DoRA into the folder")
    code, _, err = cli("merge", "--base", single, "--adapter", adapter, "--out", tmp_path / "s")
    assert code == 0, err
    in_file = {case.prefix + k: v for k, v in original_layout(want, keymap(family)).items()}
    _close(load_file(tmp_path / "s" / single.name), in_file, "DoRA into the file")
