"""Running an SD1 / SD2 / SDXL UNet's GGUF file in diffusers, for its behaviour proof: the UNet's config read from
the ldm layout's shapes, and the file's tensors read as ComfyUI-GGUF reads them.

Why the tensors are put back to their original shapes here: ComfyUI-GGUF stores a UNet tensor whose last dimension
is no multiple of 256 as rows of 256 and records its shape in `comfy.gguf.orig_shape.*`; its loader views each
tensor at that shape (dequantizing a quantized one on use). diffusers' GGUF loader reads the tensors as stored and
does not read that field, so the proof reads the file with diffusers' own loader, dequantizes each reshaped tensor
(and any quantized one outside a linear layer, which diffusers' GGUF layers do not take) with diffusers' own
dequantizer, and views it at its recorded shape; quantized linear weights stay with diffusers' GGUF layers.
"""

from __future__ import annotations

import math
from pathlib import Path

from converter.gguf.diffusion_arch import ORIG_SHAPE, count_indexed

LDM_PREFIX = "model.diffusion_model."  # diffusers' ldm UNet converter reads only the keys under it
SD1_HEADS = 8  # SD1's heads at every level; SD2's and SDXL's (linear projections) have 64 channels a head
SD2_HEAD_DIM = 64
SDXL_TIME_DIM = 256  # SDXL's size-and-crop embedding width per time id
TIME_IDS = 6  # SDXL base's time ids: original size, crop corner, target size


def _levels(s: dict[str, tuple[int, ...]], side: str) -> list[list[tuple[int, int]]]:
    """The blocks of each resolution level, in file order, as (channels, transformer depth); `side` is
    input_blocks (a downsampler ends a level) or output_blocks (an upsampler does)."""
    keys = set(s)
    levels: list[list[tuple[int, int]]] = [[]]
    start = 1 if side == "input_blocks" else 0  # input_blocks.0 is conv_in
    for i in range(start, count_indexed(keys, rf"{side}\.(\d+)\.")):
        if f"{side}.{i}.0.op.weight" in s:
            levels.append([])
            continue
        depth = count_indexed(keys, rf"{side}\.{i}\.1\.transformer_blocks\.(\d+)\.")
        levels[-1].append((s[f"{side}.{i}.0.out_layers.3.weight"][0], depth))
        if any(k.startswith(f"{side}.{i}.") and k.endswith(".conv.weight") for k in keys):  # an upsampler
            levels.append([])
    return [lv for lv in levels if lv]


def config(s: dict[str, tuple[int, ...]]) -> dict:
    """UNet2DConditionModel's config from the ldm UNet's shapes (ComfyUI-GGUF's names: no prefix). Heads, group
    norms' groups and SDXL's time-id width are not in any shape: SD1's 8 heads (64 channels a head where the
    projections are linear, as SD2's and SDXL's), 32 groups where every width allows it, 256 per time id assumed."""
    down, up = _levels(s, "input_blocks"), _levels(s, "output_blocks")
    if not down or len(up) != len(down) or "middle_block.1.proj_in.weight" not in s:
        raise ValueError("its ldm blocks are not an SD UNet's (levels, or a middle block with attention)")
    widths = [lv[0][0] for lv in down]
    proj = s["middle_block.1.proj_in.weight"]
    linear = len(proj) == 2
    depth = [max(d for _, d in lv) for lv in down]
    up_depth = [max(d for _, d in lv) for lv in up]
    made = {
        "_class_name": "UNet2DConditionModel", "in_channels": s["input_blocks.0.0.weight"][1],
        "out_channels": s["out.2.weight"][0], "block_out_channels": widths, "layers_per_block": len(down[0]),
        "down_block_types": ["CrossAttnDownBlock2D" if d else "DownBlock2D" for d in depth],
        "up_block_types": ["CrossAttnUpBlock2D" if d else "UpBlock2D" for d in up_depth],
        "transformer_layers_per_block": [d or 1 for d in depth],
        "cross_attention_dim": s["middle_block.1.transformer_blocks.0.attn2.to_k.weight"][1],
        "use_linear_projection": linear, "norm_num_groups": math.gcd(32, *widths),
        "attention_head_dim": [max(w // SD2_HEAD_DIM, 1) if linear else SD1_HEADS if w % SD1_HEADS == 0 else 1
                               for w in widths],
    }  # fmt: skip
    if up_depth != depth[::-1]:
        made["reverse_transformer_layers_per_block"] = [d or 1 for d in up_depth]
    if "label_emb.0.0.weight" in s:  # SDXL's pooled text and time ids
        width = s["label_emb.0.0.weight"][1]
        time_dim = SDXL_TIME_DIM if width > TIME_IDS * SDXL_TIME_DIM else width // (2 * TIME_IDS)
        made.update(addition_embed_type="text_time", addition_time_embed_dim=time_dim,
                    projection_class_embeddings_input_dim=width)  # fmt: skip
    return made


def read_as_comfyui(path: Path) -> dict:
    """The GGUF file's UNet tensors under the ldm prefix, each at the shape ComfyUI-GGUF's loader gives it (see the
    module's docstring); read by diffusers' GGUF loader and dequantized by its dequantizer."""
    import gguf
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    reader = gguf.GGUFReader(path)
    stored = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    shapes = {n[len(ORIG_SHAPE) :]: tuple(int(d) for d in f.contents()) for n, f in reader.fields.items()
              if n.startswith(ORIG_SHAPE)}  # fmt: skip
    del reader
    out = {}
    for name, t in load_gguf_checkpoint(str(path)).items():
        shape = shapes.get(name, stored[name])
        if isinstance(t, GGUFParameter) and (name in shapes or len(shape) != 2):
            t = dequantize_gguf_tensor(t)
        out[LDM_PREFIX + name] = t.reshape(shape) if name in shapes else t
    return out
