"""SD1 and SDXL UNets out to GGUF, their behaviour judged by diffusers.

The tiny UNets are built from diffusers configs wide enough for ComfyUI-GGUF's rules to show (tensors reshaped into
rows of 256, linear weights left as Q8_0) and written in the ldm layout, which diffusers' own converter reads back.
Oracles: diffusers' UNet config (the proof reads its own from the shapes), diffusers' GGUF loader and dequantizer,
and its forward.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
import torch

from converter.gguf import diffusion, diffusion_export, diffusion_proof

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
from diffusion_helpers import SD15, SDXL, _perturb, save  # noqa: E402
from test_community_sd import ldm_names  # noqa: E402

WIDE = dict(block_out_channels=(32, 64), cross_attention_dim=256)  # 64 x 64 reshaped; 256 wide rows stay Q8_0
KINDS = {  # kind -> (diffusers config, the keymap of its ldm names)
    "sd1": (SD15 | WIDE, "sd"),
    "sdxl": (SDXL | WIDE | dict(projection_class_embeddings_input_dim=256 + 6 * 8, addition_time_embed_dim=8), "sdxl"),
}
READ = ("in_channels", "out_channels", "block_out_channels", "layers_per_block", "down_block_types", "up_block_types",
        "cross_attention_dim", "use_linear_projection")  # fmt: skip
RESHAPED = "input_blocks.4.0.in_layers.2.weight"  # (64, 32, 3, 3): rows of 256
LINEAR = "middle_block.1.transformer_blocks.0.attn2.to_k.weight"  # (64, 256): Q8_0 as it is


@pytest.fixture(scope="module", params=sorted(KINDS))
def unet(request, tmp_path_factory):
    """(kind, the ldm single file, the diffusers model), checked by diffusers' ldm converter."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    kind = request.param
    config, keymap = KINDS[kind]
    torch.manual_seed(0)
    model = _perturb(UNet2DConditionModel(**config), 0)
    sd = model.state_dict()
    names = ldm_names(list(sd), keymap)
    ldm = {f"model.diffusion_model.{names[k]}": v for k, v in sd.items()}
    back = convert_ldm_unet_checkpoint(dict(ldm), dict(model.config))
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    return kind, save(ldm, tmp_path_factory.mktemp(kind) / f"{kind}.safetensors"), model


def test_each_type_is_judged_by_diffusers_reading_the_original_shapes(unet, tmp_path):
    """F16, BF16 and Q8_0 files run in diffusers, their reshaped tensors put back as ComfyUI-GGUF does, like the
    source as gguf quantizes it; the config the proof reads from the ldm shapes is the model's own."""
    kind, path, model = unet
    result = diffusion_export.export(path, ["F16", "BF16", "Q8_0"], tmp_path / "out", log=lambda _: None)
    assert result.arch == kind and result.diffusers_class == "UNet2DConditionModel"
    for fp in result.proofs:
        metadata, _, behaviour = fp.parts
        assert "original shapes recorded" in metadata.detail
        assert behaviour.judged and behaviour.passed and " by 0 " in behaviour.detail, behaviour.detail
    reader = gguf.GGUFReader(result.files[2])
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds[LINEAR] == "Q8_0" and reader.get_field(f"comfy.gguf.orig_shape.{LINEAR}") is None
    assert kinds[RESHAPED] == "Q8_0" and reader.get_field(f"comfy.gguf.orig_shape.{RESHAPED}").contents() == [
        64, 32, 3, 3]  # fmt: skip
    ref = diffusion_proof.Reference(diffusion.open_source(path))
    try:
        made = ref.config
        assert {k: tuple(v) if isinstance(v, list) else v for k, v in made.items() if k in READ} == {
            k: model.config[k] for k in READ}  # fmt: skip
        if kind == "sdxl":
            for key in ("transformer_layers_per_block", "projection_class_embeddings_input_dim"):
                assert made[key] == (list(v) if isinstance(v := model.config[key], tuple) else v), key
    finally:
        ref.close()


def _negate(path: Path, name: str) -> None:
    """One tensor negated in place: F16 values, or each Q8_0 block's scale (the sign bit of its float16)."""
    reader = gguf.GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == name)
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        t.data.reshape(-1, 34)[:, 1] ^= 0x80
    else:
        t.data[...] = -t.data
    reader.data.flush()


@pytest.mark.parametrize(("type_name", "name"), [("F16", RESHAPED), ("Q8_0", RESHAPED), ("Q8_0", LINEAR)])
def test_one_negated_tensor_fails_the_behaviour_part(unet, type_name, name, tmp_path):
    """A reshaped tensor (read back through its orig_shape) and a quantized linear weight (diffusers' GGUF layer)."""
    _, path, _ = unet
    good = diffusion_export.export(path, [type_name], tmp_path / "out", log=lambda _: None).files[0]
    bad = tmp_path / good.name
    bad.write_bytes(good.read_bytes())
    _negate(bad, name)
    src = diffusion.open_source(path)
    ref = diffusion_proof.Reference(src)
    try:
        fp = diffusion_proof.prove(bad, src, type_name, ref)
        assert not fp.passed and fp.parts[-1].name == "tensors" and name in fp.parts[-1].detail
        behaviour = diffusion_proof.prove_behaviour(bad, ref, type_name)  # the runtime alone also sees it
        assert behaviour.judged and not behaviour.passed, behaviour.detail
    finally:
        ref.close()


def test_diffusers_own_gguf_loader_does_not_read_the_original_shapes(unet, tmp_path):
    """Why the proof puts reshaped tensors back itself: diffusers' loader takes them as stored, in rows of 256."""
    from diffusers.models.model_loading_utils import load_gguf_checkpoint

    _, path, _ = unet
    file = diffusion_export.export(path, ["F16"], tmp_path / "out", log=lambda _: None).files[0]
    assert tuple(load_gguf_checkpoint(str(file))[RESHAPED].shape) == (64 * 32 * 9 // 256, 256)
