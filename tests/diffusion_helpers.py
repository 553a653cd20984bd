"""Tiny diffusion models from configs, community-format LoRAs written with the writers' real naming, and
diffusers' own LoRA loader as the oracle (load_lora_into_* + PEFT's merge of every LoRA layer).

Facts on names and math: docs/FORMATS.md (§1 kohya, §3 LyCORIS, §4 diffusers).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

logging.getLogger("diffusers").setLevel(logging.ERROR)

SD15 = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(16, 32),
    layers_per_block=2,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=24,
    attention_head_dim=4,
    norm_num_groups=8,
)
SDXL = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(16, 32),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2),
    cross_attention_dim=40,  # CLIP-L (16) + OpenCLIP-G (24) hidden states, concatenated as in SDXL
    attention_head_dim=4,
    norm_num_groups=8,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=4,
    projection_class_embeddings_input_dim=24 + 6 * 4,  # pooled OpenCLIP-G embeds + 6 time ids
)


def _perturb(model: nn.Module, seed: int) -> nn.Module:
    """Norms start at 1/0 and some layers at zero: make every tensor non-trivial so a wrong mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def tiny_unet(kind: str = "sd15", seed: int = 0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return _perturb(UNet2DConditionModel(**(SD15 if kind == "sd15" else SDXL)), seed)


def tiny_clip(hidden: int, projection: bool = False, seed: int = 1):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=99, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=16, projection_dim=hidden,
    )  # fmt: skip
    torch.manual_seed(seed)
    return _perturb((CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg), seed)


def make_pipeline(folder: Path, kind: str = "sd15") -> dict[str, nn.Module]:
    """A diffusers pipeline folder (model_index.json, unet/, text_encoder[_2]/, vae/, scheduler/) of tiny models."""
    from diffusers import AutoencoderKL

    models = {"unet": tiny_unet(kind)}
    if kind == "sd15":
        models["text_encoder"] = tiny_clip(24)
        pipeline = "StableDiffusionPipeline"
    else:
        models["text_encoder"] = tiny_clip(16, seed=2)
        models["text_encoder_2"] = tiny_clip(24, projection=True, seed=3)
        pipeline = "StableDiffusionXLPipeline"
    torch.manual_seed(4)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4, sample_size=8)
    folder.mkdir(parents=True)
    index = {"_class_name": pipeline, "_diffusers_version": "0.42.1"}
    for name, model in {**models, "vae": vae}.items():
        model.save_pretrained(folder / name)
        lib = "transformers" if name.startswith("text_encoder") else "diffusers"
        index[name] = [lib, type(model).__name__]
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "DDIMScheduler"}\n')
    index["scheduler"] = ["diffusers", "DDIMScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return models


# kohya sd-scripts networks/lora.py: target classes and what inside them gets a LoRA (§1).
UNET_TARGETS = ("Transformer2DModel",)
UNET_CONV_TARGETS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
TE_TARGETS = ("CLIPAttention", "CLIPSdpaAttention", "CLIPMLP")


def kohya_modules(model: nn.Module, prefix: str, targets: tuple[str, ...], convs: bool = False) -> dict:
    """{kohya name: (module path, module)} the way create_modules names them: (prefix.path.child) with '.' -> '_'.

    Text encoders were trained as transformers 4 CLIPTextModels, whose paths start with `text_model.`
    (lora_te_text_model_encoder_layers_0_...); transformers 5 saves them without it, hence the prefix here."""
    out = {}
    classes = targets + (UNET_CONV_TARGETS if convs else ())
    for name, module in model.named_modules():
        if type(module).__name__ not in classes:
            continue
        for child_name, child in module.named_modules():
            if not isinstance(child, nn.Linear | nn.Conv2d) or not child_name:
                continue
            is_kxk = isinstance(child, nn.Conv2d) and child.kernel_size != (1, 1)
            if is_kxk and not convs:
                continue
            path = f"{name}.{child_name}"
            kohya_path = (
                path if not prefix.startswith("lora_te") or path.startswith("text_model.") else f"text_model.{path}"
            )
            out[f"{prefix}.{kohya_path}".replace(".", "_")] = (path, child)
    return out


def kohya_lora(modules: dict, rank: int = 4, conv_rank: int = 2, alpha: float | None = 2.0, seed: int = 7) -> dict:
    """lora_down/lora_up/alpha per module with random non-zero values; conv kxk gets (r, in, k, k) downs."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i, (name, (_, m)) in enumerate(sorted(modules.items())):
        kxk = isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1)
        r = conv_rank if kxk else rank
        if isinstance(m, nn.Conv2d):
            down = torch.randn(r, m.in_channels, *m.kernel_size, generator=g) * 0.1
            up = torch.randn(m.out_channels, r, 1, 1, generator=g) * 0.1
        else:
            down = torch.randn(r, m.in_features, generator=g) * 0.1
            up = torch.randn(m.out_features, r, generator=g) * 0.1
        sd[f"{name}.lora_down.weight"] = down
        sd[f"{name}.lora_up.weight"] = up
        if alpha is not None:
            sd[f"{name}.alpha"] = torch.tensor(float(alpha) + (i % 3))  # per-module alphas differ
    return sd


def peft_merge(model: nn.Module) -> dict[str, torch.Tensor]:
    """Fold every PEFT LoRA layer diffusers injected (PEFT's own merge) and return the plain state dict."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    out = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v.detach().clone()
    return out


def diffusers_reference_sd(state_dict: dict, models: dict, xl: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """diffusers' own path for an SD/SDXL LoRA file: lora_state_dict (its kohya conversion, alphas) and
    load_lora_into_unet / load_lora_into_text_encoder, then merged; fresh copies of the models are used."""
    import copy

    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin

    mixin = StableDiffusionXLLoraLoaderMixin if xl else StableDiffusionLoraLoaderMixin
    models = {k: copy.deepcopy(v) for k, v in models.items()}
    kwargs = {"unet_config": models["unet"].config} if xl else {}
    sd, alphas = mixin.lora_state_dict(dict(state_dict), **kwargs)
    mixin.load_lora_into_unet(sd, alphas, models["unet"])
    for name in ("text_encoder", "text_encoder_2"):
        if name in models and any(k.startswith(f"{name}.") for k in sd):
            mixin.load_lora_into_text_encoder(sd, alphas, models[name], prefix=name)
    return {k: peft_merge(m) for k, m in models.items()}


def read_component(folder: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted((folder / name).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def save(sd: dict, path: Path, metadata: dict | None = None) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, path, metadata=metadata)
    return path


def assert_matches(ours: dict, reference: dict, base: dict, atol: float = 2e-6) -> int:
    """Every tensor equals the reference; returns how many changed from the base (must be > 0 to mean anything)."""
    assert set(ours) == set(reference), set(ours) ^ set(reference)
    changed = 0
    for k, ref in reference.items():
        torch.testing.assert_close(ours[k], ref, atol=atol, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        changed += not torch.equal(base[k], ref)
    assert changed > 0
    return changed
