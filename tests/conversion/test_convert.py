"""`converter convert`: kohya ↔ PEFT ↔ diffusers without merging.

Oracles: ΔW of every module through converter's own patch math (exact for round trips), diffusers' own
`load_lora_weights` on tiny SD1.5 models from configs, and PEFT's `PeftModel` on a CLIP text encoder.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from convert_helpers import assert_same_deltas, deltas, diffusers_load_lora_weights
from diffusion_helpers import (
    TE_TARGETS,
    UNET_TARGETS,
    assert_matches,
    kohya_lora,
    kohya_modules,
    make_pipeline,
    read_component,
    save,
    tiny_clip,
)
from safetensors import safe_open
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd15") / "base"
    return folder, make_pipeline(folder, "sd15")


def sd15_kohya(models, drop_alpha: bool = True) -> dict:
    """kohya LoRA + LoCon (3x3 convs) on UNet and text encoder, alphas differing per module, one missing."""
    mods = kohya_modules(models["unet"], "lora_unet", UNET_TARGETS, convs=True)
    mods.update(kohya_modules(models["text_encoder"], "lora_te", TE_TARGETS))
    lora = kohya_lora(mods, rank=4, conv_rank=2)
    if drop_alpha:
        del lora[sorted(k for k in lora if k.endswith(".alpha"))[0]]
    return lora


def test_kohya_round_trips_through_peft_and_diffusers_exactly(sd15, tmp_path, cli):
    base, models = sd15
    lora = sd15_kohya(models)
    assert any(v.dim() == 4 and v.shape[-1] == 3 for v in lora.values())  # conv LoRAs included
    src = save(lora, tmp_path / "lora.safetensors")
    original = deltas(src, base)

    code, out, err = cli("convert", "--adapter", src, "--to", "peft", "--out", tmp_path / "peft", "--base", base)
    assert code == 0, err
    assert {p.name for p in (tmp_path / "peft").iterdir()} == {"unet", "text_encoder"}  # one PEFT folder each
    config = json.loads((tmp_path / "peft" / "unet" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["alpha_pattern"] and config["rank_pattern"]
    assert config["base_model_name_or_path"] is None  # a local base path is never recorded
    for component in ("unet", "text_encoder"):
        assert_same_deltas(
            deltas(tmp_path / "peft" / component, base / component),
            {k.split("/", 1)[1]: v for k, v in original.items() if k.startswith(f"{component}/")},
        )
    # PEFT itself on the UNet (3x3 conv LoRAs included) agrees with our merge of the original kohya file
    import copy

    from peft import PeftModel

    reference = PeftModel.from_pretrained(copy.deepcopy(models["unet"]), tmp_path / "peft" / "unet").merge_and_unload()
    assert cli("merge", "--base", base, "--adapter", src, "--out", tmp_path / "m")[0] == 0
    merged = read_component(tmp_path / "m", "unet")
    assert_matches(
        merged, {k: v for k, v in reference.state_dict().items() if k in merged}, read_component(base, "unet")
    )

    code, _, err = cli("convert", "--adapter", tmp_path / "peft" / "unet", "--to", "kohya", "--out",
                       tmp_path / "back_unet.safetensors", "--component", "unet")  # fmt: skip
    assert code == 0, err
    back = load_file(tmp_path / "back_unet.safetensors")
    for key, value in back.items():  # same names, same factors, the real alphas (missing alpha: = rank)
        if key.endswith(".alpha"):
            stem = key[: -len(".alpha")]
            expected = lora.get(key, torch.tensor(float(lora[f"{stem}.lora_down.weight"].shape[0])))
            assert float(value) == float(expected), key
        else:
            assert torch.equal(value, lora[key]), key
    assert {k for k in lora if k.startswith("lora_unet_") and not k.endswith(".alpha")} <= back.keys()

    code, _, err = cli("convert", "--adapter", src, "--to", "diffusers", "--out", tmp_path / "dif", "--base", base)
    assert code == 0, err
    dif = tmp_path / "dif" / "pytorch_lora_weights.safetensors"
    assert_same_deltas(deltas(dif, base), original)
    # PEFT → diffusers needs no base (dotted names), only which component the PEFT folder is for
    code, _, err = cli("convert", "--adapter", tmp_path / "peft" / "unet", "--to", "diffusers", "--out",
                       tmp_path / "dif_unet", "--component", "unet")  # fmt: skip
    assert code == 0, err
    unet_only = {k: v for k, v in original.items() if k.startswith("unet/")}
    assert_same_deltas(deltas(tmp_path / "dif_unet" / "pytorch_lora_weights.safetensors", base), unet_only)
    code, _, err = cli("convert", "--adapter", dif, "--to", "kohya", "--out", tmp_path / "back.safetensors")
    assert code == 0, err
    assert_same_deltas(deltas(tmp_path / "back.safetensors", base), original)
    back = load_file(tmp_path / "back.safetensors")
    assert set(back) == set(lora) | {k for k in back if k.endswith(".alpha")}  # kohya's own names come back
    with safe_open(tmp_path / "back.safetensors", "pt") as f:
        assert "per module" in f.metadata()["converter_alphas"]
    # half-precision files stay half precision: factors are copied, not recomputed
    half = save({k: v.half() if v.dim() else v for k, v in lora.items()}, tmp_path / "half.safetensors")
    assert cli("convert", "--adapter", half, "--to", "diffusers", "--out", tmp_path / "h", "--base", base)[0] == 0
    assert {v.dtype for v in load_file(tmp_path / "h" / "pytorch_lora_weights.safetensors").values()} == {torch.float16}


def test_converted_diffusers_file_loads_in_diffusers_like_our_merge_of_the_original(sd15, tmp_path, cli):
    """diffusers' load_lora_weights reads the per-module alphas from lora_adapter_metadata (rank/alpha patterns);
    its fused weights equal converter's merge of the original kohya file."""
    base, models = sd15
    src = save(sd15_kohya(models), tmp_path / "lora.safetensors")
    assert cli("convert", "--adapter", src, "--to", "diffusers", "--out", tmp_path / "dif", "--base", base)[0] == 0
    reference = diffusers_load_lora_weights(models, tmp_path / "dif", "pytorch_lora_weights.safetensors")
    assert cli("merge", "--base", base, "--adapter", src, "--out", tmp_path / "m")[0] == 0
    for component in ("unet", "text_encoder"):
        ours, before = read_component(tmp_path / "m", component), read_component(base, component)
        assert_matches(ours, reference[component], before)


def test_kohya_text_encoder_lora_to_peft_loads_in_peft_model(tmp_path, cli):
    from peft import PeftModel
    from transformers import CLIPTextModel

    clip = tiny_clip(24)
    clip.save_pretrained(tmp_path / "clip")
    lora = kohya_lora(kohya_modules(clip, "lora_te", TE_TARGETS), rank=3, alpha=1.5)
    src = save(lora, tmp_path / "te.safetensors")
    code, _, err = cli(
        "convert", "--adapter", src, "--to", "peft", "--out", tmp_path / "peft", "--base", tmp_path / "clip"
    )
    assert code == 0, err
    model = PeftModel.from_pretrained(CLIPTextModel.from_pretrained(tmp_path / "clip"), tmp_path / "peft")
    reference = {k: v for k, v in model.merge_and_unload().state_dict().items()}
    assert cli("merge", "--base", tmp_path / "clip", "--adapter", src, "--out", tmp_path / "m")[0] == 0
    ours, before = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "clip" / "model.safetensors")
    assert_matches(ours, {k: reference[k] for k in ours}, before)


def test_peft_to_kohya_writes_the_real_alpha(tmp_path, cli):
    """diffusers' convert_state_dict_to_kohya writes alpha = rank (docs/FORMATS.md §4); the real lora_alpha and
    alpha_pattern must survive, checked against PEFT's own merge."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import CLIPTextModel

    clip = tiny_clip(24)
    clip.save_pretrained(tmp_path / "clip")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1"], init_lora_weights=False,
                        alpha_pattern={"fc1": 3}, rank_pattern={"v_proj": 2})  # fmt: skip
    get_peft_model(CLIPTextModel.from_pretrained(tmp_path / "clip"), config).save_pretrained(tmp_path / "peft")
    code, _, err = cli("convert", "--adapter", tmp_path / "peft", "--to", "kohya", "--out", tmp_path / "k.safetensors",
                       "--component", "text_encoder")  # fmt: skip
    assert code == 0, err
    k = load_file(tmp_path / "k.safetensors")
    assert float(k["lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha"]) == 8.0
    assert float(k["lora_te_text_model_encoder_layers_0_mlp_fc1.alpha"]) == 3.0
    assert k["lora_te_text_model_encoder_layers_1_self_attn_v_proj.lora_down.weight"].shape[0] == 2
    assert_same_deltas(
        deltas(tmp_path / "k.safetensors", tmp_path / "clip"), deltas(tmp_path / "peft", tmp_path / "clip")
    )
    model = PeftModel.from_pretrained(CLIPTextModel.from_pretrained(tmp_path / "clip"), tmp_path / "peft")
    reference = model.merge_and_unload().state_dict()
    assert (
        cli("merge", "--base", tmp_path / "clip", "--adapter", tmp_path / "k.safetensors", "--out", tmp_path / "m")[0]
        == 0
    )
    ours, before = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "clip" / "model.safetensors")
    assert_matches(ours, {k: reference[k] for k in ours}, before)


def test_bad_inputs_are_one_line_errors_and_write_nothing(sd15, tmp_path, cli):
    base, models = sd15
    src = save(sd15_kohya(models), tmp_path / "lora.safetensors")
    code, _, err = cli("convert", "--adapter", src, "--to", "peft", "--out", tmp_path / "p")
    assert code == 2 and "--base" in err and "flattened" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("convert", "--adapter", src, "--to", "kohya", "--out", tmp_path / "dir")
    assert code == 2 and ".safetensors" in err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    code, _, err = cli("convert", "--adapter", src, "--to", "diffusers", "--out", tmp_path / "taken", "--base", base)
    assert code == 2 and "--force" in err
    other = tmp_path / "other"
    tiny_clip(16).save_pretrained(other)  # a model the LoRA is not for
    code, _, err = cli("convert", "--adapter", src, "--to", "diffusers", "--out", tmp_path / "d", "--base", other)
    assert code == 2 and "lands on no tensor" in err
    code, _, err = cli("convert", "--adapter", src, "--to", "kohya", "--out", tmp_path / "k.safetensors", "--rank", "0")
    assert code == 2 and "positive" in err
    code, _, err = cli("convert", "--adapter", src, "--to", "kohya", "--out", tmp_path / "k.safetensors", "--push-pr")
    assert code == 2 and "not both" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors", "other", "taken"]


def test_an_ldm_single_file_base_gives_peft_and_diffusers_files_under_diffusers_names(sd15, tmp_path, cli):
    """kohya → PEFT / diffusers against an SD 1.5 single file: the UNet is relaid in diffusers' names (PEFT on
    diffusers' UNet2DConditionModel and diffusers' load_lora_weights read no other), the text encoder named as
    transformers 5 loads the CLIPTextModel diffusers makes of it; both give our merge of the kohya file."""
    from peft import PeftModel
    from test_community_sd import to_ldm

    base, models = sd15
    single = save(to_ldm(models, "sd"), tmp_path / "sd15.safetensors")
    src = save(sd15_kohya(models), tmp_path / "lora.safetensors")
    for to in ("peft", "diffusers"):
        code, _, err = cli("convert", "--adapter", src, "--to", to, "--out", tmp_path / to, "--base", single)
        assert code == 0, err
    with_diffusers = diffusers_load_lora_weights(models, tmp_path / "diffusers", "pytorch_lora_weights.safetensors")
    assert cli("merge", "--base", base, "--adapter", src, "--out", tmp_path / "m")[0] == 0
    for component in ("unet", "text_encoder"):
        peft = PeftModel.from_pretrained(copy.deepcopy(models[component]), tmp_path / "peft" / component)
        with_peft = peft.merge_and_unload().state_dict()
        ours, before = read_component(tmp_path / "m", component), read_component(base, component)
        assert_matches(ours, {k: with_peft[k] for k in ours}, before)
        assert_matches(ours, with_diffusers[component], before)


def test_a_text_encoder_saved_by_transformers_4_gets_the_loaded_models_names_in_peft_and_diffusers(tmp_path, cli):
    """The public SD / SDXL pipelines' CLIPTextModel was saved by transformers 4 (every key `text_model.*`);
    transformers 5 loads it without that level, CLIPTextModelWithProjection (text_encoder_2) with it. Both outputs
    must name the loaded modules: PEFT (PeftModel on each component) and diffusers' load_lora_weights (which reads
    target_modules from the file's metadata) then give our merge of the kohya file, component by component."""
    from peft import PeftModel
    from test_community_sd import sdxl_lora

    base = tmp_path / "sdxl"
    models = make_pipeline(base, "sdxl")
    te = base / "text_encoder" / "model.safetensors"
    save({f"text_model.{k}": v for k, v in load_file(te).items()}, te, metadata={"format": "pt"})
    src = save(sdxl_lora(models, ldm=False), tmp_path / "lora.safetensors")
    for to in ("peft", "diffusers"):
        code, _, err = cli("convert", "--adapter", src, "--to", to, "--out", tmp_path / to, "--base", base)
        assert code == 0, err
    config = json.loads((tmp_path / "peft" / "text_encoder" / "adapter_config.json").read_text())
    assert "encoder.layers.0.self_attn.q_proj" in config["target_modules"]
    with_peft = {c: PeftModel.from_pretrained(copy.deepcopy(models[c]), tmp_path / "peft" / c).merge_and_unload()
                 .state_dict() for c in ("unet", "text_encoder", "text_encoder_2")}  # fmt: skip
    with_diffusers = diffusers_load_lora_weights(models, tmp_path / "diffusers", "pytorch_lora_weights.safetensors",
                                                 xl=True)  # fmt: skip
    assert cli("merge", "--base", base, "--adapter", src, "--out", tmp_path / "m")[0] == 0
    for component, reference in with_peft.items():
        ours, before = (read_component(folder, component) for folder in (tmp_path / "m", base))
        if component == "text_encoder":  # our merge keeps the base's keys
            ours, before = ({k.removeprefix("text_model."): v for k, v in sd.items()} for sd in (ours, before))
        assert_matches(ours, {k: reference[k] for k in ours}, before)
        assert_matches(ours, with_diffusers[component], before)


def test_sdxl_kohya_with_sgm_names_to_diffusers_and_back_to_the_same_names(tmp_path, cli):
    """sd-scripts' SDXL files name UNet modules by their SGM keys (lora_unet_input_blocks_4_1_...): on a diffusers
    folder they become diffusers names (diffusers' XL load_lora_weights agrees with our merge of the original), and
    with the SGM single file as the base they flatten back to exactly the original names."""
    from test_community_sd import sdxl_lora, to_ldm

    base = tmp_path / "sdxl"
    models = make_pipeline(base, "sdxl")
    lora = sdxl_lora(models, ldm=True)
    assert any(k.startswith("lora_unet_input_blocks_4_1_") for k in lora)
    src = save(lora, tmp_path / "lora.safetensors")
    code, _, err = cli("convert", "--adapter", src, "--to", "diffusers", "--out", tmp_path / "d", "--base", base)
    assert code == 0, err
    converted = load_file(tmp_path / "d" / "pytorch_lora_weights.safetensors")
    assert any(k.startswith("unet.down_blocks.1.attentions.0.") for k in converted)
    assert any(k.startswith("text_encoder_2.") for k in converted)
    reference = diffusers_load_lora_weights(models, tmp_path / "d", "pytorch_lora_weights.safetensors", xl=True)
    assert cli("merge", "--base", base, "--adapter", src, "--out", tmp_path / "m")[0] == 0
    for component in ("unet", "text_encoder", "text_encoder_2"):
        ours, before = read_component(tmp_path / "m", component), read_component(base, component)
        assert_matches(ours, reference[component], before)

    single = save(to_ldm(models, "sdxl"), tmp_path / "sdxl.safetensors")
    unet_te1 = {k: v for k, v in lora.items() if not k.startswith("lora_te2_")}
    src1 = save(unet_te1, tmp_path / "unet_te1.safetensors")
    assert cli("convert", "--adapter", src1, "--to", "diffusers", "--out", tmp_path / "d1", "--base", base)[0] == 0
    back = tmp_path / "back.safetensors"
    code, _, err = cli("convert", "--adapter", tmp_path / "d1", "--to", "kohya", "--out", back, "--base", single)
    assert code == 0, err
    back_sd = load_file(back)
    assert back_sd.keys() == unet_te1.keys()
    assert all(torch.equal(back_sd[k], v) for k, v in unet_te1.items())


def test_dora_moves_between_peft_and_kohya_dora_scale(tmp_path, cli):
    """PEFT's lora_magnitude_vector and LyCORIS' output-axis dora_scale are the same numbers (docs/FORMATS.md §3,
    §7): PEFT DoRA → kohya → PEFT keeps every tensor, and PEFT itself merges the result like the original."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import CLIPTextModel

    clip = tiny_clip(24)
    clip.save_pretrained(tmp_path / "clip")
    config = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "fc2"], use_dora=True, init_lora_weights=False)
    model = get_peft_model(CLIPTextModel.from_pretrained(tmp_path / "clip"), config)
    with torch.no_grad():  # magnitudes start at ‖W‖: move them so DoRA's rescale does something
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.3)
    model.save_pretrained(tmp_path / "peft")
    k = tmp_path / "k.safetensors"
    args = ("--component", "text_encoder")
    assert cli("convert", "--adapter", tmp_path / "peft", "--to", "kohya", "--out", k, *args)[0] == 0
    kohya = load_file(k)
    assert kohya["lora_te_text_model_encoder_layers_0_self_attn_q_proj.dora_scale"].shape == (24, 1)
    code, _, err = cli("convert", "--adapter", k, "--to", "peft", "--out", tmp_path / "p2", "--base", tmp_path / "clip")
    assert code == 0, err
    first, second = (
        load_file(tmp_path / "peft" / "adapter_model.safetensors"),
        load_file(tmp_path / "p2" / "adapter_model.safetensors"),
    )
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)
    assert json.loads((tmp_path / "p2" / "adapter_config.json").read_text())["use_dora"] is True
    reference = PeftModel.from_pretrained(CLIPTextModel.from_pretrained(tmp_path / "clip"), tmp_path / "p2")
    reference = reference.merge_and_unload().state_dict()
    assert cli("merge", "--base", tmp_path / "clip", "--adapter", k, "--out", tmp_path / "m")[0] == 0
    ours, before = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "clip" / "model.safetensors")
    assert_matches(ours, {n: reference[n] for n in ours}, before)

    old = dict(kohya)  # an input-axis dora_scale (older LyCORIS/OneTrainer files) has no PEFT form
    old["lora_te_text_model_encoder_layers_0_self_attn_q_proj.dora_scale"] = torch.ones(1, 24)
    save(old, tmp_path / "old.safetensors")
    code, _, err = cli(
        "convert", "--adapter", tmp_path / "old.safetensors", "--to", "kohya", "--out", tmp_path / "o.safetensors"
    )
    assert code == 2 and "input-axis dora_scale" in err


def test_diffusers_dora_file_with_conv_to_kohya_and_back(sd15, tmp_path, cli):
    """What diffusers saves for a DoRA UNet LoRA (a 3x3 conv included, magnitude (1, out, 1, 1)): → kohya
    dora_scale (out, 1, 1, 1) → diffusers again gives the same tensors, and PEFT's merge agrees with ours."""
    import copy

    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin
    from diffusion_helpers import peft_merge
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    base, models = sd15
    unet = copy.deepcopy(models["unet"])
    config = LoraConfig(r=4, lora_alpha=12, target_modules=["to_q", "conv1"], init_lora_weights=False, use_dora=True)
    unet.add_adapter(config)
    StableDiffusionLoraLoaderMixin.save_lora_weights(
        tmp_path / "lora", unet_lora_layers=get_peft_model_state_dict(unet), unet_lora_adapter_metadata=config.to_dict()
    )
    original = load_file(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    assert any(v.dim() == 4 and k.endswith("lora_magnitude_vector") for k, v in original.items())
    k = tmp_path / "k.safetensors"
    assert cli("convert", "--adapter", tmp_path / "lora", "--to", "kohya", "--out", k)[0] == 0
    assert any(n.endswith(".dora_scale") and v.shape[1:] == (1, 1, 1) for n, v in load_file(k).items())
    assert cli("merge", "--base", base, "--adapter", k, "--out", tmp_path / "m")[0] == 0
    assert_matches(read_component(tmp_path / "m", "unet"), peft_merge(unet), read_component(base, "unet"), atol=1e-5)
    code, _, err = cli("convert", "--adapter", k, "--to", "diffusers", "--out", tmp_path / "d", "--base", base)
    assert code == 0, err
    again = load_file(tmp_path / "d" / "pytorch_lora_weights.safetensors")
    assert again.keys() == original.keys() and all(torch.equal(again[n], original[n]) for n in original)


def test_converting_imports_no_heavy_library(sd15, tmp_path):
    """`converter convert` reads headers and copies factors: transformers/peft/diffusers are never imported."""
    import subprocess
    import sys

    base, models = sd15
    src = save(sd15_kohya(models), tmp_path / "lora.safetensors")
    code = (
        "import sys; from converter.cli import main; "
        f"rc = main(['convert', '--adapter', {str(src)!r}, '--to', 'peft', '--out', {str(tmp_path / 'p')!r}, "
        f"'--base', {str(base)!r}]); "
        "heavy = [m for m in ('transformers', 'peft', 'accelerate', 'diffusers') if m in sys.modules]; "
        "print('heavy:', heavy); sys.exit(rc or (3 if heavy else 0))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "heavy: []" in run.stdout
