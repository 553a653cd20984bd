"""Today's diffusion families at test size: a tiny transformer from each family's diffusers config (reduced widths and
layers), its two base layouts (diffusers folder, original single file), and one LoRA spelt every way the family's
writers spell it, all from the same random factors, so every spelling means the same ΔW.

The original single file is built from the diffusers weights through the keymap's own aliases and then checked
against diffusers' single-file converter (`convert_*_checkpoint_to_diffusers`), which must give the diffusers weights
back: the keymap's layout facts are diffusers', not ours. Expected merges are computed here from the factors by
the published formula (W + alpha / rank · up @ down); diffusers' own loader (`lora_state_dict` +
`load_lora_into_transformer`, merged by PEFT) must agree with it for every spelling the keymap says diffusers reads.
Spellings are listed in docs/FORMATS.md §12.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusion_helpers import _perturb, peft_merge, save
from torch import nn

from converter.engine.keymap import DiffusionResolver, Keymap, Placement, all_keymaps, flatten

RANK = 4
ALPHA = 2.0  # scale 1/2: a power of two, so spellings that fold it into lora_B are exact


@dataclass(frozen=True)
class Case:
    family: str  # keymap name
    cls: str  # diffusers transformer class
    config: dict
    pipeline: str  # model_index.json _class_name
    targets: str  # regex over diffusers module names: what the LoRAs adapt (typical trainer targets)
    spellings: tuple[str, ...]  # the spellings this family's writers use (built and tested)
    # why diffusers' single-file converter cannot check the original layout at test widths (None: it can)
    no_single_file_check: str | None = None
    prefix: str = "model.diffusion_model."  # the single file's key prefix (ComfyUI's)
    # spellings diffusers reads only at the family's own widths: their diffusers claim is not checked here (why)
    unchecked: dict = field(default_factory=dict)
    single_file: bool = True  # whether the family has a single-file layout here
    # a model of the family under another diffusers class (SkyReels-V2 is Wan's): the case's own name, and the
    # loader mixin diffusers reads its LoRAs with (None: the keymap's)
    variant: str | None = None
    loader: str | None = None

    @property
    def name(self) -> str:
        return self.variant or self.family


CASES = {
    c.name: c
    for c in [
        Case(
            "flux",
            "FluxTransformer2DModel",
            dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=12, pooled_projection_dim=12, axes_dims_rope=(2, 2, 4),
                 guidance_embeds=True),
            "FluxPipeline",
            # not single blocks' linear1: diffusers' converters split it at FLUX.1's own width (3072)
            r"transformer_blocks\.\d+\.(attn|ff|ff_context)\..*|single_transformer_blocks\.\d+\.proj_out",
            ("kohya/original", "comfyui/original", "diffusers/diffusers", "onetrainer/diffusers",
             "lycoris/diffusers", "bare/diffusers", "peft/original"),
            no_single_file_check="diffusers' single-file converter splits linear1 at FLUX.1's own width (3072)",
            unchecked={"peft/original": "diffusers' fal Kontext converter takes FLUX.1's 19 + 38 blocks at width 3072"},
        ),
        Case(
            "flux2",
            "Flux2Transformer2DModel",
            dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=12, timestep_guidance_channels=16,
                 axes_dims_rope=(2, 2, 2, 2)),
            "Flux2Pipeline",
            r"(single_)?transformer_blocks\.\d+\..*",
            ("kohya/original", "comfyui/original", "diffusers/diffusers", "comfyui/diffusers", "peft/diffusers",
             "peft/original", "lycoris/diffusers", "onetrainer/diffusers"),
        ),
        Case(
            "qwen_image",
            "QwenImageTransformer2DModel",
            dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=12, axes_dims_rope=(2, 2, 4)),
            "QwenImagePipeline",
            r"transformer_blocks\.\d+\.(attn\..*|(img|txt)_mlp\..*)",
            ("kohya", "comfyui", "diffusers", "bare", "lycoris", "peft"),
        ),
        Case(
            "z_image",
            "ZImageTransformer2DModel",
            dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=16, n_layers=2, n_refiner_layers=1,
                 n_heads=2, n_kv_heads=2, cap_feat_dim=12, axes_dims=[2, 2, 4], axes_lens=[64, 32, 32]),
            "ZImagePipeline",
            r"(layers|noise_refiner|context_refiner)\.\d+\.(attention\.(to_[qkv]|to_out\.0)|feed_forward\.w[123])",
            ("kohya/diffusers", "comfyui/diffusers", "diffusers/diffusers", "kohya/original", "comfyui/original",
             "lycoris/diffusers"),
        ),
        Case(
            "wan",
            "WanTransformer3DModel",
            dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                 text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
            "WanPipeline",
            r"blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ffn\.net\.(0\.proj|2))",
            ("kohya/original", "comfyui/original", "diffusers/diffusers", "kohya/diffusers", "bare/diffusers",
             "comfyui/diffusers", "lycoris/diffusers"),
        ),
        Case(  # Wan's blocks; diffusers reads its LoRAs with Wan's converters, its single file with Wan's
            "wan",
            "SkyReelsV2Transformer3DModel",
            dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                 text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32, inject_sample_info=True),
            "SkyReelsV2DiffusionForcingPipeline",
            r"blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ffn\.net\.(0\.proj|2))",
            ("kohya/original", "comfyui/original", "diffusers/diffusers"),
            variant="skyreels_v2",
            loader="SkyReelsV2LoraLoaderMixin",
        ),
        Case(  # Wan's I2V blocks (image cross-attention add_k/add_v); diffusers reads it with Wan's own loader
            "wan",
            "ChronoEditTransformer3DModel",
            dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                 text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32, image_dim=12,
                 added_kv_proj_dim=16),
            "ChronoEditPipeline",
            r"blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0|add_[kv]_proj)|ffn\.net\.(0\.proj|2))",
            ("kohya/original", "comfyui/original", "diffusers/diffusers"),
            variant="chronoedit",
        ),
        Case(  # Wan's blocks, diffusers folders only
            "wan",
            "HeliosTransformer3DModel",
            dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                 text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_dim=(2, 2, 4)),
            "HeliosPipeline",
            r"blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ffn\.net\.(0\.proj|2))",
            ("kohya/original", "comfyui/original", "diffusers/diffusers"),
            no_single_file_check="diffusers reads no Helios single file",
            single_file=False,
            variant="helios",
            loader="HeliosLoraLoaderMixin",
        ),
        Case(
            "hunyuan_video",
            "HunyuanVideoTransformer3DModel",
            dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                 num_single_layers=2, num_refiner_layers=1, patch_size=1, text_embed_dim=12,
                 pooled_projection_dim=8, rope_axes_dim=(2, 2, 4)),
            "HunyuanVideoPipeline",
            # not single blocks' linear1: diffusers' LoRA converter splits it at HunyuanVideo's own width (3072)
            r"transformer_blocks\.\d+\.(attn\..*|ff(_context)?\..*)|single_transformer_blocks\.\d+\.proj_out",
            ("kohya/original", "comfyui/original", "diffusers/diffusers", "diffusers/original", "bare/original"),
            no_single_file_check="diffusers' single-file converter splits linear1 at HunyuanVideo's own width (3072)",
        ),
        Case(  # HunyuanVideo's blocks under diffusers' names, in both layouts (one naming)
            "framepack",
            "HunyuanVideoFramepackTransformer3DModel",
            dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                 num_single_layers=2, num_refiner_layers=1, patch_size=1, text_embed_dim=12,
                 pooled_projection_dim=8, rope_axes_dim=(2, 2, 4), has_clean_x_embedder=True),
            "HunyuanVideoFramepackPipeline",
            r"transformer_blocks\.\d+\.(attn\..*|ff(_context)?\..*)|single_transformer_blocks\.\d+\.(attn\..*|proj_mlp)",
            ("kohya", "diffusers", "comfyui", "bare"),
        ),
        Case(
            "ltx2",
            "LTX2VideoTransformer3DModel",
            dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                 audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
                 audio_cross_attention_dim=8, num_layers=2, caption_channels=16),
            "LTX2Pipeline",
            r"transformer_blocks\.\d+\.((audio_)?attn[12]\..*|(audio_)?ff\..*)|proj_in|time_embed\.linear",
            ("comfyui/original", "diffusers/diffusers", "bare/original", "kohya/original"),
        ),
        Case(
            "hidream",
            "HiDreamImageTransformer2DModel",
            dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                 num_attention_heads=2, caption_channels=[8, 8], text_emb_dim=12, num_routed_experts=2,
                 num_activated_experts=1, axes_dims_rope=(2, 2, 4), max_resolution=(16, 16), llama_layers=[0, 1]),
            "HiDreamImagePipeline",
            r"(double|single)_stream_blocks\.\d+\.block\.(attn1\..*|ff_[it]\..*)",
            ("comfyui", "diffusers", "kohya", "lycoris"),
        ),
        Case(
            "lumina2",
            "Lumina2Transformer2DModel",
            dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=24, num_layers=2, num_refiner_layers=1,
                 num_attention_heads=3, num_kv_heads=1, multiple_of=16, cap_feat_dim=12, axes_dim_rope=(2, 2, 4),
                 axes_lens=(32, 16, 16)),
            "Lumina2Pipeline",
            r"(layers|noise_refiner|context_refiner)\.\d+\.(attn\..*|feed_forward\..*)",
            ("comfyui/original", "diffusers/diffusers", "kohya/original", "comfyui/diffusers"),
            no_single_file_check="diffusers' single-file converter splits qkv at Lumina-Image 2.0's widths",
            unchecked={"comfyui/original": "diffusers' LoRA converter splits qkv at Lumina-Image 2.0's widths"},
        ),
        Case(
            "ltx_video",
            "LTXVideoTransformer3DModel",
            dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                 num_layers=2, caption_channels=12),
            "LTXPipeline",
            r"transformer_blocks\.\d+\.(attn[12]\..*|ff\..*)|proj_in",
            ("comfyui/original", "comfyui/diffusers", "diffusers/diffusers", "bare/original", "kohya/original"),
        ),
        Case(
            "krea2",
            "Krea2Transformer2DModel",
            dict(in_channels=8, num_layers=2, attention_head_dim=8, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=12, num_text_layers=2,
                 text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=24,
                 num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(2, 2, 4)),
            "Krea2Pipeline",
            r"(transformer_blocks|text_fusion\.(layerwise|refiner)_blocks)\.\d+\.(attn|ff)\..*|img_in|time_mod_proj",
            ("kohya/original", "comfyui/original", "diffusers/diffusers", "peft/original", "lycoris/diffusers"),
        ),
        Case(
            "anima",
            "CosmosTransformer3DModel",
            dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                 mlp_ratio=2.0, text_embed_dim=12, adaln_lora_dim=8, max_size=(4, 16, 16), patch_size=(1, 2, 2),
                 rope_scale=(1.0, 1.0, 1.0), concat_padding_mask=True, extra_pos_embed_type=None),
            "Cosmos2TextToImagePipeline",
            r"transformer_blocks\.\d+\.(attn[12]\..*|ff\..*)",
            ("kohya/original", "comfyui/original", "diffusers/diffusers"),
            prefix="net.",
        ),
        Case(
            "flux3",
            "Flux3Transformer2DModel",
            dict(in_channels=8, cond_in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=12, timestep_channels=16, axes_dims_rope=(2, 2, 2, 2)),
            "Flux3ModularPipeline",
            r"(mode_blocks\.[a-z_]+|txt_mode_blocks|single_transformer_blocks)\.\d+\.(attn|ff)\..*",
            ("comfyui/original", "diffusers/diffusers", "kohya/original", "comfyui/diffusers"),
        ),
        Case(
            "ideogram4",
            "Ideogram4Transformer2DModel",
            dict(in_channels=8, num_layers=2, attention_head_dim=8, num_attention_heads=2, intermediate_size=32,
                 adaln_dim=8, llm_features_dim=12, mrope_section=(1, 1, 2)),
            "Ideogram4Pipeline",
            r"layers\.\d+\.(attention|feed_forward)\..*",
            ("comfyui/original", "diffusers/diffusers", "kohya/original", "comfyui/diffusers"),
            no_single_file_check="diffusers reads no Ideogram 4 single file",
            single_file=False,
        ),
        Case(
            "minimax_h3",
            "MiniMaxH3Transformer3DModel",
            dict(num_attention_heads=2, attention_head_dim=8, hidden_size=16, num_layers=2, num_refiner_layers=1,
                 ffn_dim=24, in_channels=4, audio_in_channels=4, patch_size=(1, 2, 2), text_dim=12, freq_dim=16,
                 time_embed_hidden_dim=16, time_embed_dim=8, rope_freq_dim=4),
            "MiniMaxH3ModularPipeline",
            r"(transformer_blocks|token_refiner\.refiner_blocks)\.\d+\.(attn|ff|adaln_proj)\..*",
            ("kohya/original", "comfyui/original", "bare/original", "diffusers/diffusers"),
            prefix="",
        ),
        Case(
            "ace_step",
            "AceStepTransformer1DModel",
            dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8, in_channels=8, audio_acoustic_hidden_dim=4, patch_size=2,
                 encoder_hidden_size=12),
            "AceStepPipeline",
            r"layers\.\d+\.((self|cross)_attn|mlp)\..*",
            ("peft/original", "diffusers/diffusers", "bare/original", "comfyui/original"),
            no_single_file_check="diffusers reads no ACE-Step single file",
            single_file=False,
        ),
    ]
}  # fmt: skip


def keymap(family: str) -> Keymap:
    return {k.name: k for k in all_keymaps()}[family]


def tiny(case: Case, seed: int = 0) -> nn.Module:
    import diffusers

    torch.manual_seed(seed)
    return _perturb(getattr(diffusers, case.cls)(**case.config), seed)


def linears(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _resolver(km: Keymap, shapes: dict[str, tuple[int, ...]]) -> DiffusionResolver:
    return DiffusionResolver(km, {"transformer": ("", dict(km.defaults))}, shapes)


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _original_aliases(km: Keymap, shapes: dict[str, tuple[int, ...]], modules: bool = False) -> dict[str, list]:
    """Original-layout names of the diffusers keys (the keymap's aliases), each with its placements; `modules`:
    only the weights of modules an adapter names (the keymap's original `names`)."""
    if km.one_naming:
        return {}
    res = _resolver(km, shapes)
    patterns = km.names.get("original", [])
    out = {}
    for alias, places in res.dotted["transformer"].items():
        if alias in shapes and not any(p.key != alias for p in places):
            continue
        if modules and not any(p.fullmatch(_module(alias)) for p in patterns):
            continue
        out[alias] = sorted(places, key=lambda p: p.src or (0, 0))
    covered = {p.key for places in out.values() for p in places}
    for key in shapes if modules else ():  # modules named alike in both layouts are their own original
        if key not in covered and key.endswith(".weight") and any(p.fullmatch(_module(key)) for p in patterns):
            out[key] = [Placement(key)]
    return out


def original_shapes(shapes: dict[str, tuple[int, ...]], km: Keymap) -> dict[str, tuple[int, ...]]:
    """The keys and shapes of the family's original checkpoint of a diffusers model with `shapes`."""
    out, covered = {}, set()
    for alias, places in _original_aliases(km, shapes).items():
        first = shapes[places[0].key]
        out[alias] = (max(p.src[1] if p.src else first[0] for p in places), *first[1:])
        covered.update(p.key for p in places)
    return out | {k: v for k, v in shapes.items() if k not in covered}


def original_layout(sd: dict[str, torch.Tensor], km: Keymap) -> dict[str, torch.Tensor]:
    """The family's original checkpoint of diffusers weights `sd`, by the keymap's aliases (a fused tensor is its
    parts stacked by rows; keys without an alias keep their name)."""
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    out, covered = {}, set()
    for alias, places in _original_aliases(km, shapes).items():
        first = sd[places[0].key]
        rows = max(p.src[1] if p.src else first.shape[0] for p in places)
        t = torch.full((rows, *first.shape[1:]), float("nan"), dtype=first.dtype)
        for p in places:
            t[slice(*p.src) if p.src else slice(None)] = sd[p.key][slice(*p.rows) if p.rows else slice(None)]
            covered.add(p.key)
        assert not t.isnan().any(), f"{alias}: the keymap's aliases leave rows of it uncovered"
        out[alias] = t
    return out | {k: v for k, v in sd.items() if k not in covered}


@dataclass
class Lora:
    """One LoRA as factors on original modules (fused where the original fuses) and the same on diffusers modules."""

    original: dict[str, tuple[torch.Tensor, torch.Tensor]]
    diffusers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    alpha: float = ALPHA
    rank: int = RANK

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def make_lora(case: Case, model: nn.Module, seed: int = 5) -> Lora:
    km = keymap(case.family)
    mods = linears(model)
    shapes = {f"{n}.weight": s for n, s in mods.items()}
    g = torch.Generator().manual_seed(seed)
    targets = {n for n in mods if re.fullmatch(case.targets, n)}
    assert targets, f"{case.family}: no module matches {case.targets}"
    if km.one_naming:
        original = {
            n: (torch.randn(RANK, mods[n][1], generator=g) * 0.3, torch.randn(mods[n][0], RANK, generator=g) * 0.3)
            for n in sorted(targets)
        }
        return Lora(original, dict(original))
    original, diffusers = {}, {}
    for alias, places in sorted(_original_aliases(km, shapes, modules=True).items()):
        keys = {_module(p.key) for p in places}
        if not alias.endswith(".weight") or not keys & targets or keys & set(diffusers):
            continue
        first = shapes[places[0].key]
        rows = max(p.src[1] if p.src else first[0] for p in places)
        down = torch.randn(RANK, first[1], generator=g) * 0.3
        up = torch.randn(rows, RANK, generator=g) * 0.3
        original[_module(alias)] = (down, up)
        for key in keys:
            d_up = torch.full((shapes[f"{key}.weight"][0], RANK), float("nan"))
            for p in places:
                if _module(p.key) == key:
                    d_up[slice(*p.rows) if p.rows else slice(None)] = up[slice(*p.src) if p.src else slice(None)]
            assert not d_up.isnan().any(), f"{key}: rows not covered by {alias}"
            diffusers[key] = (down.clone(), d_up)
    return Lora(original, diffusers)


def expected(base: dict[str, torch.Tensor], lora: Lora) -> dict[str, torch.Tensor]:
    """The merged diffusers weights by the published formula, in float64 then rounded once."""
    out = dict(base)
    for name, (down, up) in lora.diffusers.items():
        w = base[f"{name}.weight"]
        out[f"{name}.weight"] = (w.double() + lora.scale * up.double() @ down.double()).to(w.dtype)
    return out


def spell(lora: Lora, spelling: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The LoRA's tensors and metadata as a writer of `spelling` stores them (docs/FORMATS.md §12): kohya-style
    prefixes carry lora_down/lora_up/alpha, the others lora_A/lora_B with the scale folded into lora_B (ai-toolkit,
    ComfyUI), diffusers' own file its LoraConfig in `lora_adapter_metadata`."""
    kind, _, naming = spelling.partition("/")
    modules = lora.diffusers if naming == "diffusers" else lora.original
    flat = {"kohya": "lora_unet_", "onetrainer": "lora_transformer_", "lycoris": "lycoris_"}
    dotted = {"comfyui": "diffusion_model.", "diffusers": "transformer.", "peft": "base_model.model.", "bare": ""}
    sd, meta = {}, {}
    for name, (down, up) in modules.items():
        if kind in flat:
            stem = flat[kind] + flatten(name)
            sd |= {f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up,
                   f"{stem}.alpha": torch.tensor(lora.alpha)}  # fmt: skip
        elif kind == "diffusers":
            sd |= {f"transformer.{name}.lora_A.weight": down, f"transformer.{name}.lora_B.weight": up}
        else:
            stem = dotted[kind] + name
            sd |= {f"{stem}.lora_A.weight": down, f"{stem}.lora_B.weight": up * lora.scale}
    if kind == "diffusers":
        config = {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": sorted(modules)}
        meta["lora_adapter_metadata"] = json.dumps({f"transformer.{k}": v for k, v in config.items()})
    return sd, meta


def write_spelling(lora: Lora, spelling: str, folder: Path) -> Path:
    sd, meta = spell(lora, spelling)
    return save(sd, folder / f"{spelling.replace('/', '-')}.safetensors", meta)


def diffusers_merge(case: Case, model: nn.Module, file: Path) -> dict[str, torch.Tensor]:
    """diffusers' own reading of a LoRA file for this family: lora_state_dict + load_lora_into_transformer on a
    copy of the model, merged by PEFT."""
    from diffusers.loaders import lora_pipeline

    mixin = getattr(lora_pipeline, case.loader or keymap(case.family).diffusers["loader"])
    sd, metadata = mixin.lora_state_dict(str(file.parent), weight_name=file.name, return_lora_metadata=True)
    if isinstance(sd, tuple):  # loaders that also return network alphas
        sd = sd[0]
    target = copy.deepcopy(model)
    params = inspect.signature(mixin.load_lora_into_transformer).parameters
    kwargs = {"metadata": metadata} if "metadata" in params else {}
    if "network_alphas" in params:
        kwargs["network_alphas"] = None
    mixin.load_lora_into_transformer(sd, transformer=target, **kwargs)
    return peft_merge(target)


def make_bases(case: Case, model: nn.Module, root: Path) -> tuple[Path, Path | None]:
    """The diffusers folder (transformer/ + model_index.json) and the original single file."""
    folder = root / "pipe"
    model.save_pretrained(folder / "transformer")
    index = {"_class_name": case.pipeline, "_diffusers_version": "0.42.1", "transformer": ["diffusers", case.cls]}
    (folder / "model_index.json").write_text(json.dumps(index))
    if not case.single_file:
        return folder, None
    original = original_layout(model.state_dict(), keymap(case.family))
    single = save({case.prefix + k: v for k, v in original.items()}, root / f"{case.family}-tiny.safetensors")
    return folder, single
