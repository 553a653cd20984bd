"""Seeded inputs for one forward of a diffusion denoiser, by its diffusers class: shared by a merge's behaviour check
(converter.verification.diffusion, at timesteps across the schedule) and the diffusion GGUF proof
(converter.gguf.diffusion_run, at mid-schedule).

Why by class and config: both know the model only as diffusers builds it (`model.config`). Sizes are the smallest
each forward takes (a few patches, eight text tokens). The timestep is given as a fraction of the schedule and
passed in the unit the class's pipeline uses: a step out of 1000, or the fraction itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

TEXT = 8  # text tokens
STEPS = 1000  # a schedule's training steps, for the classes whose pipelines pass a step number


def _unet(c: Mapping, f: float, g) -> dict:
    import torch

    size = min(int(c.get("sample_size") or 32), 32)  # (a config read from a file's shapes has none)
    made = {
        "sample": torch.randn(1, c["in_channels"], size, size, generator=g), "timestep": round(f * STEPS),
        "encoder_hidden_states": torch.randn(1, TEXT, c["cross_attention_dim"], generator=g),
    }  # fmt: skip
    if c.get("addition_embed_type") == "text_time":
        pooled = c["projection_class_embeddings_input_dim"] - 6 * c["addition_time_embed_dim"]
        made["added_cond_kwargs"] = {
            "text_embeds": torch.randn(1, pooled, generator=g),
            "time_ids": torch.tensor([[size * 8, size * 8, 0, 0, size * 8, size * 8]], dtype=torch.float32),
        }
    return made


def _grid(side: int, axes: int):
    """Positions (0, row, col[, 0]) of a side x side grid of packed latents, as FLUX pipelines make them."""
    import torch

    zero = torch.zeros(1)
    parts = (zero, torch.arange(float(side)), torch.arange(float(side)), *([zero] * (axes - 3)))
    return torch.stack(torch.meshgrid(*parts, indexing="ij"), -1).reshape(side * side, axes)


def _flux(c: Mapping, f: float, g) -> dict:
    """FluxPipeline's call: packed latents (4 x 4 tokens), their (0, row, col) ids, text ids 0, the fraction."""
    import torch

    made = {
        "hidden_states": torch.randn(1, 16, c["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(1, TEXT, c["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(1, c["pooled_projection_dim"], generator=g),
        "timestep": torch.tensor([f]), "img_ids": _grid(4, 3), "txt_ids": torch.zeros(TEXT, 3),
    }  # fmt: skip
    if c["guidance_embeds"]:
        made["guidance"] = torch.tensor([3.5])
    return made


def _flux2(c: Mapping, f: float, g) -> dict:
    """FLUX.2's positions have four axes (time, height, width, index); the text's count along the last."""
    import torch

    made = {
        "hidden_states": torch.randn(1, 16, c["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(1, TEXT, c["joint_attention_dim"], generator=g),
        "timestep": torch.tensor([f]), "img_ids": _grid(4, 4),
        "txt_ids": torch.cat([torch.zeros(TEXT, 3), torch.arange(float(TEXT))[:, None]], 1),
    }  # fmt: skip
    if c["guidance_embeds"]:
        made["guidance"] = torch.tensor([4.0])
    return made


def _qwen_image(c: Mapping, f: float, g) -> dict:
    import torch

    side = 4  # a 4 x 4 grid of packed patches
    return {
        "hidden_states": torch.randn(1, side * side, c["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(1, TEXT, c["joint_attention_dim"], generator=g),
        "encoder_hidden_states_mask": torch.ones(1, TEXT), "timestep": torch.tensor([f]),
        "img_shapes": [[(1, side, side)]],
    }  # fmt: skip


def _wan(c: Mapping, f: float, g) -> dict:
    """One latent frame of 4 x 4 patches (Wan and the models built on it: SkyReels-V2, ChronoEdit)."""
    import torch

    _, ph, pw = c["patch_size"]
    return {
        "hidden_states": torch.randn(1, c["in_channels"], 1, 4 * ph, 4 * pw, generator=g),
        "timestep": torch.tensor([f * STEPS]),
        "encoder_hidden_states": torch.randn(1, TEXT, c["text_dim"], generator=g),
    }


def _skyreels_v2(c: Mapping, f: float, g) -> dict:
    """Wan's, and where the model embeds the frame rate, its index as SkyReels-V2's pipeline passes it (0: 16 fps)."""

    made = _wan(c, f, g)
    return made | ({"fps": [0]} if c.get("inject_sample_info") else {})


def _sd3(c: Mapping, f: float, g) -> dict:
    import torch

    side = 2 * c["patch_size"]
    return {
        "hidden_states": torch.randn(1, c["in_channels"], side, side, generator=g),
        "encoder_hidden_states": torch.randn(1, TEXT, c["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(1, c["pooled_projection_dim"], generator=g),
        "timestep": torch.tensor([f * STEPS]),
    }


def _ltxv(c: Mapping, f: float, g) -> dict:
    import torch

    frames, height, width = 2, 2, 2
    return {
        "hidden_states": torch.randn(1, frames * height * width, c["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(1, TEXT, c["caption_channels"], generator=g),
        "timestep": torch.tensor([round(f * STEPS)]), "encoder_attention_mask": torch.ones(1, TEXT),
        "num_frames": frames, "height": height, "width": width,
    }  # fmt: skip


def _ltx2(c: Mapping, f: float, g) -> dict:
    """Video latents on a 2 x 2 x 2 grid, 4 audio latent frames, and text states for each stream (LTX-2.0 projects
    both from the caption's width)."""
    import torch

    frames, height, width, audio_frames = 2, 2, 2, 4
    return {
        "hidden_states": torch.randn(1, frames * height * width, c["in_channels"], generator=g),
        "audio_hidden_states": torch.randn(1, audio_frames, c["audio_in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(1, TEXT, c["caption_channels"], generator=g),
        "audio_encoder_hidden_states": torch.randn(1, TEXT, c["caption_channels"], generator=g),
        "timestep": torch.tensor([f * STEPS]), "encoder_attention_mask": torch.ones(1, TEXT),
        "audio_encoder_attention_mask": torch.ones(1, TEXT), "num_frames": frames, "height": height, "width": width,
        "audio_num_frames": audio_frames,
    }  # fmt: skip


def _aura(c: Mapping, f: float, g) -> dict:
    import torch

    side = 2 * c["patch_size"]  # a 2 x 2 grid of patches, inside the learnt positions' grid
    return {
        "hidden_states": torch.randn(1, c["in_channels"], side, side, generator=g),
        "encoder_hidden_states": torch.randn(1, TEXT, c["joint_attention_dim"], generator=g),
        "timestep": torch.tensor([f]),
    }


def _hidream(c: Mapping, f: float, g) -> dict:
    import torch

    side = 2 * c["patch_size"]
    t5, llama = c["caption_channels"]
    return {
        "hidden_states": torch.randn(1, c["in_channels"], side, side, generator=g),
        "timesteps": torch.tensor([round(f * STEPS)]),
        "encoder_hidden_states_t5": torch.randn(1, TEXT, t5, generator=g),
        "encoder_hidden_states_llama3": torch.randn(len(c["llama_layers"]), 1, TEXT, llama, generator=g),
        "pooled_embeds": torch.randn(1, c["text_emb_dim"], generator=g),
    }  # fmt: skip


def _cosmos(c: Mapping, f: float, g) -> dict:
    """Its last input channel is the padding mask (zeros: no padding), fed as a channel where the model does not
    concatenate the mask itself (diffusers' own concatenation resizes it through torchvision)."""
    import torch

    if c.get("concat_padding_mask"):
        extra = {"padding_mask": torch.zeros(1, 1, 4, 4)}
        latents = torch.randn(1, c["in_channels"], 1, 4, 4, generator=g)
    else:
        extra = {}
        latents = torch.cat([torch.randn(1, c["in_channels"] - 1, 1, 4, 4, generator=g), torch.zeros(1, 1, 1, 4, 4)], 1)
    return {
        "hidden_states": latents, "timestep": torch.tensor([f]),
        "encoder_hidden_states": torch.randn(1, TEXT, c["text_embed_dim"], generator=g), **extra,
    }  # fmt: skip


def _lumina2(c: Mapping, f: float, g) -> dict:
    import torch

    return {
        "hidden_states": torch.randn(1, c["in_channels"], 4, 4, generator=g), "timestep": torch.tensor([f]),
        "encoder_hidden_states": torch.randn(1, TEXT, c["cap_feat_dim"], generator=g),
        "encoder_attention_mask": torch.ones(1, TEXT, dtype=torch.bool),
    }  # fmt: skip


def _hunyuan_video(c: Mapping, f: float, g) -> dict:
    """Two latent frames of 2 x 2 patches; eight text tokens, the last two padding (masked, as a short prompt is)."""
    import torch

    t, side = 2 * c["patch_size_t"], 2 * c["patch_size"]
    made = {
        "hidden_states": torch.randn(1, c["in_channels"], t, side, side, generator=g),
        "encoder_hidden_states": torch.randn(1, TEXT, c["text_embed_dim"], generator=g),
        "timestep": torch.tensor([f * STEPS]), "encoder_attention_mask": torch.tensor([[1.0] * (TEXT - 2) + [0.0] * 2]),
        "pooled_projections": torch.randn(1, c["pooled_projection_dim"], generator=g),
    }  # fmt: skip
    if c["guidance_embeds"]:
        made["guidance"] = torch.tensor([6000.0])  # Hunyuan Video's guidance 6, times 1000 as its pipeline does
    return made


def _z_image(c: Mapping, f: float, g) -> dict:
    import torch

    return {
        "x": [torch.randn(c["in_channels"], 1, 4, 4, generator=g)], "t": torch.tensor([f]),
        "cap_feats": [torch.randn(TEXT, c["cap_feat_dim"], generator=g)],
    }  # fmt: skip


INPUTS: dict[str, Callable[[Mapping, float, object], dict]] = {
    "UNet2DConditionModel": _unet, "FluxTransformer2DModel": _flux, "Flux2Transformer2DModel": _flux2,
    "QwenImageTransformer2DModel": _qwen_image, "WanTransformer3DModel": _wan, "ChronoEditTransformer3DModel": _wan,
    "SkyReelsV2Transformer3DModel": _skyreels_v2, "SD3Transformer2DModel": _sd3,
    "LTXVideoTransformer3DModel": _ltxv, "LTX2VideoTransformer3DModel": _ltx2, "AuraFlowTransformer2DModel": _aura,
    "HiDreamImageTransformer2DModel": _hidream, "CosmosTransformer3DModel": _cosmos,
    "Lumina2Transformer2DModel": _lumina2, "HunyuanVideoTransformer3DModel": _hunyuan_video,
    "ZImageTransformer2DModel": _z_image,
}  # fmt: skip


def seeded(cls: str, config: Mapping, fraction: float, g) -> dict:
    """The keyword arguments of one forward of a `cls` built with `config`, at `fraction` of the schedule, drawn
    from the generator `g`."""
    return INPUTS[cls](config, fraction, g)


def flat(returned):
    """A forward's outputs (`return_dict=False`) as one float32 vector: every output counts (LTX-2's video and
    audio), a list of one output per sample (Z-Image's) stacked."""
    import torch

    parts = [torch.stack(out) if isinstance(out, list) else out for out in returned]
    return torch.cat([p.float().flatten() for p in parts])
