"""Running a diffusion GGUF file in diffusers, for its behaviour proof: the diffusers class of each architecture and
its config read from the single file's shapes (the seeded inputs are the class's, converter.engine.denoiser_inputs).

Why the config is read from the shapes: a single file carries no config.json, and diffusers' own fallback fetches a
reference repository's (gated for FLUX.1-dev). The proof runs the GGUF file and the merged single file under the
same config, so what it compares is the two files' weights as diffusers reads them; where a shape does not say a
value (a head count where the norms span all heads), the architecture's own value is assumed (128 per head).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from converter.engine import denoiser_inputs
from converter.gguf import diffusion_unet
from converter.gguf.diffusion_arch import count_indexed as _count

HEAD_DIM = 128  # Flux's, Wan's and HiDream's attention head width
SD3_HEAD_DIM = 64  # SD3's and LTX-Video's, where no per-head norm says it


def _axes(head_dim: int) -> list[int]:
    """Rotary axes that sum to the head width (FLUX.1's own where the width is its 128)."""
    if head_dim == HEAD_DIM:
        return [16, 56, 56]
    side = 2 * (head_dim // 6)
    return [head_dim - 2 * side, side, side]


FLUX1_WIDTH = 3072  # the width diffusers' FLUX.1 single-file converter splits single blocks' linear1 at


def _flux(s: dict[str, tuple[int, ...]]) -> dict:
    """FLUX.1's or FLUX.2's (both `flux` to ComfyUI-GGUF; FLUX.2's modulation is shared across blocks)."""
    if "double_stream_modulation_img.lin.weight" in s:
        return _flux2(s)
    made = _flux1(s)
    if s["img_in.weight"][0] != FLUX1_WIDTH or s["single_blocks.0.linear1.weight"][0] != 7 * FLUX1_WIDTH:
        raise ValueError("diffusers' FLUX.1 converter splits linear1 at width 3072 (mlp ratio 4)")
    return made


def _flux_common(s: dict[str, tuple[int, ...]]) -> dict:
    """What FLUX.1's and FLUX.2's configs both read from the shapes (BFL's names)."""
    hidden, in_channels = s["img_in.weight"]
    head = s["double_blocks.0.img_attn.norm.query_norm.scale"][0]
    keys = set(s)
    return {
        "patch_size": 1, "in_channels": in_channels, "out_channels": s["final_layer.linear.weight"][0],
        "num_layers": _count(keys, r"double_blocks\.(\d+)\."),
        "num_single_layers": _count(keys, r"single_blocks\.(\d+)\."), "attention_head_dim": head,
        "num_attention_heads": hidden // head, "joint_attention_dim": s["txt_in.weight"][1],
        "guidance_embeds": "guidance_in.in_layer.weight" in keys,
    }  # fmt: skip


def _flux1(s: dict[str, tuple[int, ...]]) -> dict:
    made = _flux_common(s)
    return {"_class_name": "FluxTransformer2DModel", **made, "pooled_projection_dim": s["vector_in.in_layer.weight"][1],
            "axes_dims_rope": _axes(made["attention_head_dim"])}  # fmt: skip


def _flux2(s: dict[str, tuple[int, ...]]) -> dict:
    made = _flux_common(s)
    hidden = s["img_in.weight"][0]
    return {
        "_class_name": "Flux2Transformer2DModel", **made, "timestep_guidance_channels": s["time_in.in_layer.weight"][1],
        "mlp_ratio": s["double_blocks.0.img_mlp.0.weight"][0] / (2 * hidden),  # SwiGLU: its input doubled
        "axes_dims_rope": [made["attention_head_dim"] // 4] * 4,
    }  # fmt: skip


def _qwen_image(s: dict[str, tuple[int, ...]]) -> dict:
    """Its patch size assumed 2 (Qwen-Image's): the packed channels are in_channels, the output's are 4 times."""
    hidden, in_channels = s["img_in.weight"]
    head = s["transformer_blocks.0.attn.norm_q.weight"][0]
    return {
        "_class_name": "QwenImageTransformer2DModel", "patch_size": 2, "in_channels": in_channels,
        "out_channels": s["proj_out.weight"][0] // 4, "num_layers": _count(set(s), r"transformer_blocks\.(\d+)\."),
        "attention_head_dim": head, "num_attention_heads": hidden // head,
        "joint_attention_dim": s["txt_in.weight"][1], "axes_dims_rope": _axes(head),
    }  # fmt: skip


def _wan(s: dict[str, tuple[int, ...]]) -> dict:
    dim, in_channels, *patch = s["patch_embedding.weight"]
    heads = _heads(dim, HEAD_DIM)
    patches = 1
    for p in patch:
        patches *= p
    return {
        "_class_name": "WanTransformer3DModel", "patch_size": patch, "num_attention_heads": heads,
        "attention_head_dim": dim // heads, "in_channels": in_channels,
        "out_channels": s["head.head.weight"][0] // patches, "text_dim": s["text_embedding.0.weight"][1],
        "freq_dim": s["time_embedding.0.weight"][1], "ffn_dim": s["blocks.0.ffn.0.weight"][0],
        "num_layers": _count(set(s), r"blocks\.(\d+)\."),
    }  # fmt: skip


def _sd3(s: dict[str, tuple[int, ...]]) -> dict:
    hidden, in_channels, patch, _ = s["x_embedder.proj.weight"]
    keys = set(s)
    norm = s.get("joint_blocks.0.x_block.attn.ln_q.weight")
    head = norm[0] if norm else SD3_HEAD_DIM
    size = round(s["pos_embed"][1] ** 0.5)
    return {
        "_class_name": "SD3Transformer2DModel", "sample_size": size, "patch_size": patch, "in_channels": in_channels,
        "num_layers": _count(keys, r"joint_blocks\.(\d+)\."), "attention_head_dim": head,
        "num_attention_heads": hidden // head, "joint_attention_dim": s["context_embedder.weight"][1],
        "caption_projection_dim": hidden, "pooled_projection_dim": s["y_embedder.mlp.0.weight"][1],
        "out_channels": s["final_layer.linear.weight"][0] // (patch * patch), "pos_embed_max_size": size,
        "dual_attention_layers": sorted({int(k.split(".")[1]) for k in keys if ".x_block.attn2." in k}),
        "qk_norm": "rms_norm" if norm else None,
    }  # fmt: skip


def _heads(width: int, head_dim: int) -> int:
    """The head count at the assumed head width; one head where the width is not a whole number of them."""
    return width // head_dim if width % head_dim == 0 else 1


def _ltxv(s: dict[str, tuple[int, ...]]) -> dict:
    """LTX-Video's or LTX-2's (both `ltxv` to ComfyUI-GGUF; LTX-2's audio stream tells it apart)."""
    if any(k.startswith("audio_") for k in s):
        return _ltx2(s)
    hidden, in_channels = s["patchify_proj.weight"]
    heads = _heads(hidden, SD3_HEAD_DIM)
    return {
        "_class_name": "LTXVideoTransformer3DModel", "in_channels": in_channels,
        "out_channels": s["proj_out.weight"][0], "num_attention_heads": heads, "attention_head_dim": hidden // heads,
        "cross_attention_dim": s["transformer_blocks.0.attn2.to_k.weight"][1],
        "num_layers": _count(set(s), r"transformer_blocks\.(\d+)\."),
        "caption_channels": s["caption_projection.linear_1.weight"][1],
    }  # fmt: skip


LTX2_HEAD_DIM, LTX2_AUDIO_HEAD_DIM = 128, 64  # LTX-2's video and audio head widths (32 heads each)


def _ltx2(s: dict[str, tuple[int, ...]]) -> dict:
    """LTX-2.0's: its q/k norms span all heads, so LTX-2's own head widths are assumed (128 video, 64 audio)."""
    hidden, in_channels = s["patchify_proj.weight"]
    audio, audio_in = s["audio_patchify_proj.weight"]
    heads, audio_heads = _heads(hidden, LTX2_HEAD_DIM), _heads(audio, LTX2_AUDIO_HEAD_DIM)
    return {
        "_class_name": "LTX2VideoTransformer3DModel", "in_channels": in_channels,
        "out_channels": s["proj_out.weight"][0], "num_attention_heads": heads, "attention_head_dim": hidden // heads,
        "cross_attention_dim": s["transformer_blocks.0.attn2.to_k.weight"][1], "audio_in_channels": audio_in,
        "audio_out_channels": s["audio_proj_out.weight"][0], "audio_num_attention_heads": audio_heads,
        "audio_attention_head_dim": audio // audio_heads,
        "audio_cross_attention_dim": s["transformer_blocks.0.audio_attn2.to_k.weight"][1],
        "num_layers": _count(set(s), r"transformer_blocks\.(\d+)\."),
        "caption_channels": s["caption_projection.linear_1.weight"][1],
    }  # fmt: skip


LUMINA2_WIDTHS = (2304, 768)  # the query's and each of key's and value's rows diffusers' Lumina 2 converter splits at
LUMINA2_CONTEXT_REFINERS = 2  # the context refiner layers whose norms diffusers' converter renames


def _lumina(s: dict[str, tuple[int, ...]]) -> dict:
    """Z-Image's or Lumina 2's (both `lumina2` to ComfyUI-GGUF; Z-Image's files have pad tokens)."""
    return _z_image(s) if "x_pad_token" in s else _lumina2(s)


def _lumina2(s: dict[str, tuple[int, ...]]) -> dict:
    """Its patch size assumed 2 (Lumina-Image 2.0's); the feed-forward's width is given to diffusers as a multiple
    of itself (`multiple_of`), since diffusers derives it from the model's width."""
    hidden, patched = s["x_embedder.weight"]
    q, kv = LUMINA2_WIDTHS
    keys = set(s)
    refiners = _count(keys, r"noise_refiner\.(\d+)\.")
    if hidden != q or s["layers.0.attention.qkv.weight"][0] != q + 2 * kv:
        raise ValueError(f"diffusers' Lumina 2 converter splits qkv at Lumina-Image 2.0's widths ({q} query, {kv} key "
                         "and value rows)")  # fmt: skip
    if _count(keys, r"context_refiner\.(\d+)\.") > LUMINA2_CONTEXT_REFINERS:
        raise ValueError(f"diffusers' Lumina 2 converter renames the norms of {LUMINA2_CONTEXT_REFINERS} context "
                         "refiner layers only")  # fmt: skip
    head = s["layers.0.attention.q_norm.weight"][0]
    ffn = s["layers.0.feed_forward.w1.weight"][0]
    return {
        "_class_name": "Lumina2Transformer2DModel", "patch_size": 2, "in_channels": patched // 4,
        "out_channels": s["final_layer.linear.weight"][0] // 4, "hidden_size": hidden,
        "num_layers": _count(keys, r"layers\.(\d+)\."), "num_refiner_layers": refiners,
        "num_attention_heads": hidden // head, "num_kv_heads": kv // head, "multiple_of": ffn,
        "ffn_dim_multiplier": ffn / (4 * hidden), "cap_feat_dim": s["cap_embedder.1.weight"][1],
        "axes_dim_rope": _axes(head),
    }  # fmt: skip


def _z_image(s: dict[str, tuple[int, ...]]) -> dict:
    dim, patched = s["x_embedder.weight"]
    head = s["layers.0.attention.q_norm.weight"][0]
    keys = set(s)
    return {
        "_class_name": "ZImageTransformer2DModel", "all_patch_size": [2], "all_f_patch_size": [1],
        "in_channels": patched // 4, "dim": dim, "n_layers": _count(keys, r"layers\.(\d+)\."),
        "n_refiner_layers": _count(keys, r"noise_refiner\.(\d+)\."), "n_heads": dim // head,
        "n_kv_heads": (s["layers.0.attention.qkv.weight"][0] // head - dim // head) // 2,
        "cap_feat_dim": s["cap_embedder.1.weight"][1], "axes_dims": _axes(head),
    }  # fmt: skip


AURA_HEAD_DIM = 256  # AuraFlow's attention head width (12 heads of 256): its q/k layer norms carry no weights


def _aura(s: dict[str, tuple[int, ...]]) -> dict:
    """AuraFlow's: its patch size assumed 2 (AuraFlow's own: the patch embedding packs it with the channels) and its
    head width 256 (no shape says it)."""
    hidden, patched = s["init_x_linear.weight"]
    heads = _heads(hidden, AURA_HEAD_DIM)
    keys = set(s)
    return {
        "_class_name": "AuraFlowTransformer2DModel", "patch_size": 2, "in_channels": patched // 4,
        "out_channels": s["final_linear.weight"][0] // 4, "num_mmdit_layers": _count(keys, r"double_layers\.(\d+)\."),
        "num_single_dit_layers": _count(keys, r"single_layers\.(\d+)\."), "attention_head_dim": hidden // heads,
        "num_attention_heads": heads, "joint_attention_dim": s["cond_seq_linear.weight"][1],
        "caption_projection_dim": s["cond_seq_linear.weight"][0], "pos_embed_max_size": s["positional_encoding"][1],
    }  # fmt: skip


def _hidream(s: dict[str, tuple[int, ...]]) -> dict:
    hidden, patched = s["x_embedder.proj.weight"]
    heads = _heads(hidden, HEAD_DIM)  # its norms span all heads: HiDream's 128 assumed
    keys = set(s)
    layers = _count(keys, r"double_stream_blocks\.(\d+)\.")
    single = _count(keys, r"single_stream_blocks\.(\d+)\.")
    routed = _count(keys, r"double_stream_blocks\.0\.block\.ff_i\.experts\.(\d+)\.")
    return {
        "_class_name": "HiDreamImageTransformer2DModel", "patch_size": 2, "in_channels": patched // 4,
        "out_channels": s["final_layer.linear.weight"][0] // 4, "num_layers": layers, "num_single_layers": single,
        "attention_head_dim": hidden // heads, "num_attention_heads": heads,
        "caption_channels": [s[f"caption_projection.{layers + single}.linear.weight"][1],
                             s["caption_projection.0.linear.weight"][1]],
        "text_emb_dim": s["p_embedder.pooled_embedder.linear_1.weight"][1], "num_routed_experts": routed,
        "num_activated_experts": min(2, routed), "axes_dims_rope": _axes(hidden // heads),
        "llama_layers": list(range(layers + single)),
    }  # fmt: skip


def _cosmos(s: dict[str, tuple[int, ...]]) -> dict:
    """Its padding-mask channel counted in `in_channels` and fed by the inputs: diffusers' own concatenation of
    the mask resizes it through torchvision, which the proof does not need otherwise."""
    hidden, patched = s["x_embedder.proj.1.weight"]
    head = s["blocks.0.self_attn.q_norm.weight"][0]
    made = {
        "_class_name": "CosmosTransformer3DModel", "patch_size": [1, 2, 2], "concat_padding_mask": False,
        "in_channels": patched // 4, "out_channels": s["final_layer.linear.weight"][0] // 4,
        "num_attention_heads": hidden // head, "attention_head_dim": head,
        "num_layers": _count(set(s), r"blocks\.(\d+)\."), "mlp_ratio": s["blocks.0.mlp.layer1.weight"][0] / hidden,
        "text_embed_dim": s["blocks.0.cross_attn.k_proj.weight"][1],
        "adaln_lora_dim": s["blocks.0.adaln_modulation_self_attn.2.weight"][1], "extra_pos_embed_type": None,
    }  # fmt: skip
    if "extra_pos_embedder.pos_emb_t" in s:  # Cosmos 1.0's learnt positions: their lengths are the patched sizes
        t, h, w = (s[f"extra_pos_embedder.pos_emb_{a}"][0] for a in "thw")
        made.update(extra_pos_embed_type="learnable", max_size=[t, 2 * h, 2 * w])
    return made


HYVID_WIDTH = 3072  # the width diffusers' Hunyuan Video converter splits single blocks' linear1 at
FRAMEPACK_KEYS = ("clean_x_embedder.", "image_projection.")  # FramePack's modules beside Hunyuan Video's


def _hyvid(s: dict[str, tuple[int, ...]]) -> dict:
    """Hunyuan Video's, at its own width only; FramePack's files (Hunyuan Video's blocks and names, plus its history
    and image embedders) refused, not run as the wrong class."""
    if any(k.startswith(FRAMEPACK_KEYS) for k in s):
        raise ValueError("a FramePack file (clean_x_embedder / image_projection): diffusers' single-file loader reads "
                         "no FramePack file, and Hunyuan Video's class has none of those modules")  # fmt: skip
    made = _hyvid_config(s)
    if (width := s["img_in.proj.weight"][0]) != HYVID_WIDTH:
        raise ValueError(f"diffusers' Hunyuan Video converter splits single blocks' linear1 at width {HYVID_WIDTH}, "
                         f"this file's is {width}")  # fmt: skip
    return made


def _hyvid_config(s: dict[str, tuple[int, ...]]) -> dict:
    """Its q/k norms are per head, so they give the head width. Assumed, as no shape says them: RMS q/k norms, rope
    theta 256 and axes 16/56/56 at 128 per head (Hunyuan Video's own), and no image condition (the I2V model's token
    replacement runs the same weights)."""
    hidden, in_channels, patch_t, patch, _ = s["img_in.proj.weight"]
    head = s["double_blocks.0.img_attn_q_norm.weight"][0]
    keys = set(s)
    return {
        "_class_name": "HunyuanVideoTransformer3DModel", "in_channels": in_channels,
        "out_channels": s["final_layer.linear.weight"][0] // (patch_t * patch * patch),
        "num_attention_heads": hidden // head, "attention_head_dim": head,
        "num_layers": _count(keys, r"double_blocks\.(\d+)\."),
        "num_single_layers": _count(keys, r"single_blocks\.(\d+)\."),
        "num_refiner_layers": _count(keys, r"txt_in\.individual_token_refiner\.blocks\.(\d+)\."),
        "mlp_ratio": s["double_blocks.0.img_mlp.fc1.weight"][0] / hidden, "patch_size": patch, "patch_size_t": patch_t,
        "guidance_embeds": "guidance_in.mlp.0.weight" in keys, "text_embed_dim": s["txt_in.input_embedder.weight"][1],
        "pooled_projection_dim": s["vector_in.in_layer.weight"][1], "rope_axes_dim": _axes(head),
    }  # fmt: skip


#: architecture -> its diffusers config read from the shapes (the seeded inputs are the class's:
#: converter.engine.denoiser_inputs)
RUNS: dict[str, Callable[[dict], dict]] = {
    "flux": _flux,  # FLUX.1's and FLUX.2's
    "qwen_image": _qwen_image,
    "wan": _wan,
    "sd3": _sd3,
    "ltxv": _ltxv,  # LTX-Video's and LTX-2's
    "aura": _aura,
    "hidream": _hidream,
    "hyvid": _hyvid,  # Hunyuan Video's; FramePack's are refused
    "cosmos": _cosmos,  # Anima's; Cosmos' own files are `cosmos` too
    "lumina2": _lumina,  # Lumina 2's and Z-Image's
    "sd1": diffusion_unet.config,  # SD2's UNets are sd1 to ComfyUI-GGUF too
    "sdxl": diffusion_unet.config,
}
UNETS = ("sd1", "sdxl")  # read back as ComfyUI-GGUF reads them (converter.gguf.diffusion_unet)


def reason(arch: str, shapes: dict[str, tuple[int, ...]]) -> str:
    """Why a denoiser with `shapes` gets no run here; "" where it gets one."""
    if arch not in RUNS:
        return f"no diffusers run of {arch} here (only of {', '.join(RUNS)})"
    try:
        RUNS[arch](shapes)
    except KeyError as e:
        return f"no diffusers run of this {arch} file here: it has no {e} to read the config from"
    except ValueError as e:
        return f"no diffusers run of this {arch} file: {e}"
    return ""


def config(arch: str, shapes: dict[str, tuple[int, ...]], folder: Path) -> dict | None:
    """The diffusers config of a denoiser with `shapes` (GGUF names), written as folder/config.json; None where
    it gets no run (`reason` says why)."""
    if reason(arch, shapes):
        return None
    made = RUNS[arch](shapes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(made))
    return made


def denoiser(file: Path, names: dict[str, str]) -> dict:
    """The single file's denoiser tensors under the names the GGUF file gives them (`names`: key -> name): some of
    diffusers' converters (FLUX.2's; Qwen-Image's, which is none) do not remove ComfyUI's `model.diffusion_model.`."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return {name: f.get_tensor(key) for key, name in names.items()}


def outputs(arch: str, source: Path | dict, made: dict, folder: Path, gguf: bool):
    """The denoiser's outputs on the seeded inputs (float32, flattened one after the other), `source` (a file, or
    `denoiser`'s tensors) loaded by diffusers' single-file loader; `gguf`: a GGUF file, through its GGUF quantizer
    (dequantized on the fly, computing in float32)."""
    import diffusers
    import torch

    cls = getattr(diffusers, made["_class_name"])
    where = source if isinstance(source, dict) else str(source)
    if arch in UNETS:  # diffusers' ldm converter reads the prefixed keys; its GGUF loader no orig_shape
        where = diffusion_unet.read_as_comfyui(source) if gguf else {diffusion_unet.LDM_PREFIX + k: v
                                                                      for k, v in source.items()}  # fmt: skip
    if gguf:
        q = diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32)
        model = cls.from_single_file(where, config=str(folder), quantization_config=q)
    else:
        model = cls.from_single_file(where, config=str(folder), torch_dtype=torch.float32)
    model.eval()
    inputs = denoiser_inputs.seeded(made["_class_name"], model.config, 0.5, torch.Generator().manual_seed(0))
    with torch.no_grad():
        return denoiser_inputs.flat(model(**inputs, return_dict=False)).numpy()
