"""Where diffusers cannot referee a diffusion merge's tensors (per-module alphas it misreads, LyCORIS files it
refuses or DoRA it drops, include/exclude, single-file bases), the published formula in float64 does: a right merge
passes (float32, float16 and bfloat16 outputs), each sabotage fails and names the tensor, and the card says which
referee it was (and that it shares the keymap's placement with the merge)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusion_helpers import (
    UNET_TARGETS,
    kohya_lora,
    kohya_modules,
    make_pipeline,
    read_component,
    save,
)
from safetensors.torch import load_file, save_file
from test_community_lycoris import CASES
from test_community_sd import sd15_lora, to_ldm

pytestmark = pytest.mark.usefixtures("few_images")  # one cheap image per check (conftest)


@pytest.fixture(autouse=True)
def diffusers_reads_the_alphas_whole(monkeypatch):
    """diffusers' own loader misreads these files' per-module alphas when it reads a file whole; the referee reads
    such a file one alpha at a time (test_verify_diffusion.py), which here is switched off, so that diffusers
    declines as its loader alone would and the formula's path is what these tests hold."""
    from converter.verification import diffusers_parts

    monkeypatch.setattr(diffusers_parts, "one_alpha_each", lambda tensors: [tensors])


TENSORS = "diffusion_pytorch_model.safetensors"
Q = "down_blocks.0.attentions.1.transformer_blocks.0.attn1.to_q.weight"
LABEL = "referee: published formula; module placement from converter's keymap"


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    """A tiny SD 1.5 pipeline and a kohya LoRA with alphas 2, 3, 4 by module: diffusers ignores those of the
    attention projections, so it cannot referee this file."""
    root = tmp_path_factory.mktemp("formula")
    models = make_pipeline(root / "base", "sd15")
    save(sd15_lora(models), root / "lora.safetensors")
    return root, models


def merge(cli, base, adapter, out, *extra, verify=True):
    code, stdout, err = cli("merge", "--base", base, "--adapter", adapter, "--out", out, *extra, verify=verify)
    return code, stdout + err


def report_of(folder):
    return json.loads((folder / "verification.json").read_text())


def verify(cli, base, adapter, folder, *extra):
    code, out, err = cli("verify", folder, "--base", base, "--adapter", adapter, *extra)
    return code, out + err, report_of(folder)


def referee(report) -> str:
    return report["tensors"]["referee"]["name"]


def failed(report) -> list[str]:
    return [f["name"] for f in report["tensors"]["failures"]]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_right_merge_passes_by_the_published_formula_and_says_so(sd15, tmp_path, cli, dtype):
    root, _ = sd15
    code, log = merge(cli, root / "base", root / "lora.safetensors", tmp_path / "m", "--dtype", dtype)
    assert code == 0, log
    report = report_of(tmp_path / "m")
    assert report["verdict"] == "pass" and referee(report) == "published formula", report["problems"]
    assert "per-module alphas" in report["tensors"]["referee"]["detail"]
    assert "per-module alphas" in report["behaviour_skipped"]  # diffusers' forward is no reference either
    modules = sum(k.endswith(".lora_down.weight") for k in load_file(root / "lora.safetensors"))
    groups = report["tensors"]["groups"]
    assert {g for g, c in groups.items() if c["changed"]} == {"unet", "text_encoder"}
    assert report["tensors"]["changed"] == modules and report["tensors"]["untouched"] > 0
    assert all(c["worst_ratio"] <= 1 for c in groups.values())
    card = (tmp_path / "m" / "README.md").read_text()
    assert "**Passed**" in card and LABEL in card and "diffusers' load_lora_weights" not in card
    # the base pipeline holding the formula's weights made the reference images
    (image,) = report["images"]
    assert image["psnr"] > 40 and "](verification/reference-0.png)" in card


@pytest.fixture(scope="module")
def merged(sd15, tmp_path_factory):
    from converter.cli import main

    root, _ = sd15
    out = tmp_path_factory.mktemp("fm") / "merged"
    assert main(["merge", "--base", str(root / "base"), "--adapter", str(root / "lora.safetensors"), "--out",
                 str(out), "--no-verify"]) == 0  # fmt: skip
    return out


def edit(merged, base, folder, kind):
    shutil.copytree(merged, folder)
    f = folder / "unet" / TENSORS
    t, before = load_file(f), load_file(base / "unet" / TENSORS)
    if kind == "one perturbed tensor":
        t[Q] = t[Q] + 0.05 * t[Q].std() * torch.randn_like(t[Q])
    elif kind == "nothing merged":
        t[Q] = before[Q]
    elif kind == "an untouched tensor changed":
        key = "conv_in.weight"
        t[key] = t[key] * 1.01
        return save_file(t, f, metadata={"format": "pt"}), "unet/conv_in.weight"
    save_file(t, f, metadata={"format": "pt"})
    return None, "unet/" + Q


@pytest.mark.parametrize("kind", ["one perturbed tensor", "nothing merged", "an untouched tensor changed"])
def test_each_sabotage_fails_and_names_the_tensor(sd15, merged, tmp_path, cli, kind):
    root, _ = sd15
    _, name = edit(merged, root / "base", tmp_path / "s", kind)
    code, log, report = verify(cli, root / "base", root / "lora.safetensors", tmp_path / "s")
    assert code == 3 and report["verdict"] == "fail", log
    assert failed(report) == [name] and name in log, report["problems"]
    if kind == "nothing merged":
        assert "as if the change were not merged" in report["problems"][0], report["problems"]


def test_a_tensor_missing_from_the_merge_fails(sd15, merged, tmp_path, cli):
    root, _ = sd15
    shutil.copytree(merged, tmp_path / "s")
    f = tmp_path / "s" / "unet" / TENSORS
    t = load_file(f)
    del t["conv_out.bias"]
    save_file(t, f, metadata={"format": "pt"})
    code, log, report = verify(cli, root / "base", root / "lora.safetensors", tmp_path / "s")
    assert code == 3 and "1 tensor(s) of the base missing from the output: unet/conv_out.bias" in log


def test_scale_dropped_fails(sd15, tmp_path, cli):
    """Merged from the same factors with every alpha removed (scale 1), verified against the real file."""
    root, _ = sd15
    lora = load_file(root / "lora.safetensors")
    save({k: v for k, v in lora.items() if not k.endswith(".alpha")}, tmp_path / "noalpha.safetensors")
    assert merge(cli, root / "base", tmp_path / "noalpha.safetensors", tmp_path / "m", verify=False)[0] == 0
    code, log, report = verify(cli, root / "base", root / "lora.safetensors", tmp_path / "m")
    assert code == 3 and report["verdict"] == "fail", log
    assert referee(report) == "published formula"
    assert {c for c, v in report["tensors"]["groups"].items() if v["failed"]} == {"unet", "text_encoder"}


def test_include_exclude_is_refereed_on_what_was_admitted(sd15, tmp_path, cli):
    root, _ = sd15
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"base: {root / 'base'}\nadapters:\n  - source: {root / 'lora.safetensors'}\n    exclude: ['^text_encoder/']\n"
    )
    code, out, err = cli("merge", "--recipe", recipe, "--out", tmp_path / "m", verify=True)
    assert code == 0, out + err
    report = report_of(tmp_path / "m")
    groups = report["tensors"]["groups"]
    assert report["verdict"] == "pass" and {g for g, c in groups.items() if c["changed"]} == {"unet"}, report
    assert "include/exclude" in report["tensors"]["referee"]["detail"]


@pytest.mark.parametrize("name", ["loha_linear_and_conv", "lokr_decomposed_and_conv", "full_diff_and_bias",
                                  "locon_tucker_mid"])  # fmt: skip
def test_lycoris_files_diffusers_refuses_are_refereed_by_the_formula(sd15, tmp_path, cli, name):
    root, _ = sd15
    tensors, _ = CASES[name]()
    save(tensors, tmp_path / "lyco.safetensors", {"ss_network_module": "lycoris.kohya"})
    code, log = merge(cli, root / "base", tmp_path / "lyco.safetensors", tmp_path / "m", "--dtype", "bfloat16")
    assert code == 0, log
    report = report_of(tmp_path / "m")
    assert report["verdict"] == "pass" and referee(report) == "published formula", report
    # the merge at weight 1 is not the file at weight 0.5 (the weight, like alpha, is in the reference)
    code, log, report = verify(cli, root / "base", tmp_path / "lyco.safetensors", tmp_path / "m", "--weight", "0.5")
    assert code == 3 and report["verdict"] == "fail", log


@pytest.mark.parametrize("case", ["dora_output_axis", "dora_input_axis_old_files"])
def test_lycoris_dora_is_refereed_by_the_formula_and_a_sabotage_fails(sd15, tmp_path, cli, case):
    """LyCORIS DoRA (dora_scale, which diffusers drops): W' = (W + ΔW) · m / ‖W + ΔW‖ along the axis the scale's
    shape says, by the formula; the same merge with the magnitudes ignored (plain LoRA) fails."""
    root, _ = sd15
    tensors, _ = CASES[case]()
    save(tensors, tmp_path / "dora.safetensors", {"ss_network_module": "lycoris.kohya"})
    code, log = merge(cli, root / "base", tmp_path / "dora.safetensors", tmp_path / "m")
    report = report_of(tmp_path / "m")
    assert code == 0 and report["verdict"] == "pass" and referee(report) == "published formula", log
    assert "dora_scale" in report["tensors"]["referee"]["detail"] and report["tensors"]["worst"]["kind"] == "DoRA"
    plain = {k: v for k, v in tensors.items() if not k.endswith(".dora_scale")}
    save(plain, tmp_path / "plain.safetensors", {"ss_network_module": "lycoris.kohya"})
    assert merge(cli, root / "base", tmp_path / "plain.safetensors", tmp_path / "p", verify=False)[0] == 0
    code, log, report = verify(cli, root / "base", tmp_path / "dora.safetensors", tmp_path / "p")
    assert code == 3 and report["tensors"]["failed"] == report["tensors"]["changed"], log


def test_single_file_base_is_refereed_and_a_sabotage_fails(sd15, tmp_path, cli):
    root, models = sd15
    single = save(to_ldm(models, "sd"), tmp_path / "sd15.safetensors")
    code, log = merge(cli, single, root / "lora.safetensors", tmp_path / "m")
    assert code == 0, log
    report = report_of(tmp_path / "m")
    assert report["verdict"] == "pass" and report["tensors"]["changed"] > 100, report
    assert "single-file base's tensors are not named as diffusers' modules" in report["tensors"]["referee"]["detail"]
    assert "from_single_file cannot load the base here" in report["behaviour_skipped"]  # offline, no config
    f = tmp_path / "m" / "sd15.safetensors"
    t = load_file(f)
    key = next(k for k in sorted(t) if "input_blocks.1.1" in k and k.endswith("attn1.to_q.weight"))
    t[key] = t[key] * 1.001
    save_file(t, f)
    code, log, report = verify(cli, single, root / "lora.safetensors", tmp_path / "m")
    assert code == 3 and failed(report) == [key], log


def test_unet_only_lora_with_one_alpha_still_goes_to_diffusers(sd15, tmp_path, cli):
    """The fallback is a fallback: a file diffusers reads right is refereed by diffusers (with images)."""
    root, models = sd15
    lora = kohya_lora(kohya_modules(models["unet"], "lora_unet", UNET_TARGETS), alpha=None)
    save(lora, tmp_path / "plain.safetensors")
    code, log = merge(cli, root / "base", tmp_path / "plain.safetensors", tmp_path / "m")
    report = report_of(tmp_path / "m")
    assert code == 0 and report["verdict"] == "pass" and "diffusers" in report["reference"], log
    assert referee(report) == "diffusers" and report["images"] and read_component(tmp_path / "m", "unet")


def test_single_file_merge_through_from_single_file_passes_with_images_and_a_sabotage_fails(sd15, tmp_path, cli):
    """With the diffusers config at hand, diffusers itself loads base and merge (`from_single_file`) and its
    loader applies the adapter: the generation check, images included (a one-alpha file diffusers reads right)."""
    root, models = sd15
    single = save(to_ldm(models, "sd"), tmp_path / "sd15.safetensors")
    lora = kohya_lora(kohya_modules(models["unet"], "lora_unet", UNET_TARGETS), alpha=None)
    save(lora, tmp_path / "plain.safetensors")
    config = ("--single-file-config", root / "base")
    code, log = merge(cli, single, tmp_path / "plain.safetensors", tmp_path / "m", *config)
    assert code == 0, log
    report = report_of(tmp_path / "m")
    assert report["verdict"] == "pass" and "from_single_file" in report["reference"], report
    assert report["images"] and report["output_dtype"] == "F32"
    assert "](verification/merged-0.png)" in (tmp_path / "m" / "README.md").read_text()
    f = tmp_path / "m" / "sd15.safetensors"
    t = load_file(f)
    key = next(k for k in sorted(t) if "input_blocks.1.1" in k and k.endswith("attn1.to_q.weight"))
    t[key] = t[key] + 0.05 * t[key].std() * torch.randn_like(t[key])
    save_file(t, f)
    code, log, report = verify(cli, single, tmp_path / "plain.safetensors", tmp_path / "m", *config)
    assert code == 3 and report["verdict"] == "fail" and failed(report) == [key], log
    behaviour = verify_behaviour(tmp_path / "m", single, tmp_path / "plain.safetensors", root / "base")
    assert behaviour.behaviour.first_disagreeing_module.module.startswith("unet.down_blocks.0.attentions.0")


def verify_behaviour(folder, base, adapter, config):
    """The behavioural comparison by itself (diffusers' from_single_file and loader)."""
    from converter.engine.recipe import AdapterSpec, Recipe
    from converter.verification import verify

    recipe = Recipe(base=str(base), adapters=[AdapterSpec(str(adapter))])
    return verify(folder, recipe, single_file_config=str(config), log=lambda _line: None, proofs=("behaviour",))


def test_an_sd3_merge_is_proven_by_diffusers_tensor_by_tensor_and_by_its_behaviour(tmp_path, cli):
    """SD3: diffusers loads the LoRA (its own save, lora_alpha in lora_adapter_metadata), so it referees the
    tensors, and its transformer's output is compared on seeded inputs."""
    import copy

    from diffusers.loaders.lora_pipeline import SD3LoraLoaderMixin
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from test_community_sd3 import tiny_sd3

    model = tiny_sd3()
    model.save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    config = LoraConfig(r=2, lora_alpha=6, target_modules=["to_q", "to_k", "to_v", "ff.net.0.proj"],
                        init_lora_weights=False)  # fmt: skip
    trained = copy.deepcopy(model)
    trained.add_adapter(config)
    SD3LoraLoaderMixin.save_lora_weights(
        tmp_path / "lora",
        transformer_lora_layers=get_peft_model_state_dict(trained),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    adapter = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    code, log = merge(cli, tmp_path / "pipe", adapter, tmp_path / "m")
    assert code == 0, log
    report = report_of(tmp_path / "m")
    assert report["verdict"] == "pass" and report["behaviour_skipped"] is None, report["behaviour_skipped"]
    assert list(report["components"]) == ["transformer"]
    assert referee(report) == "diffusers" and report["tensors"]["groups"]["transformer"]["changed"] > 0
    code, log, report = verify(cli, tmp_path / "pipe", adapter, tmp_path / "m", "--weight", "0.5")
    assert code == 3 and referee(report) == "diffusers", log
