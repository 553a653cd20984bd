"""The diffusion architectures a GGUF file is written for: how each is recognised from its keys, which of its
tensors stay F32, and whether its tensors are reshaped (UNets).

Why these rules: the files are read by ComfyUI-GGUF's loaders (which accept only the architecture names below in
`general.architecture`) and by diffusers' GGUF loader; both take the model's original single-file layout, with the
prefix a full checkpoint puts before the denoiser's keys removed. The type rules are ComfyUI-GGUF's, so a file
written here is the file its converter writes: 1-D tensors, tensors of at most 1024 values and the parameters
each architecture reads outside a Linear (Wan's modulation, LTX's scale_shift_table ...) stay F32; a UNet's tensor
whose last dimension is no multiple of 256 is stored as rows of 256 with its shape in `comfy.gguf.orig_shape.*`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import gguf

from converter.errors import BadInputError

SMALL = 1024  # at most this many values: kept F32
RESHAPE_MIN = 512  # a UNet tensor reshaped into rows of 256 from this many values
ROW = 256
MAX_NAME = 127  # longest tensor name ggml reads
ORIG_SHAPE = "comfy.gguf.orig_shape."
PREFIXES = ("model.diffusion_model.", "model.")  # a full checkpoint's denoiser, in that order
WHOLE_PREFIXES = ("net.",)  # stripped only when every key has it (Cosmos' own files)


@dataclass(frozen=True)
class DiffusionArch:
    name: str  # general.architecture, as ComfyUI-GGUF's loaders accept it
    markers: tuple[tuple[str, ...], ...]  # the model is this architecture if every key of one group is present
    keep_f32: tuple[str, ...] = ()  # substrings of keys stored F32 whatever the type
    skip: tuple[str, ...] = ()  # substrings of keys that are no weights (training state): left out
    unet: bool = False  # reshaped into rows of 256 where the last dimension is no multiple of it
    diffusers_layout: tuple[str, ...] = ()  # keys of the same model in diffusers' layout: refused


# Order matters: the first whose markers match wins (Hunyuan Video's double blocks before Flux's, SDXL before SD1).
ARCHES = (
    DiffusionArch(
        "hyvid",
        (("double_blocks.0.img_attn_proj.weight", "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"),),
    ),  # fmt: skip
    DiffusionArch(
        "flux",
        (("double_blocks.0.img_attn.proj.weight",),),
        diffusers_layout=("transformer_blocks.0.attn.norm_added_k.weight",),
    ),  # fmt: skip
    DiffusionArch(
        "sd3",
        (("joint_blocks.0.x_block.attn.qkv.weight",),),
        keep_f32=("pos_embed",),  # diffusers dequantizes only inside Linear layers: a BF16 / Q8_0 one fails there
        diffusers_layout=("transformer_blocks.0.attn.add_q_proj.weight",),
    ),  # fmt: skip
    DiffusionArch("aura", (("double_layers.0.modX.1.weight",),)),
    DiffusionArch(
        "hidream",
        (("caption_projection.0.linear.weight", "double_stream_blocks.0.block.ff_i.shared_experts.w3.weight"),),
        keep_f32=(".ff_i.gate.weight", "img_emb.emb_pos"),
    ),  # fmt: skip
    DiffusionArch(
        "cosmos",
        (("blocks.0.mlp.layer1.weight", "blocks.0.adaln_modulation_cross_attn.1.weight"),),
        keep_f32=("pos_embedder",),
        skip=("_extra_state", "accum_"),
    ),  # fmt: skip
    DiffusionArch(
        "ltxv",
        (
            (
                "adaln_single.emb.timestep_embedder.linear_2.weight",
                "transformer_blocks.0.scale_shift_table",
                "caption_projection.linear_2.weight",
            ),
        ),
        keep_f32=("scale_shift_table",),
    ),  # fmt: skip
    DiffusionArch(
        "wan",
        (("blocks.0.self_attn.norm_q.weight", "text_embedding.2.weight", "head.modulation"),),
        keep_f32=(".modulation",),
    ),  # fmt: skip
    DiffusionArch("lumina2", (("cap_embedder.1.weight", "context_refiner.0.attention.qkv.weight"),)),
    DiffusionArch("qwen_image", (("img_in.weight", "txt_norm.weight", "transformer_blocks.0.img_mod.1.weight"),)),
    DiffusionArch(
        "sdxl",
        (("input_blocks.0.0.weight", "label_emb.0.0.weight"),),
        unet=True,
        diffusers_layout=("down_blocks.0.resnets.0.conv1.weight",),
    ),  # fmt: skip
    DiffusionArch(
        "sd1",
        (("input_blocks.0.0.weight", "time_embed.0.weight", "out.2.weight"),),
        unet=True,
        diffusers_layout=("down_blocks.0.resnets.0.conv1.weight",),
    ),  # fmt: skip
)
NAMES = tuple(a.name for a in ARCHES)


def denoiser_keys(keys: list[str]) -> dict[str, str]:
    """{key in the file: key in the GGUF}: the denoiser's keys with a full checkpoint's prefix removed; keys outside
    that prefix (a VAE, text encoders) are not the denoiser's and are left out."""
    for prefix in PREFIXES:
        if any(k.startswith(prefix) for k in keys):
            return {k: k[len(prefix) :] for k in keys if k.startswith(prefix)}
    for prefix in WHOLE_PREFIXES:
        if keys and all(k.startswith(prefix) for k in keys):
            return {k: k[len(prefix) :] for k in keys}
    return {k: k for k in keys}


def detect(keys: set[str], file: object) -> DiffusionArch:
    """The architecture of a denoiser with `keys` (prefix removed); a diffusers-layout file or an unknown model is
    refused in one line."""
    for a in ARCHES:  # markers first: Qwen-Image's own file has keys of Flux's and SD3's diffusers layout
        if any(all(k in keys for k in group) for group in a.markers):
            return a
    for a in ARCHES:  # a key diffusers' layout shares across families (Flux's, Hunyuan Video's ...): named, no family
        if found := next((k for k in a.diffusers_layout if k in keys), None):
            raise BadInputError(
                f"{file}: a model in diffusers' layout ({found}); ComfyUI-GGUF reads the original single-file layout "
                "(merge into the model's original single file, e.g. BFL's for Flux, and export that)",
                file=file)  # fmt: skip
    raise BadInputError(
        f"{file}: no diffusion architecture ComfyUI-GGUF loads ({', '.join(NAMES)}) in its keys; GGUF export takes "
        "the denoiser's original single-file layout", file=file)  # fmt: skip


def stored_type(key: str, shape: tuple[int, ...], arch: DiffusionArch, wanted: gguf.GGMLQuantizationType
                ) -> gguf.GGMLQuantizationType:  # fmt: skip
    """The type a tensor of (original) `shape` is stored as in a file of type `wanted`: F32 for 1-D, small and the
    architecture's high-precision tensors and for those of more than 4 dimensions (ggml has 4; ComfyUI-GGUF's fix
    step puts them back as F32), F16 where a quantized block does not divide the stored row."""
    n = 1
    for d in shape:
        n *= d
    if len(shape) <= 1 or len(shape) > 4 or n <= SMALL or any(s in key for s in arch.keep_f32):
        return gguf.GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    if stored_shape(shape, arch)[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return wanted


def stored_shape(shape: tuple[int, ...], arch: DiffusionArch) -> tuple[int, ...]:
    """The shape a tensor is stored with: a UNet's tensor of at least 512 values, a multiple of 256 in all but a
    last dimension that is none, as rows of 256; every other tensor as it is."""
    n = 1
    for d in shape:
        n *= d
    if arch.unet and len(shape) > 1 and n >= RESHAPE_MIN and n % ROW == 0 and shape[-1] % ROW:
        return (n // ROW, ROW)
    return tuple(shape)


def count_indexed(keys: set[str], pattern: str) -> int:
    """How many numbered blocks `pattern` (its group: the index) finds among `keys`: the highest index plus one."""
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0
