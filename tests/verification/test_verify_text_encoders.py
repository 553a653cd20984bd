"""diffusers referees the text encoders of a diffusion merge too, on the layouts community files are made for.

Tiny SD 1.5, SDXL, SD3 and Flux pipeline folders whose CLIPTextModel files keep the `text_model.` prefix every
checkpoint saved before transformers 5 has (transformers 5 drops it on load, so the model's module paths are not
the files' tensor names), with a kohya file and a diffusers-format file (PEFT's layers saved by diffusers'
save_lora_weights, text-encoder keys as transformers 4 named them) that touch the denoiser and every text encoder
diffusers loads a LoRA for. The right merge passes with diffusers as the referee of every tensor; one text-encoder
module and one denoiser module left unmerged each exit 3 naming the tensor. Where the pipeline's loader does not
read a file whole, diffusers still referees every part it reads: kohya SD3's CLIP-L and OpenCLIP-G modules through
diffusers' own kohya text-encoder conversion; the parts no diffusers code reads (T5 `lora_te3_` / OneTrainer's
`lora_te2_` of Flux, SD3's T5 and its kohya MMDiT, Qwen-Image's LLM text encoder) are refereed by the published
formula, each tensor labelled; per-module alphas, which diffusers' text-encoder loader ignores in a whole file,
are read one alpha at a time.
Also: a diffusers file saved under transformers 5 on the same base, and PEFT folders per component as PEFT saved
them under transformers 4 (a modules_to_save layer norm included), refereed by PEFT. Merges are made once per
module; each check is the tensor proof alone (`converter verify --proof tensors`).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusion_helpers import TE_TARGETS, UNET_TARGETS, kohya_lora, kohya_modules, make_pipeline, save, tiny_clip
from model_helpers import shown
from safetensors.torch import load_file, save_file

DENOISER = {"sd15": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer"}
# the text encoders diffusers' loader of each pipeline injects a LoRA into (its _lora_loadable_modules)
LOADED_ENCODERS = {
    "sd15": ("text_encoder",),
    "sdxl": ("text_encoder", "text_encoder_2"),
    "sd3": ("text_encoder", "text_encoder_2"),
    "flux": ("text_encoder",),
}
TARGETS = {"unet": ["to_q", "to_v", "proj_in", "conv1"],
           "transformer": ["to_q", "to_k", "to_out.0", "add_q_proj", "proj_mlp"]}  # fmt: skip
CASES = [(kind, fmt) for kind in DENOISER for fmt in ("kohya", "diffusers")]
T5 = {"sd3": "text_encoder_3", "flux": "text_encoder_2"}
T5_PREFIX = {"kohya+t5": "lora_te3", "kohya+t5-te2": "lora_te2"}  # sd-scripts' T5 prefix; OneTrainer's on Flux
# the components whose modules no diffusers code reads, refereed by the formula (diffusers referees the rest)
FORMULA = {("sd3", "kohya"): ("transformer",), ("sd3", "kohya+t5"): ("text_encoder_3", "transformer"),
           ("flux", "kohya+t5"): ("text_encoder_2",), ("flux", "kohya+t5-te2"): ("text_encoder_2",)}  # fmt: skip
UNREAD = {
    ("sd3", "kohya"): "lora_unet_",
    ("sd3", "kohya+t5"): "lora_te3_, lora_unet_",
    ("flux", "kohya+t5"): "lora_te3_",
    ("flux", "kohya+t5-te2"): "lora_te2_",
}  # the parts, as the note says
# T5 modules beside CLIP's; a diffusers file saved under transformers 5 (no `text_model.`) on the same base; PEFT
# folders per component (the PEFT referee)
MORE = [("sd3", "kohya+t5"), ("flux", "kohya+t5"), ("flux", "kohya+t5-te2"), ("sd15", "diffusers-tf5"),
        ("sd15", "peft")]  # fmt: skip


def legacy_names(component: Path) -> None:
    """A CLIPTextModel's file as transformers 4 wrote it (every SD 1.5 / SDXL / Flux checkpoint on the Hub)."""
    f = component / "model.safetensors"
    save_file({f"text_model.{k}": v for k, v in load_file(f).items()}, f, metadata={"format": "pt"})


def make_base(folder: Path, kind: str) -> dict:
    if kind in ("sd15", "sdxl"):
        models = make_pipeline(folder, kind)
    else:
        from test_community_flux import tiny_flux, tiny_t5
        from test_community_sd3 import tiny_sd3

        if kind == "sd3":  # CLIP-L and OpenCLIP-G, both with their projection, and T5
            clip_l, clip_g = tiny_clip(12, projection=True, seed=2), tiny_clip(12, projection=True, seed=3)
            models = {"transformer": tiny_sd3(), "text_encoder": clip_l, "text_encoder_2": clip_g,
                      "text_encoder_3": tiny_t5()}  # fmt: skip
        else:
            models = {"transformer": tiny_flux(), "text_encoder": tiny_clip(12), "text_encoder_2": tiny_t5()}
        index = {"_class_name": "StableDiffusion3Pipeline" if kind == "sd3" else "FluxPipeline"}
        for name, model in models.items():
            model.save_pretrained(folder / name)
            index[name] = ["diffusers" if name == "transformer" else "transformers", type(model).__name__]
        (folder / "model_index.json").write_text(json.dumps(index))
    for name, model in models.items():
        if type(model).__name__ == "CLIPTextModel":
            legacy_names(folder / name)
    return models


def uniform(lora: dict, alpha: float) -> dict:
    """One alpha everywhere (diffusers ignores kohya's per-module alphas of some modules: not a fair referee)."""
    from test_community_sd import uniform_alpha

    return uniform_alpha(lora, alpha)


def kohya_file(kind: str, models: dict) -> dict:
    """sd-scripts' names: lora_unet_* for the denoiser (SGM names for SDXL, MMDiT for SD3, BFL for Flux) and
    lora_te_ / lora_te1_ / lora_te2_ for the CLIP text encoders (transformers 4 paths, `text_model.` included)."""

    def te(name: str, prefix: str) -> dict:
        return kohya_modules(models[name], prefix, TE_TARGETS)

    if kind == "sd15":
        unet = kohya_modules(models["unet"], "lora_unet", UNET_TARGETS, convs=True)
        return uniform(kohya_lora(unet | te("text_encoder", "lora_te")), 2.0)
    if kind == "sdxl":
        from test_community_sd import sdxl_lora

        return uniform(sdxl_lora(models, ldm=True), 2.0)
    if kind == "sd3":
        from test_community_sd3 import kohya_sd3_lora, to_original

        mmdit = kohya_sd3_lora(to_original(models["transformer"].state_dict()))
        mmdit = {k: v for k, v in mmdit.items() if "joint_blocks_1_context_block_adaLN" not in k}  # refused: swapped
        return mmdit | uniform(kohya_lora(te("text_encoder", "lora_te1") | te("text_encoder_2", "lora_te2")), 1.5)
    from test_community_flux import kohya_flux_lora

    clip = uniform(kohya_lora(te("text_encoder", "lora_te1")), 2.0)
    return kohya_flux_lora(models["transformer"], with_linear1=False) | clip


def t5_modules(prefix: str = "lora_te3") -> dict:
    """sd-scripts' T5 modules (lora_te3_, T5's own capitalisation; OneTrainer's Flux files say lora_te2_), which
    no diffusers converter reads."""
    g, out = torch.Generator().manual_seed(6), {}
    for name, (rows, cols) in {f"{prefix}_encoder_block_0_layer_0_SelfAttention_q": (12, 12),
                               f"{prefix}_encoder_block_1_layer_1_DenseReluDense_wi_0": (24, 12)}.items():  # fmt: skip
        out[f"{name}.lora_down.weight"] = torch.randn(2, cols, generator=g)
        out[f"{name}.lora_up.weight"] = torch.randn(rows, 2, generator=g)
        out[f"{name}.alpha"] = torch.tensor(2.0)
    return out


def diffusers_file(kind: str, models: dict, folder: Path, legacy: bool = True) -> Path:
    """What diffusers' training scripts save: PEFT layers on the denoiser and each text encoder its loader reads,
    by save_lora_weights with each LoraConfig in the metadata; text-encoder keys as transformers 4 named them
    (`legacy`) or as transformers 5 does."""
    from diffusers.loaders import lora_pipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    mixin = {"sd15": "StableDiffusionLoraLoaderMixin", "sdxl": "StableDiffusionXLLoraLoaderMixin",
             "sd3": "SD3LoraLoaderMixin", "flux": "FluxLoraLoaderMixin"}[kind]  # fmt: skip
    denoiser = DENOISER[kind]
    layers = {}
    g = torch.Generator().manual_seed(8)
    for name in (denoiser, *LOADED_ENCODERS[kind]):
        model = copy.deepcopy(models[name])
        config = LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS.get(name, ["q_proj", "v_proj", "fc1"]))
        inject_adapter_in_model(config, model)
        with torch.no_grad():
            for module in model.modules():
                for b in getattr(module, "lora_B", {}).values():
                    b.weight.copy_(torch.randn(b.weight.shape, generator=g) * 0.2)
        state = get_peft_model_state_dict(model)
        if legacy and type(model).__name__ == "CLIPTextModel":
            state = {f"text_model.{k}": v for k, v in state.items()}
        layers |= {f"{name}_lora_layers": state, f"{name}_lora_adapter_metadata": config.to_dict()}
    getattr(lora_pipeline, mixin).save_lora_weights(folder, **layers)
    return folder / "pytorch_lora_weights.safetensors"


def peft_folders(kind: str, models: dict, folder: Path) -> Path:
    """PEFT folders per component (`unet/`, `text_encoder/` ...: what diffusers' older training scripts and
    kohya-to-PEFT converters write), saved by PEFT; text-encoder keys as PEFT wrote them under transformers 4."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(9)
    for name in (DENOISER[kind], *LOADED_ENCODERS[kind]):
        whole = ["final_layer_norm"] if name.startswith("text_encoder") else None  # saved whole: a replacement
        config = LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS.get(name, ["q_proj", "v_proj", "fc1"]),
                            modules_to_save=whole)  # fmt: skip
        model = get_peft_model(copy.deepcopy(models[name]), config)
        with torch.no_grad():
            for module in model.modules():
                for b in getattr(module, "lora_B", {}).values():
                    b.weight.copy_(torch.randn(b.weight.shape, generator=g) * 0.2)
                if isinstance(copies := getattr(module, "modules_to_save", None), torch.nn.ModuleDict):
                    for copied in copies.values():
                        copied.weight.mul_(1.5)
        model.save_pretrained(folder / name)
        if type(models[name]).__name__ == "CLIPTextModel":
            f = folder / name / "adapter_model.safetensors"
            save_file({k.replace(".model.", ".model.text_model.", 1): v for k, v in load_file(f).items()}, f)
    return folder


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """(base folder, merged folder) per (layout, format), made once each: our merge, not verified."""
    from converter.cli import main

    bases: dict[str, tuple[Path, dict]] = {}
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(kind: str, fmt: str) -> tuple[Path, Path]:
        if (kind, fmt) in made:
            return made[kind, fmt]
        if kind not in bases:
            folder = tmp_path_factory.mktemp(kind) / "base"
            bases[kind] = folder, make_base(folder, kind)
        base, models = bases[kind]
        root = tmp_path_factory.mktemp(f"{kind}-{fmt}")
        if fmt.startswith("diffusers"):
            adapter = diffusers_file(kind, models, root / "lora", legacy=fmt == "diffusers")
        elif fmt == "peft":
            adapter = peft_folders(kind, models, root / "peft")
        else:
            lora = kohya_file(kind, models) | (t5_modules(T5_PREFIX[fmt]) if fmt in T5_PREFIX else {})
            if fmt == "kohya-alphas":  # CLIP-L and OpenCLIP-G only, alphas 2, 3, 4 ... by module
                lora = kohya_lora(kohya_modules(models["text_encoder"], "lora_te1", TE_TARGETS)
                                  | kohya_modules(models["text_encoder_2"], "lora_te2", TE_TARGETS))  # fmt: skip
            adapter = save(lora, root / "lora.safetensors")
        args = ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(root / "m"), "--no-verify"]
        assert main(args) == 0
        made[kind, fmt] = base, root / "m"
        return made[kind, fmt]

    return get


def referee(kind: str, fmt: str) -> str:
    return "PEFT" if fmt == "peft" else "diffusers"


def proof(cli, folder: Path, tmp_path: Path) -> tuple[int, dict, str]:
    """`converter verify --proof tensors`: exit code, JSON report, what it printed."""
    code, out, err = cli("verify", folder, "--proof", "tensors", "--report", tmp_path / "report.json")
    assert (tmp_path / "report.json").is_file(), f"exit {code}: {out}{err}"
    return code, json.loads((tmp_path / "report.json").read_text()), out + err


def touched(kind: str, fmt: str) -> tuple[str, ...]:
    """The components the file changes: the denoiser and the text encoders (T5 too, in the kohya+t5 cases)."""
    return (DENOISER[kind], *LOADED_ENCODERS[kind], *((T5[kind],) if fmt in T5_PREFIX else ()))


@pytest.mark.parametrize(("kind", "fmt"), [*CASES, *MORE], ids=[f"{kind}-{fmt}" for kind, fmt in [*CASES, *MORE]])
def test_right_merge_passes_refereed_by_diffusers_where_it_reads_the_file(merged, cli, tmp_path, kind, fmt):
    _, out = merged(kind, fmt)
    code, report, said = proof(cli, out, tmp_path)
    tensors = report["tensors"]
    assert code == 0 and report["verdict"] == "pass", said
    changed = {group: counts["changed"] for group, counts in tensors["groups"].items()}
    assert all(changed[c] > 0 for c in touched(kind, fmt)), changed
    # a pass means every changed tensor is one the referee names: the proof passes none it does not know
    assert tensors["referee"]["name"] == referee(kind, fmt), tensors["referee"]
    assert f"referee: {referee(kind, fmt)}" in shown(report)
    if (kind, fmt) in FORMULA:  # the last resort for what no diffusers code reads, labelled: which parts, where
        (note,) = [n for n in tensors["referee"]["notes"] if "published formula" in n]
        assert f"no diffusers loader reads the {UNREAD[kind, fmt]} modules" in note, note
        assert f"({', '.join(FORMULA[kind, fmt])})" in note, note
        assert "referee: diffusers; the published formula" in shown(report)
    else:
        assert tensors["referee"]["independent"] and "published formula" not in shown(report)


SABOTAGES = [(kind, fmt, c) for kind, fmt in [*CASES, *MORE] for c in touched(kind, fmt)]


@pytest.mark.parametrize(("kind", "fmt", "component"), SABOTAGES, ids=["-".join(case) for case in SABOTAGES])
def test_one_module_left_unmerged_exits_3_naming_it(merged, cli, tmp_path, kind, fmt, component):
    base, out = merged(kind, fmt)
    sabotaged = tmp_path / "s"
    shutil.copytree(out, sabotaged)
    (file,) = (sabotaged / component).glob("*.safetensors")
    tensors, before = load_file(file), load_file(base / component / file.name)
    name = next(k for k in sorted(tensors) if k.endswith(".weight") and not torch.equal(tensors[k], before[k]))
    tensors[name] = before[name]
    save_file(tensors, file, metadata={"format": "pt"})
    code, report, said = proof(cli, sabotaged, tmp_path)
    assert code == 3 and report["verdict"] == "fail", said
    (failure,) = report["tensors"]["failures"]
    assert failure["name"] == f"{component}/{name}"
    assert report["tensors"]["referee"]["name"] == referee(kind, fmt)
    # the tensor names who refereed it: the formula only for what no diffusers code reads
    assert failure["module"].endswith("(published formula)") == (component in FORMULA.get((kind, fmt), ())), failure


@pytest.mark.parametrize(("kind", "fmt"), list(FORMULA), ids=[f"{kind}-{fmt}" for kind, fmt in FORMULA])
def test_diffusers_referees_every_tensor_it_reads_and_the_formula_only_the_rest(merged, kind, fmt):
    """Tensor by tensor: the text encoders diffusers takes a LoRA for (CLIP-L, OpenCLIP-G: kohya SD3's through
    diffusers' kohya text-encoder conversion) have diffusers' own PEFT modules as their referee; the formula's
    tensors are exactly those of the components no diffusers code reads."""
    from converter.engine.recipe import recorded_recipe
    from converter.verification.prove import choose_referee

    base, out = merged(kind, fmt)
    recipe = recorded_recipe(out)
    rules = choose_referee(out, recipe, base, [Path(a.source) for a in recipe.adapters]).expectations()
    by = {}
    for name, rule in rules.items():
        by.setdefault(name.split("/", 1)[0], set()).add(rule.module.endswith("(published formula)"))
    assert by == {c: {c in FORMULA[kind, fmt]} for c in touched(kind, fmt)}, by


def test_the_referees_images_find_every_tensor_it_changes(merged):
    """Where the behaviour check cannot run, the card's reference images are the base pipeline holding the
    referee's tensors: each is found in the loaded pipeline by its file name (renamed on load included)."""
    from converter.engine.base_reader import open_base
    from converter.engine.recipe import recorded_recipe
    from converter.verification.diffusers_loader import load_pipeline
    from converter.verification.diffusion import _pipeline_params
    from converter.verification.prove import choose_referee

    base, out = merged("sd15", "kohya")
    recipe = recorded_recipe(out)
    changed = set(choose_referee(out, recipe, base, [Path(a.source) for a in recipe.adapters]).expectations())
    assert any(name.startswith("text_encoder/text_model.") for name in changed)
    assert changed <= set(_pipeline_params(load_pipeline(base), set(open_base(base).names())))


def test_per_module_alphas_in_a_text_encoder_are_read_by_diffusers_one_alpha_at_a_time(merged, cli, tmp_path):
    """diffusers' text-encoder loader ignores kohya's per-module alphas when it reads the file whole; loaded as one
    copy per alpha (the other modules' up factors zeroed), each is read right, and diffusers referees both text
    encoders of the SD3 file."""
    _, out = merged("sd3", "kohya-alphas")
    code, report, said = proof(cli, out, tmp_path)
    assert code == 0 and report["verdict"] == "pass", said
    assert report["tensors"]["referee"]["name"] == "diffusers", report["tensors"]["referee"]
    assert {g for g, c in report["tensors"]["groups"].items() if c["changed"]} == {"text_encoder", "text_encoder_2"}


def test_an_llm_text_encoder_no_diffusers_loader_reads_is_the_formulas_alone(cli, tmp_path):
    """Qwen-Image's loader takes a LoRA for its transformer only: in a diffusers-format file with Qwen2.5-VL
    text-encoder modules too (named as its files spell them), diffusers referees the transformer and the formula,
    labelled, the text encoder's tensors; one of those left unmerged exits 3 naming it and the formula."""
    from diffusers import QwenImageTransformer2DModel
    from test_verify_renames import qwen25_vl

    torch.manual_seed(0)
    models = {"transformer": QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                                         attention_head_dim=8, num_attention_heads=2,
                                                         joint_attention_dim=16, axes_dims_rope=(2, 2, 4)),
              "text_encoder": qwen25_vl()}  # fmt: skip
    index = {"_class_name": "QwenImagePipeline"}
    for name, model in models.items():
        model.save_pretrained(tmp_path / "base" / name)
        index[name] = ["diffusers" if name == "transformer" else "transformers", type(model).__name__]
    (tmp_path / "base" / "model_index.json").write_text(json.dumps(index))
    lora, g = {}, torch.Generator().manual_seed(3)
    for name, targets in (("transformer", ["to_q", "to_v"]), ("text_encoder", ["q_proj", "v_proj"])):
        from peft import LoraConfig, inject_adapter_in_model
        from peft.utils import get_peft_model_state_dict

        model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=targets),
                                        copy.deepcopy(models[name]))  # fmt: skip
        for module in model.modules():
            for b in getattr(module, "lora_B", {}).values():
                b.weight.data = torch.randn(b.weight.shape, generator=g) * 0.2
        lora |= {f"{name}.{k.replace('model.language_model.', 'model.')}": v
                 for k, v in get_peft_model_state_dict(model).items() if "visual" not in k}  # fmt: skip
    adapter = save(lora, tmp_path / "lora.safetensors")
    made = cli("merge", "--base", tmp_path / "base", "--adapter", adapter, "--out", tmp_path / "m", "--no-verify")
    assert made[0] == 0, made
    code, report, said = proof(cli, tmp_path / "m", tmp_path)
    tensors = report["tensors"]
    assert code == 0 and tensors["referee"]["name"] == "diffusers", said
    assert {g: c["changed"] for g, c in tensors["groups"].items()} == {"text_encoder": 2, "transformer": 2}
    assert any("no diffusers loader reads the text_encoder. modules" in n for n in tensors["referee"]["notes"])
    (file,) = (tmp_path / "m" / "text_encoder").glob("*.safetensors")
    merged, before = load_file(file), load_file(tmp_path / "base" / "text_encoder" / file.name)
    name = next(k for k in sorted(merged) if not torch.equal(merged[k], before[k]))
    save_file({**merged, name: before[name]}, file, metadata={"format": "pt"})
    code, report, said = proof(cli, tmp_path / "m", tmp_path)
    (failure,) = report["tensors"]["failures"]
    assert code == 3 and failure["name"] == f"text_encoder/{name}", said
    assert failure["module"].endswith("(published formula)"), failure
