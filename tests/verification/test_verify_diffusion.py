"""Diffusion merges are proven by diffusers' own loader, twice: each tensor against the ΔW diffusers' loader puts in
(its PEFT layers merged on the base's rows), and the merged pipeline's outputs against the unmerged one. A right
merge passes, each sabotage fails and names what is wrong (the tensor; the module, when the behaviour is compared
by itself); a file diffusers would misread goes to the published-formula referee (never a false alarm)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusion_helpers import (
    TE_TARGETS,
    UNET_TARGETS,
    kohya_lora,
    kohya_modules,
    make_pipeline,
    save,
)
from model_helpers import assert_round_trips
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("few_images")  # one cheap image per check (conftest)

TENSORS = "diffusion_pytorch_model.safetensors"
Q = "down_blocks.0.attentions.{}.transformer_blocks.0.attn1.to_q.weight"


def lora_for(models: dict, alpha: float | None, te_prefixes: dict[str, str]) -> dict:
    mods = kohya_modules(models["unet"], "lora_unet", UNET_TARGETS, convs=True)
    for name, prefix in te_prefixes.items():
        mods.update(kohya_modules(models[name], prefix, TE_TARGETS))
    sd = kohya_lora(mods, rank=4, conv_rank=2)
    # one alpha everywhere: diffusers ignores per-module alphas of attention projections (see the skip test)
    for k in [k for k in sd if k.endswith(".alpha")]:  # None: alpha = rank, scale 1
        sd[k] = torch.tensor(
            alpha if alpha is not None else float(sd[k.replace(".alpha", ".lora_down.weight")].shape[0])
        )
    return sd


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    root = tmp_path_factory.mktemp("dverify")
    models = make_pipeline(root / "base", "sd15")
    save(lora_for(models, 3.0, {"text_encoder": "lora_te"}), root / "lora.safetensors")
    return root, models


def merge(cli, root, out, adapter=None, *extra, verify=False):
    code, stdout, err = cli("merge", "--base", root / "base", "--adapter", adapter or root / "lora.safetensors",
                            "--out", out, *extra, verify=verify)  # fmt: skip
    return code, stdout + err


def verify(cli, root, folder, *extra, adapter=None):
    code, out, err = cli("verify", folder, "--base", root / "base", "--adapter", adapter or root / "lora.safetensors",
                         *extra)  # fmt: skip
    return code, out + err, json.loads((folder / "verification.json").read_text())


@pytest.fixture(scope="module")
def merged_f32(sd15, tmp_path_factory):
    """One right float32 merge (no verification): each sabotage edits a copy."""
    from converter.cli import main

    root, _ = sd15
    out = tmp_path_factory.mktemp("m") / "merged"
    assert main(["merge", "--base", str(root / "base"), "--adapter", str(root / "lora.safetensors"), "--out",
                 str(out), "--no-verify"]) == 0  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", ["float32"])
def test_right_sd15_merge_passes_with_images_in_the_card(sd15, tmp_path, cli, dtype):
    root, _ = sd15
    code, log = merge(cli, root, tmp_path / "m", None, "--dtype", dtype, verify=True)
    assert code == 0, log
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert report["verdict"] == "pass" and report["kind"] == "diffusion", report["problems"]
    assert assert_round_trips(tmp_path / "m").images  # a diffusion report, read back typed, with its images
    assert report["output_dtype"] == {"float32": "F32", "bfloat16": "BF16"}[dtype]
    for name in ("unet", "text_encoder"):
        c = report["components"][name]
        m, b = c["merged_vs_reference"]["rel_err"], c["base_vs_reference"]["rel_err"]
        assert m <= report["tolerance"]["output_rel_err"] < b, (name, m, b)
    (image,) = report["images"]
    assert set(image) == {"prompt", "base", "reference", "merged", "psnr", "max_abs"}
    for role in ("base", "reference", "merged"):
        assert (tmp_path / "m" / image[role]).is_file() and image[role].startswith("verification/")
    card = (tmp_path / "m" / "README.md").read_text()
    assert "**Passed**" in card and "Not verified" not in card and "](verification/merged-0.png)" in card


def sabotage(kind: str, merged, base, folder):
    shutil.copytree(merged, folder)
    if kind == "nothing merged":
        for c in ("unet", "text_encoder"):
            shutil.rmtree(folder / c)
            shutil.copytree(base / c, folder / c)
        return
    if kind == "text-encoder part dropped":
        shutil.rmtree(folder / "text_encoder")
        shutil.copytree(base / "text_encoder", folder / "text_encoder")
        return
    f = folder / "unet" / TENSORS
    t, before = load_file(f), load_file(base / "unet" / TENSORS)
    if kind == "one perturbed tensor":
        t[Q.format(1)] = t[Q.format(1)] + 0.05 * t[Q.format(1)].std() * torch.randn_like(t[Q.format(1)])
    elif kind == "wrong block mapping":  # each block's delta applied to the other block
        a, b = Q.format(0), Q.format(1)
        t[a], t[b] = before[a] + (t[b] - before[b]), before[b] + (t[a] - before[a])
    save_file(t, f, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "kind, component",
    [
        ("one perturbed tensor", "unet"),
        ("wrong block mapping", "unet"),
        ("text-encoder part dropped", "text_encoder"),
        ("nothing merged", "text_encoder"),  # components are judged in name order; the unet fails too
    ],
)
def test_each_sabotage_fails_and_names_the_module(sd15, merged_f32, tmp_path, cli, kind, component):
    root, _ = sd15
    sabotage(kind, merged_f32, root / "base", tmp_path / "s")
    code, log, report = verify(cli, root, tmp_path / "s")
    assert code == 3 and report["verdict"] == "fail" and report["tensors"]["referee"]["name"] == "diffusers", log
    names = [f["name"] for f in report["tensors"]["failures"]]
    assert names and all(n.startswith(("unet/", "text_encoder/")) for n in names)
    assert report["tensors"]["groups"][component]["failed"]
    if kind in ("one perturbed tensor", "wrong block mapping"):
        assert sorted(names) == sorted({f"unet/{Q.format(1)}"} | ({f"unet/{Q.format(0)}"} if "mapping" in kind else
                                                                set()))  # fmt: skip
    code, log, report = verify(cli, root, tmp_path / "s", "--proof", "behaviour")  # the behaviour, by itself
    assert code == 3 and report["verdict"] == "fail", log
    culprit = report["first_disagreeing_module"]["module"]
    assert culprit.startswith(f"{component}."), culprit
    if kind == "one perturbed tensor":
        assert culprit == "unet." + Q.format(1).removesuffix(".weight"), culprit
    if kind == "wrong block mapping":
        assert culprit == "unet." + Q.format(0).removesuffix(".weight"), culprit
    if kind == "nothing merged":
        assert any("was anything merged" in p for p in report["problems"]) and "unet" in " ".join(report["problems"])
    assert "first module that disagrees" in log


def test_scale_dropped_fails(sd15, tmp_path, cli):
    """Merged with scale 1 (alpha = rank) where the file says alpha 3 of rank 4."""
    root, models = sd15
    save(lora_for(models, None, {"text_encoder": "lora_te"}), tmp_path / "unscaled.safetensors")
    assert merge(cli, root, tmp_path / "m", tmp_path / "unscaled.safetensors")[0] == 0
    code, log, report = verify(cli, root, tmp_path / "m")
    assert code == 3 and report["verdict"] == "fail", log
    assert {c for c, g in report["tensors"]["groups"].items() if g["failed"]} == {"text_encoder", "unet"}
    code, log, report = verify(cli, root, tmp_path / "m", "--proof", "behaviour")
    assert {p.split(":")[0] for p in report["problems"] if "relative error" in p} >= {"text_encoder", "unet"}


def test_sdxl_merge_with_both_text_encoders_passes(tmp_path, cli):
    models = make_pipeline(tmp_path / "base", "sdxl")
    save(lora_for(models, 2.0, {"text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}), tmp_path / "l.safetensors")
    code, log = merge(cli, tmp_path, tmp_path / "m", tmp_path / "l.safetensors", "--dtype", "bfloat16", verify=True)
    assert code == 0, log
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert report["verdict"] == "pass" and set(report["components"]) == {"unet", "text_encoder", "text_encoder_2"}
    assert report["tensors"]["referee"]["name"] == "diffusers" and report["tensors"]["worst"]["ratio"] <= 1


def test_per_module_alphas_are_read_by_diffusers_one_alpha_at_a_time(sd15, tmp_path, cli):
    """diffusers' loader misreads a kohya file whose alphas differ by module (it keys them under names PEFT never
    matches), but reads a file of one alpha right: the file is loaded as one copy per alpha, the other modules'
    up factors zeroed, and diffusers referees both proofs. Merged with the commonest alpha everywhere (what
    diffusers' loader would apply to the whole file), it fails naming unet tensors."""
    root, models = sd15
    mods = kohya_modules(models["unet"], "lora_unet", UNET_TARGETS)
    lora = kohya_lora(mods)  # alphas 2, 3, 4 by module
    save(lora, tmp_path / "alphas.safetensors")
    code, log = merge(cli, root, tmp_path / "m", tmp_path / "alphas.safetensors", verify=True)
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert code == 0 and report["verdict"] == "pass", log
    assert report["tensors"]["referee"]["name"] == "diffusers" and report["tensors"]["referee"]["independent"]
    assert report["behaviour_skipped"] is None and report["components"], report["behaviour_skipped"]  # compared
    common = {k: (torch.tensor(3.0) if k.endswith(".alpha") else v) for k, v in lora.items()}
    save(common, tmp_path / "common.safetensors")
    assert merge(cli, root, tmp_path / "c", tmp_path / "common.safetensors")[0] == 0
    code, log, report = verify(cli, root, tmp_path / "c", "--proof", "tensors", adapter=tmp_path / "alphas.safetensors")
    assert code == 3 and report["tensors"]["referee"]["name"] == "diffusers", log
    assert report["tensors"]["failures"] and all(f["name"].startswith("unet/") for f in report["tensors"]["failures"])


def dit_pipeline(root, family: str):
    """The tiny Flux / Wan transformers of the community tests in a pipeline folder, with a LoRA for each."""
    from test_community_flux import peft_style_lora, tiny_flux
    from test_community_video import musubi_wan_lora, tiny_wan

    model = tiny_flux() if family == "flux" else tiny_wan()
    model.save_pretrained(root / "base" / "transformer")
    pipeline = {"flux": "FluxPipeline", "wan": "WanPipeline"}[family]
    index = {"_class_name": pipeline, "transformer": ["diffusers", type(model).__name__]}
    (root / "base" / "model_index.json").write_text(json.dumps(index))
    save(peft_style_lora(model) if family == "flux" else musubi_wan_lora(), root / "lora.safetensors")


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_flux_and_wan_merges_pass_and_a_doubled_delta_is_located(tmp_path, cli, family):
    dit_pipeline(tmp_path, family)
    # float32: one module's error this small (its delta applied twice) is below bfloat16's rounding at the output
    code, log = merge(cli, tmp_path, tmp_path / "m", None, "--dtype", "float32", verify=True)
    assert code == 0, log
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert report["verdict"] == "pass" and list(report["components"]) == ["transformer"], report
    assert report["images"] == []  # no VAE / scheduler in these folders: the transformer's check only
    f = next((tmp_path / "m" / "transformer").glob("*.safetensors"))
    t, before = load_file(f), load_file(tmp_path / "base" / "transformer" / f.name)
    name = next(k for k in sorted(t) if k.endswith(".weight") and t[k].dim() == 2 and not torch.equal(t[k], before[k]))
    t[name] = 2 * t[name] - before[name]  # its delta applied twice
    save_file(t, f, metadata={"format": "pt"})
    code, out, err = cli("verify", tmp_path / "m")
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert code == 3 and [f["name"] for f in report["tensors"]["failures"]] == [f"transformer/{name}"], out + err
    assert "as if the change were applied twice" in report["problems"][0]
    code, out, err = cli("verify", tmp_path / "m", "--proof", "behaviour")
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert code == 3 and report["first_disagreeing_module"]["module"].startswith("transformer."), out + err
