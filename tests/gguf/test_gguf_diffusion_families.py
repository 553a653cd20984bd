"""GGUF out for every diffusion family the writer claims: its architecture name, its tensors' types, and, where
diffusers' GGUF single-file loader reads a test-sized model, its behaviour.

Each family's tiny original single file is built from a tiny diffusers model (tests/family_cases.py; SD3 from
tests/formats/test_community_sd3.py; AuraFlow and Hunyuan Video here), whose original layout diffusers' own
single-file converter reads back. Oracles:
ComfyUI-GGUF's conventions (architecture names, the tensors it keeps F32), written here from its converter's rules,
not read from ours, and diffusers' GGUF loader for the behaviour part.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from converter.errors import BadInputError
from converter.gguf import diffusion, diffusion_arch, diffusion_export, diffusion_proof, diffusion_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
from diffusion_helpers import _perturb, save  # noqa: E402
from family_cases import CASES, keymap, make_bases, original_layout, tiny  # noqa: E402

# family (tests/family_cases.py's names, and SD3) -> the general.architecture ComfyUI-GGUF's loaders take for it
ARCH = {"flux": "flux", "flux2": "flux", "qwen_image": "qwen_image", "z_image": "lumina2", "lumina2": "lumina2",
        "wan": "wan", "skyreels_v2": "wan", "chronoedit": "wan", "ltx_video": "ltxv", "ltx2": "ltxv",
        "hidream": "hidream", "anima": "cosmos", "sd3": "sd3", "auraflow": "aura",
        "hunyuan_video": "hyvid"}  # fmt: skip
NOT_CLAIMED = ["krea2", "flux3", "minimax_h3"]  # no architecture of ComfyUI-GGUF's: refused

# The tensors ComfyUI-GGUF's converter keeps F32 whatever the type (read outside a Linear), at their real shapes,
# each beside a tensor of the same model that is quantized; SD3's pos_embed is ours (diffusers reads it raw).
KEPT = {
    "wan": [("blocks.0.modulation", (1, 6, 5120)), ("head.modulation", (1, 2, 5120))],
    "ltxv": [("transformer_blocks.0.scale_shift_table", (6, 2048)), ("scale_shift_table", (2, 2048))],
    "hidream": [("double_stream_blocks.0.block.ff_i.gate.weight", (4, 2560)), ("img_emb.emb_pos", (1, 4096, 2560))],
    "cosmos": [("pos_embedder.dim_spatial_range", (1, 2048))],
    "sd3": [("pos_embed", (1, 36864, 1536))],
}
QUANTIZED = {"wan": "blocks.0.ffn.0.weight", "ltxv": "transformer_blocks.0.attn1.to_q.weight",
             "hidream": "double_stream_blocks.0.block.attn1.to_q.weight", "cosmos": "blocks.0.mlp.layer1.weight",
             "sd3": "joint_blocks.0.x_block.attn.qkv.weight"}  # fmt: skip


def _sd3_file(root: Path) -> tuple[Path, object]:
    from diffusion_helpers import save
    from test_community_sd3 import tiny_sd3, to_original

    model = tiny_sd3()
    return save(to_original(model.state_dict()), root / "sd3-tiny.safetensors"), model


AURA_NAMES = [  # diffusers' AuraFlow names -> AuraFlow's own, in order: diffusers' single-file converter read backwards
    (r"time_step_proj\.linear_1\.", "t_embedder.mlp.0."), (r"time_step_proj\.linear_2\.", "t_embedder.mlp.2."),
    (r"context_embedder\.", "cond_seq_linear."), (r"proj_out\.", "final_linear."), (r"norm_out\.linear\.", "modF.1."),
    (r"pos_embed\.pos_embed", "positional_encoding"), (r"pos_embed\.proj\.", "init_x_linear."),
    (r"joint_transformer_blocks\.(\d+)\.ff\.", r"double_layers.\1.mlpX."),
    (r"joint_transformer_blocks\.(\d+)\.ff_context\.", r"double_layers.\1.mlpC."),
    (r"joint_transformer_blocks\.(\d+)\.norm1\.linear\.", r"double_layers.\1.modX.1."),
    (r"joint_transformer_blocks\.(\d+)\.norm1_context\.linear\.", r"double_layers.\1.modC.1."),
    (r"joint_transformer_blocks\.(\d+)\.attn\.to_([qkv])\.", r"double_layers.\1.attn.w2\2."),
    (r"joint_transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"double_layers.\1.attn.w2o."),
    (r"joint_transformer_blocks\.(\d+)\.attn\.add_([qkv])_proj\.", r"double_layers.\1.attn.w1\2."),
    (r"joint_transformer_blocks\.(\d+)\.attn\.to_add_out\.", r"double_layers.\1.attn.w1o."),
    (r"single_transformer_blocks\.(\d+)\.ff\.", r"single_layers.\1.mlp."),
    (r"single_transformer_blocks\.(\d+)\.norm1\.linear\.", r"single_layers.\1.modCX.1."),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_([qkv])\.", r"single_layers.\1.attn.w1\2."),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"single_layers.\1.attn.w1o."),
    (r"(mlp[XC]?)\.linear_1\.", r"\1.c_fc1."), (r"(mlp[XC]?)\.linear_2\.", r"\1.c_fc2."),
    (r"(mlp[XC]?)\.out_projection\.", r"\1.c_proj."),
]  # fmt: skip


def _aura_name(key: str) -> str:
    for pattern, name in AURA_NAMES:
        key = re.sub(pattern, name, key)
    return key


def _auraflow_file(root: Path) -> tuple[Path, object]:
    """A tiny AuraFlow's original single file: diffusers' names renamed back and the final modulation's halves
    swapped back ([scale, shift] to AuraFlow's [shift, scale]); diffusers' own converter
    (convert_auraflow_transformer_checkpoint_to_diffusers) must give the diffusers weights back exactly."""
    from diffusers import AuraFlowTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_auraflow_transformer_checkpoint_to_diffusers

    torch.manual_seed(0)
    model = _perturb(AuraFlowTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16, out_channels=4, pos_embed_max_size=16,
    ), 0)  # fmt: skip
    sd = model.state_dict()
    original = {_aura_name(k): v for k, v in sd.items()}
    original["modF.1.weight"] = torch.cat(original["modF.1.weight"].chunk(2)[::-1])
    back = convert_auraflow_transformer_checkpoint_to_diffusers(dict(original))
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    prefixed = {f"model.diffusion_model.{k}": v for k, v in original.items()}
    return save(prefixed, root / "auraflow-tiny.safetensors"), model


HYVID_NAMES = [  # diffusers' names the keymap's layout leaves -> Tencent's, in order: diffusers' converter backwards
    (r"^context_embedder\.token_refiner\.refiner_blocks\.", "txt_in.individual_token_refiner.blocks."),
    (r"^context_embedder\.proj_in\.", "txt_in.input_embedder."),
    (r"^context_embedder\.time_text_embed\.timestep_embedder\.linear_1\.", "txt_in.t_embedder.mlp.0."),
    (r"^context_embedder\.time_text_embed\.timestep_embedder\.linear_2\.", "txt_in.t_embedder.mlp.2."),
    (r"^context_embedder\.time_text_embed\.text_embedder\.", "txt_in.c_embedder."),
    (r"^(txt_in\.individual_token_refiner\.blocks\.\d+)\.attn\.to_out\.0\.", r"\1.self_attn_proj."),
    (r"^(txt_in\.individual_token_refiner\.blocks\.\d+)\.ff\.net\.0\.proj\.", r"\1.mlp.fc1."),
    (r"^(txt_in\.individual_token_refiner\.blocks\.\d+)\.ff\.net\.2\.", r"\1.mlp.fc2."),
    (r"^(txt_in\.individual_token_refiner\.blocks\.\d+)\.norm_out\.linear\.", r"\1.adaLN_modulation.1."),
    (r"^time_text_embed\.timestep_embedder\.linear_1\.", "time_in.mlp.0."),
    (r"^time_text_embed\.timestep_embedder\.linear_2\.", "time_in.mlp.2."),
    (r"^time_text_embed\.guidance_embedder\.linear_1\.", "guidance_in.mlp.0."),
    (r"^time_text_embed\.guidance_embedder\.linear_2\.", "guidance_in.mlp.2."),
    (r"^time_text_embed\.text_embedder\.linear_1\.", "vector_in.in_layer."),
    (r"^time_text_embed\.text_embedder\.linear_2\.", "vector_in.out_layer."),
    (r"^x_embedder\.", "img_in."), (r"^proj_out\.", "final_layer.linear."),
    (r"^norm_out\.linear\.", "final_layer.adaLN_modulation.1."),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_([qk])\.", r"double_blocks.\1.img_attn_\2_norm."),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_added_([qk])\.", r"double_blocks.\1.txt_attn_\2_norm."),
    (r"^single_transformer_blocks\.(\d+)\.attn\.norm_([qk])\.", r"single_blocks.\1.\2_norm."),
]  # fmt: skip
LINEAR1 = re.compile(r"single_blocks\.(\d+)\.linear1\.(weight|bias)")
LINEAR1_PARTS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")  # its rows, in order (diffusers' converter)


def _hyvid_original(sd: dict) -> dict:
    """Hunyuan Video's original checkpoint of diffusers weights `sd`: the keymap's layout (the modules LoRAs name),
    the other keys renamed (HYVID_NAMES), the refiners' q/k/v and single blocks' linear1 biases fused, and the
    final modulation's halves swapped back ([scale, shift] to Tencent's [shift, scale])."""
    out = {}
    for key, t in original_layout(sd, keymap("hunyuan_video")).items():
        for pattern, name in HYVID_NAMES:
            key = re.sub(pattern, name, key)
        out[key] = t
    for key in [k for k in out if re.fullmatch(r"txt_in\..*\.attn\.to_q\.(weight|bias)", k)]:
        stem, p = key.split(".attn.to_q.")
        out[f"{stem}.self_attn_qkv.{p}"] = torch.cat([out.pop(f"{stem}.attn.to_{x}.{p}") for x in "qkv"])
    for i in range(_count_single(out)):
        parts = [f"single_transformer_blocks.{i}.{part}.bias" for part in LINEAR1_PARTS]
        out[f"single_blocks.{i}.linear1.bias"] = torch.cat([out.pop(k) for k in parts])
    for p in ("weight", "bias"):
        key = f"final_layer.adaLN_modulation.1.{p}"
        out[key] = torch.cat(out[key].chunk(2)[::-1])
    return out


def _count_single(sd: dict) -> int:
    return len({k.split(".")[1] for k in sd if k.startswith("single_blocks.")})


def _convert_at_width(checkpoint: dict, width: int) -> dict:
    """diffusers' Hunyuan Video converter, single blocks' linear1 split at `width` as it splits it at its fixed 3072
    (q, k, v of the width each, then the MLP); every other key converted by diffusers itself."""
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers

    linear1 = {k: checkpoint.pop(k) for k in list(checkpoint) if LINEAR1.fullmatch(k)}
    return convert_hunyuan_video_transformer_to_diffusers(checkpoint) | _linear1_at_width(linear1, width)


def _linear1_at_width(linear1: dict, width: int) -> dict:
    """Single blocks' linear1 rows split at `width` as diffusers' FLUX.1 and Hunyuan Video converters split them at
    their fixed 3072 (q, k, v of the width each, then the MLP), under diffusers' names."""
    out = {}
    for key, t in linear1.items():
        i, p = LINEAR1.fullmatch(key).groups()
        rows = torch.split(t, (width, width, width, t.shape[0] - 3 * width))
        out |= {f"single_transformer_blocks.{i}.{part}.{p}": r for part, r in zip(LINEAR1_PARTS, rows, strict=True)}
    return out


def _hyvid_file(root: Path, name: str = "hunyuan_video") -> tuple[Path, object]:
    """A tiny Hunyuan Video's (or FramePack's: its blocks and names, and its history embedder) whole original single
    file; diffusers' converter must give the diffusers weights back exactly (single blocks' linear1, which it splits
    at 3072 only, split at the tiny width as it splits it)."""
    model = tiny(CASES[name])
    sd = model.state_dict()
    original = _hyvid_original(sd)
    back = _convert_at_width(dict(original), model.config["num_attention_heads"] * model.config["attention_head_dim"])
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    prefixed = {f"model.diffusion_model.{k}": v for k, v in original.items()}
    return save(prefixed, root / f"{name}-original.safetensors"), model


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """Each family's tiny original single file and its diffusers model, built once on first use."""
    cache = {}

    def get(name: str) -> tuple[Path, object]:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            if name in ("sd3", "auraflow", "hunyuan_video"):
                build = {"sd3": _sd3_file, "auraflow": _auraflow_file, "hunyuan_video": _hyvid_file}[name]
                cache[name] = build(root)
            else:
                model = tiny(CASES[name])
                cache[name] = (make_bases(CASES[name], model, root)[1], model)
        return cache[name]

    return get


def _rule(key: str, shape: tuple[int, ...], arch: str) -> str:
    """ComfyUI-GGUF's type rule for a Q8_0 file, restated: F32 for 1-D, small, more than 4-D and kept tensors; F16
    where a row is no whole Q8_0 block; Q8_0 otherwise."""
    n = 1
    for d in shape:
        n *= d
    if len(shape) <= 1 or len(shape) > 4 or n <= 1024 or any(key == k for k, _ in KEPT.get(arch, [])):
        return "F32"
    return "F16" if shape[-1] % 32 else "Q8_0"


@pytest.mark.parametrize("name", sorted(ARCH))
def test_each_family_is_written_under_its_comfyui_architecture(single, name, tmp_path):
    """The tiny original file of each family: its GGUF names the architecture ComfyUI-GGUF loads it as, holds the
    denoiser's keys without the checkpoint's prefix, and stores each tensor by the type rule."""
    path, _ = single(name)
    src = diffusion.open_source(path)
    out = tmp_path / "x-Q8_0.gguf"
    diffusion.write(src, {"Q8_0": out}, "x")
    reader = gguf.GGUFReader(out)
    assert reader.get_field("general.architecture").contents() == ARCH[name]
    with safe_open(path, framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    prefix = "net." if name == "anima" else "model.diffusion_model."
    assert {t.name for t in reader.tensors} == {k.removeprefix(prefix) for k in shapes}
    for t in reader.tensors:
        assert t.tensor_type.name == _rule(t.name, shapes[prefix + t.name], ARCH[name]), t.name


@pytest.mark.parametrize("arch", sorted(KEPT))
def test_tensors_read_outside_a_linear_stay_f32_at_real_sizes(arch):
    a = {x.name: x for x in diffusion_arch.ARCHES}[arch]
    q8 = gguf.GGMLQuantizationType.Q8_0
    for key, shape in KEPT[arch]:
        assert diffusion_arch.stored_type(key, shape, a, q8).name == "F32", key
    assert diffusion_arch.stored_type(QUANTIZED[arch], (3072, 3072), a, q8) == q8


def _made_up(path: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    g = torch.Generator().manual_seed(0)
    save_file({f"model.diffusion_model.{k}": torch.randn(*s, generator=g) for k, s in shapes.items()}, path)
    return path


MADE_UP = {  # families without a tiny original single file here: their marker keys and a few others, real shapes
    "sdxl": {"input_blocks.0.0.weight": (320, 4, 3, 3), "label_emb.0.0.weight": (1280, 2816),
             "time_embed.0.weight": (1280, 320), "out.2.weight": (4, 320, 3, 3)},
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(MADE_UP))
def test_made_up_files_of_the_other_architectures(arch, tmp_path):
    src = diffusion.open_source(_made_up(tmp_path / "m.safetensors", MADE_UP[arch]))
    assert src.arch.name == arch
    plan = {p.name: p for p in src.plan("Q8_0")}
    assert plan["input_blocks.0.0.weight"].stored == (320 * 4 * 9 // 256, 256)  # a UNet: rows of 256


@pytest.mark.parametrize("name", NOT_CLAIMED)
def test_families_comfyui_gguf_does_not_load_are_refused(single, name):
    with pytest.raises(BadInputError, match="no diffusion architecture ComfyUI-GGUF loads"):
        diffusion.open_source(single(name)[0])


def _negate(path: Path, name: str) -> None:
    reader = gguf.GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == name)
    t.data[...] = -t.data
    reader.data.flush()


def _negated_fails(file: Path, name: str, ref) -> None:
    """A copy of the F16 `file` with `name` negated fails the behaviour part on its own (judged, not passed)."""
    bad = file.with_name(f"bad-{file.name}")
    bad.write_bytes(file.read_bytes())
    _negate(bad, name)
    failed = diffusion_proof.prove_behaviour(bad, ref, "F16")
    assert failed.judged and not failed.passed, failed.detail


# family -> (the config keys the proof reads from the shapes, a tensor whose sign diffusers' output shows)
BEHAVIOUR = {
    "sd3": (("patch_size", "in_channels", "num_layers", "attention_head_dim", "num_attention_heads",
             "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim", "out_channels",
             "pos_embed_max_size", "qk_norm"), "joint_blocks.0.x_block.mlp.fc2.weight"),
    "anima": (("out_channels", "num_attention_heads", "attention_head_dim", "num_layers", "mlp_ratio",
               "text_embed_dim", "adaln_lora_dim", "extra_pos_embed_type"), "blocks.0.mlp.layer2.weight"),
    "hidream": (("in_channels", "out_channels", "num_layers", "num_single_layers", "caption_channels", "text_emb_dim",
                 "num_routed_experts"), "double_stream_blocks.0.block.ff_i.shared_experts.w2.weight"),
    "ltx_video": (("in_channels", "out_channels", "cross_attention_dim", "num_layers", "caption_channels"),
                  "transformer_blocks.0.ff.net.2.weight"),
    "auraflow": (("in_channels", "out_channels", "num_mmdit_layers", "num_single_dit_layers", "joint_attention_dim",
                  "caption_projection_dim", "pos_embed_max_size"), "double_layers.0.mlpX.c_proj.weight"),
    "ltx2": (("in_channels", "out_channels", "cross_attention_dim", "audio_in_channels", "audio_out_channels",
              "audio_cross_attention_dim", "num_layers", "caption_channels"), "transformer_blocks.0.ff.net.2.weight"),
    "z_image": (("in_channels", "dim", "n_layers", "n_refiner_layers", "n_heads", "n_kv_heads", "cap_feat_dim"),
                "layers.0.feed_forward.w2.weight"),
    "flux2": (("in_channels", "num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
               "joint_attention_dim", "timestep_guidance_channels", "mlp_ratio", "guidance_embeds"),
              "double_blocks.0.img_mlp.2.weight"),
    "qwen_image": (("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                    "num_attention_heads", "joint_attention_dim"), "transformer_blocks.0.img_mlp.net.2.weight"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BEHAVIOUR))
def test_behaviour_is_judged_by_diffusers_and_fails_a_negated_tensor(single, name, tmp_path):
    """diffusers' GGUF loader runs the F16 file like the source; the config the proof reads from the shapes is the
    model's own; one negated tensor fails the behaviour part on its own."""
    path, model = single(name)
    keys, sabotaged = BEHAVIOUR[name]
    result = diffusion_export.export(path, ["F16"], tmp_path / "out")
    behaviour = result.proofs[0].parts[-1]
    assert behaviour.name == "behaviour" and behaviour.judged and behaviour.passed, behaviour.detail
    src = diffusion.open_source(path)
    ref = diffusion_proof.Reference(src)
    try:
        assert ref.output is not None, ref.why
        made = ref.config
        assert {k: made[k] for k in keys} == {k: model.config[k] for k in keys}
        _negated_fails(result.files[0], sabotaged, ref)
    finally:
        ref.close()


def test_ltx2_is_run_as_its_own_class_and_its_audio_output_counts(single, tmp_path):
    """LTX-2 files are `ltxv` to ComfyUI-GGUF like LTX-Video's; their audio keys send them to diffusers' LTX-2 class,
    whose audio output is compared beside the video's: the audio's last projection, which the video output never
    sees, negated alone fails the behaviour part."""
    path, _ = single("ltx2")
    src = diffusion.open_source(path)
    ref = diffusion_proof.Reference(src)
    try:
        assert ref.output is not None, ref.why
        assert ref.config["_class_name"] == "LTX2VideoTransformer3DModel"
        out = tmp_path / "x-F16.gguf"
        diffusion.write(src, {"F16": out}, "x")
        assert diffusion_proof.prove_behaviour(out, ref, "F16").passed
        _negated_fails(out, "audio_proj_out.weight", ref)
    finally:
        ref.close()


# Lumina-Image 2.0's widths (2304 query rows, 768 key and value), the rest tiny
LUMINA2_WIDE = dict(hidden_size=2304, num_attention_heads=3, num_kv_heads=1, num_layers=1, num_refiner_layers=1,
                    multiple_of=64, ffn_dim_multiplier=64 / (4 * 2304), cap_feat_dim=16, axes_dim_rope=(256, 256, 256),
                    axes_lens=(16, 16, 16))  # fmt: skip
LUMINA2_READ = ("in_channels", "hidden_size", "num_layers", "num_refiner_layers", "num_attention_heads", "num_kv_heads",
                "multiple_of", "cap_feat_dim")  # fmt: skip


def test_lumina2_is_judged_at_lumina_image_2_s_own_widths(single, tmp_path):
    """Lumina 2 and Z-Image are both `lumina2` (Z-Image's pad tokens tell them apart). diffusers' Lumina 2 converter
    splits qkv at Lumina-Image 2.0's widths whatever the file, so a test-sized file gets no run, said so; one at
    those widths (about 66 M parameters: one layer, one refiner each, a narrow feed-forward) is judged: the config
    read from its shapes is the model's own, its F16 file passes and one negated tensor fails it."""
    path, _ = single("lumina2")
    src = diffusion.open_source(path)
    assert "2304" in diffusion_run.reason("lumina2", {n: src.shapes[k] for k, n in src.names.items()})
    case = dataclasses.replace(CASES["lumina2"], config=CASES["lumina2"].config | LUMINA2_WIDE)
    model = tiny(case)
    wide = make_bases(case, model, tmp_path)[1]
    result = diffusion_export.export(wide, ["F16"], tmp_path / "out", log=lambda _: None)
    behaviour = result.proofs[0].parts[-1]
    assert result.diffusers_class == "Lumina2Transformer2DModel"
    assert behaviour.judged and behaviour.passed, behaviour.detail
    ref = diffusion_proof.Reference(diffusion.open_source(wide))
    try:
        assert {k: ref.config[k] for k in LUMINA2_READ} == {k: model.config[k] for k in LUMINA2_READ}
        _negated_fails(result.files[0], "layers.0.feed_forward.w2.weight", ref)
    finally:
        ref.close()


FLUX1_KEYS = ("in_channels", "num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
              "joint_attention_dim", "pooled_projection_dim", "guidance_embeds")  # fmt: skip
BFL_NORMS = {  # diffusers' q/k norm names -> BFL's, for the keymap's layout of FLUX.1
    r"transformer_blocks\.(\d+)\.attn\.norm_(added_)?([qk])\.weight": "double_blocks.{0}.{1}_attn.norm.{2}_norm.scale",
    r"single_transformer_blocks\.(\d+)\.attn\.norm_()([qk])\.weight": "single_blocks.{0}.norm.{2}_norm.scale",
}


def _bfl_flux(root: Path) -> Path:
    """The tiny FLUX.1's whole BFL file: the keymap's layout covers the modules LoRAs name, so the q/k norms are
    renamed here and the single blocks' linear1 bias gets its MLP part (its q/k/v-only alias dropped)."""
    import re

    sd = {}
    for key, t in original_layout(tiny(CASES["flux"]).state_dict(), keymap("flux")).items():
        for pattern, name in BFL_NORMS.items():
            if m := re.fullmatch(pattern, key):
                i, added, qk = m.groups()
                key = name.format(i, "txt" if added else "img", "query" if qk == "q" else "key")
        sd[key] = t
    for i in range(CASES["flux"].config["num_single_layers"]):
        mlp = sd.pop(f"single_transformer_blocks.{i}.proj_mlp.bias")
        sd[f"single_blocks.{i}.linear1.bias"] = torch.cat([sd[f"single_blocks.{i}.linear1.bias"], mlp])
        del sd[f"single_blocks.{i}.linear1_qkv.weight"], sd[f"single_blocks.{i}.linear1_qkv.bias"]
    assert not [k for k in sd if "transformer_blocks" in k or "norm_out" in k]
    return save({f"model.diffusion_model.{k}": v for k, v in sd.items()}, root / "flux1-bfl.safetensors")


def test_flux1_behaviour_is_not_judged_below_flux1_s_own_width(tmp_path):
    """diffusers' FLUX.1 converter (convert_flux_transformer_checkpoint_to_diffusers) splits single blocks' linear1
    at FLUX.1's width 3072 and mlp ratio 4 whatever the file's shapes, so a test-sized file gets no run (said so);
    the config read from its shapes is still the model's. FLUX.2's files, also `flux`, are told apart and judged."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    path = _bfl_flux(tmp_path)
    src = diffusion.open_source(path)
    shapes = {n: src.shapes[k] for k, n in src.names.items()}
    assert diffusion_run.config("flux", shapes, tmp_path / "c") is None
    assert "3072" in diffusion_run.reason("flux", shapes)
    wide = shapes | {"img_in.weight": (3072, 64), "single_blocks.0.linear1.weight": (7 * 3072, 3072)}
    assert diffusion_run.reason("flux", wide) == ""  # FLUX.1's own width: judged
    made = diffusion_run._flux1(shapes)
    model = tiny(CASES["flux"])
    assert {k: made[k] for k in FLUX1_KEYS} == {k: model.config[k] for k in FLUX1_KEYS}
    behaviour = diffusion_export.export(path, ["F16"], tmp_path / "out").proofs[0].parts[-1]
    assert behaviour.passed and not behaviour.judged and "3072" in behaviour.detail
    with safe_open(path, framework="pt") as f:
        checkpoint = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    with pytest.raises(RuntimeError, match="split_with_sizes expects split_sizes to sum exactly to 112"):
        convert_flux_transformer_checkpoint_to_diffusers(checkpoint)


def _flux1_convert_at_width(checkpoint: dict, width: int) -> dict:
    """diffusers' FLUX.1 converter with single blocks' linear1 split at `width` as it splits it at its fixed 3072 (q,
    k, v of the width each, then the MLP): it is handed zeros of FLUX.1's rows in their place, and the file's own
    rows, split, replace the parts it made of them; every other key is converted by diffusers itself."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    linear1 = {k: t for k, t in checkpoint.items() if LINEAR1.fullmatch(k)}
    for key, t in linear1.items():
        checkpoint[key] = torch.zeros(7 * 3072, *t.shape[1:], dtype=t.dtype)
    return convert_flux_transformer_checkpoint_to_diffusers(checkpoint) | _linear1_at_width(linear1, width)


def test_flux1_run_is_judged_where_diffusers_converter_reads_the_width(tmp_path, monkeypatch):
    """FLUX.1's run (config and inputs) at the tiny width, diffusers' converter taught to split linear1 there (it
    gives the tiny model's own diffusers weights back exactly): the F16 file's behaviour is judged and passes, and
    one negated tensor fails it."""
    path = _bfl_flux(tmp_path)
    model = tiny(CASES["flux"])
    width = model.config["num_attention_heads"] * model.config["attention_head_dim"]
    with safe_open(path, framework="pt") as f:
        bare = {k.removeprefix("model.diffusion_model."): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    back, own = _flux1_convert_at_width(bare, width), model.state_dict()
    assert set(back) == set(own) and all(torch.equal(back[k], own[k]) for k in own)
    monkeypatch.setattr(diffusion_run, "FLUX1_WIDTH", width)
    _teach(monkeypatch, "FluxTransformer2DModel", lambda checkpoint, **_: _flux1_convert_at_width(checkpoint, width))
    _judged_and_a_negated_linear2_fails(path, "FluxTransformer2DModel", tmp_path)


def _teach(monkeypatch, cls: str, convert) -> None:
    """diffusers' single-file loader of `cls` converts checkpoints with `convert`, for this test only."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES[cls], "checkpoint_mapping_fn", convert)


def _judged_and_a_negated_linear2_fails(path: Path, cls: str, tmp_path: Path) -> None:
    """The file's F16 GGUF runs as `cls`, its behaviour judged and passed; a single block's linear2 negated fails
    the behaviour part on its own."""
    src = diffusion.open_source(path)
    ref = diffusion_proof.Reference(src)
    try:
        assert ref.output is not None and ref.config["_class_name"] == cls, ref.why
        out = tmp_path / "x-F16.gguf"
        diffusion.write(src, {"F16": out}, "x")
        behaviour = diffusion_proof.prove(out, src, "F16", ref).parts[-1]
        assert behaviour.name == "behaviour" and behaviour.judged and behaviour.passed, behaviour.detail
        _negated_fails(out, "single_blocks.0.linear2.weight", ref)
    finally:
        ref.close()


HYVID_KEYS = ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "num_layers",
              "num_single_layers", "num_refiner_layers", "mlp_ratio", "patch_size", "patch_size_t", "guidance_embeds",
              "text_embed_dim", "pooled_projection_dim")  # fmt: skip


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    src = diffusion.open_source(path)
    return {n: src.shapes[k] for k, n in src.names.items()}


def test_hunyuan_video_behaviour_is_not_judged_below_its_own_width(single, tmp_path):
    """diffusers' Hunyuan Video converter splits single blocks' linear1 at 3072 whatever the file, so a test-sized
    file gets no run (said so, and the converter fails on it); the config read from its shapes is the model's own,
    and at 3072 the file is judged. Its 5-D patch embedding is stored F32 at its shape (ComfyUI-GGUF's fix step)."""
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers

    path, model = single("hunyuan_video")
    shapes = _shapes(path)
    made = diffusion_run._hyvid_config(shapes)
    assert {k: made[k] for k in HYVID_KEYS} == {k: model.config[k] for k in HYVID_KEYS}
    assert diffusion_run.config("hyvid", shapes, tmp_path / "c") is None
    assert "3072" in diffusion_run.reason("hyvid", shapes)
    wide = shapes | {"img_in.proj.weight": (3072, *shapes["img_in.proj.weight"][1:]),
                     "double_blocks.0.img_attn_q_norm.weight": (128,)}  # fmt: skip
    assert diffusion_run.reason("hyvid", wide) == ""
    embed = {p.name: p for p in diffusion.open_source(path).plan("Q8_0")}["img_in.proj.weight"]
    assert embed.qtype.name == "F32" and embed.stored == embed.shape == shapes["img_in.proj.weight"]
    behaviour = diffusion_export.export(path, ["F16"], tmp_path / "out").proofs[0].parts[-1]
    assert behaviour.passed and not behaviour.judged and "3072" in behaviour.detail
    with safe_open(path, framework="pt") as f:
        checkpoint = {k.removeprefix("model.diffusion_model."): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    with pytest.raises(RuntimeError, match=r"split_sizes=\[3072, 3072, 3072, -"):  # 3 x 3072 rows of 112
        convert_hunyuan_video_transformer_to_diffusers(checkpoint)


def test_framepack_files_in_hunyuan_video_s_layout_are_refused_not_run_as_hunyuan_video(tmp_path):
    """A FramePack file in Tencent's names is `hyvid` to ComfyUI-GGUF; Hunyuan Video's class has none of its history
    embedder, and diffusers' single-file loader reads no FramePack file, so it gets no run (said so)."""
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    path, _ = _hyvid_file(tmp_path, "framepack")
    src = diffusion.open_source(path)
    assert src.arch.name == "hyvid"
    assert "FramePack" in diffusion_run.reason("hyvid", _shapes(path))
    with pytest.raises(ValueError, match="only compatible with"):
        HunyuanVideoFramepackTransformer3DModel.from_single_file(str(path))


def test_hunyuan_video_run_is_judged_where_diffusers_converter_reads_the_width(single, tmp_path, monkeypatch):
    """The run at the tiny width, diffusers' converter taught to split linear1 there as it does at 3072 (checked
    against it at 3072): the F16 file's behaviour is judged and passes, and one negated tensor fails it. (A run at
    3072 itself needs about 4 GB and 40 s here: measured outside the tests, docs/gguf-diffusion.md.)"""
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers

    g = torch.Generator().manual_seed(0)
    real = {"single_blocks.0.linear1.weight": torch.randn(3 * 3072 + 32, 2, generator=g),
            "single_blocks.0.linear1.bias": torch.randn(3 * 3072 + 32, generator=g)}  # fmt: skip
    taught, own = _convert_at_width(dict(real), 3072), convert_hunyuan_video_transformer_to_diffusers(dict(real))
    assert set(taught) == set(own) and all(torch.equal(taught[k], own[k]) for k in own)
    path, model = single("hunyuan_video")
    width = model.config["num_attention_heads"] * model.config["attention_head_dim"]
    monkeypatch.setattr(diffusion_run, "HYVID_WIDTH", width)
    _teach(monkeypatch, "HunyuanVideoTransformer3DModel", lambda checkpoint, **_: _convert_at_width(checkpoint, width))
    _judged_and_a_negated_linear2_fails(path, "HunyuanVideoTransformer3DModel", tmp_path)
