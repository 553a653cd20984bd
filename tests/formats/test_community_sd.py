"""Community LoRAs into Stable Diffusion 1.x / SDXL bases, with diffusers' own LoRA loader as the referee.

Bases are tiny diffusers pipeline folders built from configs, and single-file (LDM/SGM) checkpoints built from them
with key maps that diffusers' own single-file converters must turn back into the diffusers weights exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusion_helpers import (
    TE_TARGETS,
    UNET_TARGETS,
    assert_matches,
    diffusers_reference_sd,
    kohya_lora,
    kohya_modules,
    make_pipeline,
    read_component,
    save,
)

from converter.engine.keymap import DiffusionResolver, all_keymaps


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd15") / "base"
    return folder, make_pipeline(folder, "sd15")


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl") / "base"
    return folder, make_pipeline(folder, "sdxl")


def uniform_alpha(sd: dict, alpha: float) -> dict:
    """diffusers keys kohya alphas of attention projections under names PEFT never matches
    (`...processor.to_q_lora.down.weight.alpha`), so it applies the most common alpha to them: only a file with
    one alpha everywhere is a fair referee for diffusers."""
    out = {k: v for k, v in sd.items() if not k.endswith(".alpha")}
    for k in list(out):
        if k.endswith(".lora_down.weight"):
            out[k.replace(".lora_down.weight", ".alpha")] = torch.tensor(alpha)
    return out


def sd15_lora(models) -> dict:
    mods = kohya_modules(models["unet"], "lora_unet", UNET_TARGETS, convs=True)
    mods.update(kohya_modules(models["text_encoder"], "lora_te", TE_TARGETS))
    return kohya_lora(mods, rank=4, conv_rank=2)


def test_kohya_lora_and_locon_into_sd15_folder_match_diffusers(sd15, tmp_path, cli):
    base, models = sd15
    lora = uniform_alpha(sd15_lora(models), 3.0)
    assert any("_resnets_0_conv1" in k and v.dim() == 4 and v.shape[-1] == 3 for k, v in lora.items())
    save(lora, tmp_path / "lora.safetensors")
    code, out, err = cli("merge", "--base", base, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "m")
    assert code == 0, err
    reference = diffusers_reference_sd(lora, models)
    for component in ("unet", "text_encoder"):
        ours, before = read_component(tmp_path / "m", component), read_component(base, component)
        assert_matches(ours, reference[component], before)
    # the layout is kept: same files, the VAE and side files byte for byte
    files = sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())
    merged = {p.relative_to(tmp_path / "m").as_posix() for p in (tmp_path / "m").rglob("*") if p.is_file()}
    assert set(files) <= merged
    for name in ("vae/diffusion_pytorch_model.safetensors", "model_index.json", "scheduler/scheduler_config.json"):
        assert (tmp_path / "m" / name).read_bytes() == (base / name).read_bytes()
    card = (tmp_path / "m" / "README.md").read_text()  # says what it is and how to load it
    assert "library_name: diffusers" in card and "DiffusionPipeline.from_pretrained" in card
    assert "kohya-lora" in card and "| 2, 4 | 3 |" in card and "Not verified" in card
    provenance = json.loads((tmp_path / "m" / "converter_provenance.json").read_text())
    assert provenance["base"]["layout"] == "diffusers" and provenance["base"]["family"] == "sd"
    assert {f["name"] for f in provenance["base"]["files"]} >= {"unet/diffusion_pytorch_model.safetensors"}


def kohya_reference(base: dict, lora: dict, prefix_of: dict[str, str], weight: float = 1.0) -> dict:
    """sd-scripts' merge (networks/merge_lora.py): W += ratio * (up @ down) * alpha / rank, conv kxk through
    F.conv2d(down.permute(1,0,2,3), up).permute(1,0,2,3), missing alpha = rank."""
    out = {k: v.clone().double() for k, v in base.items()}
    for key in lora:
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[: -len(".lora_down.weight")]
        if name not in prefix_of:  # another component's module
            continue
        down, up = lora[key].double(), lora[f"{name}.lora_up.weight"].double()
        alpha = float(lora.get(f"{name}.alpha", torch.tensor(down.shape[0])))
        target = prefix_of[name]
        if down.dim() == 4 and down.shape[2:] != (1, 1):
            delta = torch.nn.functional.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)
        elif down.dim() == 4:
            delta = (up.squeeze(3).squeeze(2) @ down.squeeze(3).squeeze(2)).unsqueeze(2).unsqueeze(3)
        else:
            delta = up @ down
        out[target] += weight * delta * alpha / down.shape[0]
    return {k: v.float() for k, v in out.items()}


def test_per_module_alphas_and_component_weights_follow_kohya(sd15, tmp_path, cli):
    """Mixed alphas (and a missing one: scale 1) and kohya's separate UNet / text-encoder strengths."""
    base, models = sd15
    mods = kohya_modules(models["unet"], "lora_unet", UNET_TARGETS, convs=True)
    te = kohya_modules(models["text_encoder"], "lora_te", TE_TARGETS)
    lora = kohya_lora({**mods, **te}, alpha=2.0)
    dropped = sorted(k for k in lora if k.endswith(".alpha"))[0]
    del lora[dropped]
    save(lora, tmp_path / "lora.safetensors")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"base: {base}\nadapters:\n  - source: {tmp_path / 'lora.safetensors'}\n"
        "    weight: {unet: 0.75, text_encoder: -0.5}\n"
    )
    code, _, err = cli("merge", "--recipe", recipe, "--out", tmp_path / "m")
    assert code == 0, err
    for component, table, weight in (("unet", mods, 0.75), ("text_encoder", te, -0.5)):
        before = read_component(base, component)
        expected = kohya_reference(before, lora, {n: f"{p}.weight" for n, (p, _) in table.items()}, weight)
        assert_matches(read_component(tmp_path / "m", component), expected, before, atol=1e-6)


def ldm_names(unet_keys: list[str], family: str) -> dict[str, str]:
    """diffusers UNet key -> its LDM key, from the keymap's aliases (checked against diffusers' converter below)."""
    km = {k.name: k for k in all_keymaps()}[family]
    resolver = DiffusionResolver(km, {"unet": ("", {"layers_per_block": 2})}, {k: (1,) for k in unet_keys})
    out = {}
    for alias, places in resolver.dotted["unet"].items():
        (place,) = places
        if alias == place.key or alias.startswith(("down_blocks", "mid_block", "up_blocks", "conv_", "time_embedding")):
            continue
        if alias.startswith("add_embedding") or alias.startswith("output_blocks") and alias.endswith(".conv.weight"):
            pass
        out.setdefault(place.key, []).append(alias)
    result = {}
    for key, aliases in out.items():
        if len(aliases) > 1:  # upsampler: index 2 after an attention, else 1
            block = key.split(".")[1]
            has_attn = any(k.startswith(f"up_blocks.{block}.attentions.") for k in unet_keys)
            aliases = [a for a in aliases if f".{2 if has_attn else 1}.conv." in a]
        result[key] = aliases[0]
    assert set(result) == set(unet_keys)
    return result


def openclip_layout(te: dict, prefix: str) -> dict[str, torch.Tensor]:
    """An HF CLIP text encoder's layers in OpenCLIP's layout (SD2, SDXL's TE2): fused in_proj (q, k, v rows),
    out_proj, c_fc / c_proj, ln_1 / ln_2 (the names diffusers' convert_open_clip_checkpoint reads)."""
    import re

    out = {}
    renames = {
        "self_attn.out_proj": "attn.out_proj",
        "mlp.fc1": "mlp.c_fc",
        "mlp.fc2": "mlp.c_proj",
        "layer_norm1": "ln_1",
        "layer_norm2": "ln_2",
    }
    for k, v in te.items():
        m = re.search(r"encoder\.layers\.(\d+)\.(.+)", k)
        if not m:
            continue
        n, rest = m.groups()
        for d, o in renames.items():
            if rest.startswith(d + "."):
                out[f"{prefix}transformer.resblocks.{n}.{o}{rest[len(d) :]}"] = v
        if rest.startswith("self_attn.q_proj."):
            p = rest.rsplit(".", 1)[1]
            out[f"{prefix}transformer.resblocks.{n}.attn.in_proj_{p}"] = torch.cat(
                [te[k.replace("q_proj", x)] for x in ("q_proj", "k_proj", "v_proj")]
            )
    return out


def from_openclip(model, sd: dict, prefix: str) -> dict[str, torch.Tensor]:
    """diffusers' own converter back to HF names (encoder layers only, without the text_model. prefix)."""
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

    back = convert_open_clip_checkpoint(model, dict(sd), prefix=prefix)
    return {k.removeprefix("text_model."): v for k, v in back.items() if ".encoder.layers." in f".{k}"}


# family -> (keymap for the UNet names, HF text encoder prefix or None, OpenCLIP text encoders {component: prefix})
LAYOUTS = {
    "sd": ("sd", "cond_stage_model.transformer.", {}),
    "sd2": ("sd", None, {"text_encoder": "cond_stage_model.model."}),
    "sdxl": ("sdxl", "conditioner.embedders.0.transformer.", {"text_encoder_2": "conditioner.embedders.1.model."}),
}


def to_ldm(models: dict, family: str) -> dict[str, torch.Tensor]:
    """A single-file checkpoint from the diffusers models, verified with diffusers' own single-file converters."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    keymap, hf_prefix, openclip = LAYOUTS[family]
    unet = models["unet"].state_dict()
    names = ldm_names(list(unet), keymap)
    sd = {f"model.diffusion_model.{names[k]}": v for k, v in unet.items()}
    back = convert_ldm_unet_checkpoint(dict(sd), dict(models["unet"].config))
    assert set(back) == set(unet) and all(torch.equal(back[k], unet[k]) for k in unet)
    if hf_prefix:  # transformers 4 / LDM names keep text_model.
        sd.update({hf_prefix + "text_model." + k: v for k, v in models["text_encoder"].state_dict().items()})
    for component, prefix in openclip.items():
        te = models[component].state_dict()
        sd.update(openclip_layout(te, prefix))
        for k, v in from_openclip(models[component], sd, prefix).items():
            assert torch.equal(v, te[k] if k in te else te[f"text_model.{k}"]), k
    return sd


def from_ldm(sd: dict, models: dict, family: str) -> dict[str, dict[str, torch.Tensor]]:
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    keymap, hf_prefix, openclip = LAYOUTS[family]
    out = {"unet": convert_ldm_unet_checkpoint(dict(sd), dict(models["unet"].config))}
    if hf_prefix:
        hf_prefix += "text_model."
        out["text_encoder"] = {k[len(hf_prefix) :]: v for k, v in sd.items() if k.startswith(hf_prefix)}
    for component, prefix in openclip.items():
        te = models[component].state_dict()
        out[component] = {
            (k if k in te else f"text_model.{k}"): v for k, v in from_openclip(models[component], sd, prefix).items()
        }
    return out


def test_kohya_into_sd15_single_file_equals_the_folder_merge(sd15, tmp_path, cli):
    base, models = sd15
    lora = sd15_lora(models)
    save(lora, tmp_path / "lora.safetensors")
    single = save(to_ldm(models, "sd"), tmp_path / "sd15.safetensors", {"modelspec.title": "tiny"})
    assert cli("merge", "--base", single, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "s")[0] == 0
    assert cli("merge", "--base", base, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "f")[0] == 0
    assert [p.name for p in (tmp_path / "s").glob("*.safetensors")] == ["sd15.safetensors"]
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(tmp_path / "s" / "sd15.safetensors", "pt") as f:
        assert f.metadata()["modelspec.title"] == "tiny"  # the base's own metadata is kept
    merged = load_file(tmp_path / "s" / "sd15.safetensors")
    assert set(merged) == set(load_file(single))
    ours = from_ldm(merged, models, "sd")
    for component in ("unet", "text_encoder"):
        folder = read_component(tmp_path / "f", component)
        assert_matches(ours[component], folder, read_component(base, component), atol=0)


def sdxl_lora(models, ldm: bool) -> dict:
    """sd-scripts' SDXL naming: UNet modules by their LDM keys (lora_unet_input_blocks_4_1_...) or, as other tools
    write them, diffusers names; TE1 `lora_te1_`, TE2 `lora_te2_` (both HF CLIP names)."""
    unet = kohya_modules(models["unet"], "lora_unet", UNET_TARGETS, convs=True)
    if ldm:
        names = ldm_names(list(models["unet"].state_dict()), "sdxl")
        unet = {
            "lora_unet_" + names[f"{p}.weight"][: -len(".weight")].replace(".", "_"): (p, m) for p, m in unet.values()
        }
    mods = {**unet, **kohya_modules(models["text_encoder"], "lora_te1", TE_TARGETS)}
    mods.update(kohya_modules(models["text_encoder_2"], "lora_te2", TE_TARGETS))
    return kohya_lora(mods, rank=4, conv_rank=2, seed=11)


@pytest.mark.parametrize("ldm_names_in_lora", [True, False], ids=["sgm-names", "diffusers-names"])
def test_kohya_into_sdxl_folder_and_single_file_match_diffusers(sdxl, ldm_names_in_lora, tmp_path, cli):
    base, models = sdxl
    lora = uniform_alpha(sdxl_lora(models, ldm_names_in_lora), 2.0)
    assert any(k.startswith("lora_unet_input_blocks_4_1_") for k in lora) == ldm_names_in_lora
    save(lora, tmp_path / "lora.safetensors")
    assert cli("merge", "--base", base, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "f")[0] == 0
    reference = diffusers_reference_sd(lora, models, xl=True)
    for component in ("unet", "text_encoder", "text_encoder_2"):
        assert_matches(read_component(tmp_path / "f", component), reference[component], read_component(base, component))
    single = save(to_ldm(models, "sdxl"), tmp_path / "sdxl.safetensors")
    assert cli("merge", "--base", single, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "s")[0] == 0
    from safetensors.torch import load_file

    ours = from_ldm(load_file(tmp_path / "s" / "sdxl.safetensors"), models, "sdxl")
    for component in ("unet", "text_encoder", "text_encoder_2"):
        folder = read_component(tmp_path / "f", component)
        expected = {k: folder[k] for k in ours[component]}
        assert_matches(ours[component], expected, read_component(base, component), atol=0)


def test_diffusers_peft_format_with_metadata_alpha_and_dora(sd15, tmp_path, cli):
    """What diffusers itself saves: `unet.` / `text_encoder.` PEFT keys, LoraConfig in lora_adapter_metadata."""
    import copy

    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin
    from diffusion_helpers import peft_merge
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    base, models = sd15
    unet = copy.deepcopy(models["unet"])
    config = LoraConfig(
        r=4, lora_alpha=12, target_modules=["to_q", "to_v", "proj_in", "conv1"], init_lora_weights=False, use_dora=True
    )
    unet.add_adapter(config)
    layers = get_peft_model_state_dict(unet)
    StableDiffusionLoraLoaderMixin.save_lora_weights(
        tmp_path / "lora", unet_lora_layers=layers, unet_lora_adapter_metadata=config.to_dict()
    )
    file = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        assert "lora_adapter_metadata" in f.metadata() and any(".lora_magnitude_vector" in k for k in f.keys())  # noqa: SIM118
    assert cli("merge", "--base", base, "--adapter", tmp_path / "lora", "--out", tmp_path / "m")[0] == 0
    reference = peft_merge(unet)
    assert_matches(read_component(tmp_path / "m", "unet"), reference, read_component(base, "unet"), atol=1e-5)


def test_merged_denoiser_forward_equals_unmerged_lora(sd15, tmp_path, cli):
    """The diffusion counterpart of the generation check: the merged UNet's noise prediction on fixed latents,
    timestep and text conditioning equals the base UNet with the LoRA applied unmerged by diffusers/PEFT."""
    import copy

    from diffusers import UNet2DConditionModel
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin

    base, models = sd15
    lora = uniform_alpha(sd15_lora(models), 3.0)
    save(lora, tmp_path / "lora.safetensors")
    assert cli("merge", "--base", base, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "m")[0] == 0
    g = torch.Generator().manual_seed(0)
    latents, text = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 5, 24, generator=g)
    t = torch.tensor([10, 500])
    unet = copy.deepcopy(models["unet"])
    sd, alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(dict(lora))
    StableDiffusionLoraLoaderMixin.load_lora_into_unet(sd, alphas, unet)
    merged = UNet2DConditionModel.from_pretrained(tmp_path / "m" / "unet").eval()
    with torch.no_grad():
        reference = unet(latents, t, text).sample
        ours = merged(latents, t, text).sample
        bare = models["unet"](latents, t, text).sample
    assert (reference - bare).abs().max() > 1e-3
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)


def test_inspect_describes_a_kohya_file(sd15, tmp_path, cli):
    base, models = sd15
    lora = sd15_lora(models)
    save(lora, tmp_path / "lora.safetensors", {"ss_network_module": "networks.lora", "ss_base_model_version": "sd_v1"})
    code, out, err = cli("inspect", tmp_path / "lora.safetensors", "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    assert info["format"] == "kohya-lora" and info["network_module"] == "networks.lora"
    assert info["components"] == ["denoiser", "text_encoder"] and info["ranks"] == [2, 4]
    code, out, err = cli("merge", "--base", base, "--adapter", tmp_path / "lora.safetensors", "--dry-run")
    assert code == 0 and "tensors land on the base" in out and "LowRank" in out


def test_inspect_describes_diffusion_bases(sd15, tmp_path, cli):
    base, models = sd15
    code, out, err = cli("inspect", base, "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    assert info["keymap"] == "sd" and info["layout"] == "diffusers" and info["pipeline"] == "StableDiffusionPipeline"
    assert set(info["components"]) == {"unet", "text_encoder", "vae"}
    assert info["components"]["unet"] == len(models["unet"].state_dict())


def test_merging_a_community_file_imports_no_heavy_library(sd15, tmp_path):
    """`converter merge` of a kohya file into a diffusion base stays free of transformers/peft/diffusers."""
    import subprocess
    import sys

    base, models = sd15
    save(sd15_lora(models), tmp_path / "lora.safetensors", {"ss_sd_model_name": "base"})
    code = (
        "import sys; from converter.cli import main; "
        f"rc = main(['merge', '--base', {str(base)!r}, '--adapter', {str(tmp_path / 'lora.safetensors')!r}, "
        f"'--out', {str(tmp_path / 'm')!r}, '--no-verify']); "
        "heavy = [m for m in ('transformers', 'peft', 'accelerate', 'diffusers') if m in sys.modules]; "
        "print('heavy:', heavy); sys.exit(rc or (3 if heavy else 0))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "heavy: []" in run.stdout and "trained on" not in run.stdout


def test_diffusers_pipeline_and_kohya_file_from_the_hub(sd15, tmp_path):
    """A diffusers pipeline repo is fetched component by component (no fp16 variants, no .bin), a kohya file by
    its path in the repo; the merge equals the local one. The local Hub server, the real huggingface_hub client."""
    import shutil
    import subprocess
    import sys

    from converter.testing.hub import HubServer, client_env

    base, models = sd15
    repo = tmp_path / "repo"
    shutil.copytree(base, repo)
    shutil.copy(
        repo / "unet" / "diffusion_pytorch_model.safetensors",
        repo / "unet" / "diffusion_pytorch_model.fp16.safetensors",
    )
    (repo / "text_encoder" / "pytorch_model.bin").write_bytes(b"never downloaded")
    lora = save(sd15_lora(models), tmp_path / "loras" / "style.safetensors")
    server = HubServer(tmp_path / "server").start()
    try:
        server.add_user("alice", "hf_fake_alice_0123456789")
        server.seed_folder("alice/tiny-sd", repo)
        server.seed_folder("alice/style-lora", lora.parent)
        env = client_env(server, "hf_fake_alice_0123456789", tmp_path / "home")
        args = ["merge", "--base", "alice/tiny-sd", "--adapter", "alice/style-lora@main/style.safetensors"]
        run = subprocess.run(
            [sys.executable, "-m", "converter", *args, "--out", str(tmp_path / "hub"), "--no-verify"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        server.stop()
    cached = {p.name for p in (tmp_path / "home").rglob("*") if p.is_file() or p.is_symlink()}
    assert "diffusion_pytorch_model.fp16.safetensors" not in cached and "pytorch_model.bin" not in cached
    local = tmp_path / "local"
    from converter.cli import main

    assert main(["merge", "--base", str(base), "--adapter", str(lora), "--out", str(local), "--no-verify"]) == 0
    for component in ("unet", "text_encoder"):
        ours, expected = read_component(tmp_path / "hub", component), read_component(local, component)
        assert all(torch.equal(ours[k], expected[k]) for k in expected) and set(ours) == set(expected)
    recipe = (tmp_path / "hub" / "converter_recipe.yaml").read_text()
    assert "alice/tiny-sd@" in recipe and "alice/style-lora@" in recipe


def test_component_weights_on_the_command_line(sd15, tmp_path, cli):
    """`--weight unet=0,text_encoder=1` changes only the text encoder; an unknown component is refused."""
    base, models = sd15
    save(sd15_lora(models), tmp_path / "lora.safetensors")
    args = ("merge", "--base", base, "--adapter", tmp_path / "lora.safetensors")
    assert cli(*args, "--weight", "unet=0,text_encoder=1", "--out", tmp_path / "m")[0] == 0
    unet, te = read_component(tmp_path / "m", "unet"), read_component(tmp_path / "m", "text_encoder")
    assert all(torch.equal(v, read_component(base, "unet")[k]) for k, v in unet.items())
    assert any(not torch.equal(v, read_component(base, "text_encoder")[k]) for k, v in te.items())
    code, _, err = cli(*args, "--weight", "vae=1", "--out", tmp_path / "x")
    assert code == 2 and "unknown component 'vae'" in err


def test_kohya_into_sd2_single_file_with_openclip_text_encoder(sd15, tmp_path, cli):
    """SD2's single file keeps OpenCLIP (cond_stage_model.model.transformer.resblocks.N.attn.in_proj_weight):
    kohya's lora_te_..._q_proj / k_proj / v_proj land on its row thirds; equal to the diffusers-folder merge."""
    from safetensors.torch import load_file

    base, models = sd15
    lora = sd15_lora(models)
    save(lora, tmp_path / "lora.safetensors")
    single = save(to_ldm(models, "sd2"), tmp_path / "sd2.safetensors")
    code, out, err = cli("merge", "--base", single, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "s")
    assert code == 0, err
    assert cli("merge", "--base", base, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "f")[0] == 0
    ours = from_ldm(load_file(tmp_path / "s" / "sd2.safetensors"), models, "sd2")
    for component in ("unet", "text_encoder"):
        folder = read_component(tmp_path / "f", component)
        assert_matches(
            ours[component], {k: folder[k] for k in ours[component]}, read_component(base, component), atol=0
        )


def test_comfyui_output_names_the_ldm_keys_and_merges_like_the_kohya_file(sd15, tmp_path, cli):
    """`convert --to comfyui` from a diffusers folder: the UNet's modules under the LDM keys ComfyUI's model holds
    (diffusion_model.input_blocks...), the text encoder's under kohya's names, the scale folded into lora_B; merged
    into the LDM single file it gives what the kohya file gives."""
    from safetensors.torch import load_file

    base, models = sd15
    lora = save(sd15_lora(models), tmp_path / "lora.safetensors")
    out = tmp_path / "comfy.safetensors"
    code, log, err = cli("convert", "--adapter", lora, "--to", "comfyui", "--out", out, "--base", base)
    assert code == 0, err
    assert "ΔW identical" in log or "within float32 rounding" in log, log
    keys = load_file(out)
    unet = {k for k in keys if k.startswith("diffusion_model.")}
    assert unet and all(k.startswith(("diffusion_model.input_blocks.", "diffusion_model.middle_block.",
                                      "diffusion_model.output_blocks.")) for k in unet), sorted(unet)[:3]  # fmt: skip
    assert not any(k.endswith(".alpha") for k in unet) and any(k.startswith("lora_te_") for k in keys)
    single = save(to_ldm(models, "sd"), tmp_path / "sd15.safetensors")
    for adapter, name in ((lora, "k"), (out, "c")):
        assert cli("merge", "--base", single, "--adapter", adapter, "--out", tmp_path / name)[0] == 0
    ours, theirs = load_file(tmp_path / "c" / "sd15.safetensors"), load_file(tmp_path / "k" / "sd15.safetensors")
    for k, v in theirs.items():
        torch.testing.assert_close(ours[k], v, atol=1e-6, rtol=1e-6)
