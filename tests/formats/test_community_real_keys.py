"""Real community LoRA key sets (tests/data/real_lora_keys.json: names and shapes from files people publish, as
InvokeAI keeps them for its own tests) resolve against our keymaps.

Each key set is written as a file of the same names (1x1 factors: only the names matter to the reader), read by
converter's reader, named (family and spelling) by `inspect`'s identification, and every denoiser module is looked
up on the family's base in both layouts: a diffusers folder (the transformer built from the family's diffusers
config on the meta device, full size, no memory) and the original single file (its keys from the keymap's
aliases). Where the file's shapes are a real file's, each module's factors must fit the tensor it lands on. FLUX.1
files' text-encoder modules (CLIP-L lora_te1_, OneTrainer's T5 lora_te2_) are looked up on those encoders' keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from diffusion_helpers import save
from family_cases import keymap, original_shapes

from converter.engine.family import denoiser_patches, identify, naming_of
from converter.engine.keymap import DiffusionResolver
from converter.errors import AdapterFormatError
from converter.formats import load_adapter

DATA = json.loads((Path(__file__).parents[1] / "data" / "real_lora_keys.json").read_text())
SETS = {name: entry for name, entry in DATA.items() if not name.startswith("_")}

# The released models' transformer configs (diffusers' defaults are the released ones unless given here).
FULL = {
    "flux": ("FluxTransformer2DModel", dict(guidance_embeds=True)),
    "krea2": ("Krea2Transformer2DModel", {}),
    "qwen_image": ("QwenImageTransformer2DModel", {}),
    "wan": ("WanTransformer3DModel", {}),
    # Cosmos-Predict2 2B, Anima's base
    "anima": ("CosmosTransformer3DModel", dict(num_attention_heads=16, attention_head_dim=128, num_layers=28,
                                              text_embed_dim=2048, adaln_lora_dim=256, concat_padding_mask=True,
                                              extra_pos_embed_type=None, rope_scale=(1.0, 4.0, 4.0))),
    # LTX-2.5: gated attention and the prompt-modulated cross attention
    "minimax_h3": ("MiniMaxH3Transformer3DModel", {}),
    "z_image": ("ZImageTransformer2DModel", {}),
    "flux2": ("Flux2Transformer2DModel", {}),
    "ltx2": ("LTX2VideoTransformer3DModel", dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True,
                                                audio_cross_attn_mod=True, use_prompt_embeddings=False, num_layers=2)),
}  # fmt: skip
_BASES: dict[str, tuple[dict, dict]] = {}


def _bases(family: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(diffusers folder shapes, original single-file shapes) of the family's full-size transformer."""
    if family not in _BASES:
        import diffusers

        cls, config = FULL[family]
        with torch.device("meta"):
            model = getattr(diffusers, cls)(**config)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        _BASES[family] = (shapes, original_shapes(shapes, keymap(family)))
    return _BASES[family]


def _shaped(key: str) -> bool:
    """Whether a keymap's shape rule reads this tensor's module (FLUX.1 and FLUX.2 share BFL's names): those keep
    their real shapes, in float16 zeros."""
    from converter.engine.family import _flat
    from converter.engine.keymap import all_keymaps

    stem = re.sub(r"^(diffusion_model\.|transformer\.|base_model\.model\.|lora_unet_|lora_transformer_|lycoris_)", "",
                  _LORA_KEY.sub("", key))  # fmt: skip
    return any(_flat(p).fullmatch(stem) for km in all_keymaps() for p, _ in km.shapes)


def _flux_text_encoders() -> dict[str, tuple[int, ...]]:
    """FLUX.1's text encoders' keys as a pipeline folder holds them: CLIP-L's text model (transformers' default
    config) and T5 v1.1's encoder (gated FFN, 24 blocks; small widths: names only), on the meta device."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.device("meta"):
        clip = CLIPTextModel(CLIPTextConfig())
        t5 = T5EncoderModel(T5Config(num_layers=24, feed_forward_proj="gated-gelu"))
    return {f"{c}/{k}": tuple(v.shape) for c, m in (("text_encoder", clip), ("text_encoder_2", t5))
            for k, v in m.state_dict().items()}  # fmt: skip


def _tiny(keys: dict[str, list[int]], real: bool) -> dict[str, torch.Tensor]:
    """The key set with every tensor of its rank but size 1 (enough for the reader, nothing to store), except,
    in a real file's set, the few a shape rule reads."""
    return {
        k: torch.zeros(shape, dtype=torch.float16) if shape and real and _shaped(k) else
        torch.zeros([1] * len(shape)) if shape else torch.tensor(1.0)
        for k, shape in keys.items()
    }  # fmt: skip


CASES = [(name, None) for name, e in SETS.items() if "keys" in e] + [
    (name, tag) for name, e in SETS.items() for tag in e.get("files", {})
]
_LORA_KEY = re.compile(
    r"\.(lora_(down|up|A|B)\.weight|(down|up)\.weight|alpha|lokr_w[12](_[ab])?|dora_scale|magnitude"
    r"|lora_magnitude_vector\.weight)$"
)


@pytest.mark.parametrize("name, tag", CASES, ids=[f"{n}-{t}" if t else n for n, t in CASES])
def test_real_key_set_resolves_on_both_layouts(name, tag, tmp_path):
    entry = SETS[name]
    keys = entry["files"][tag]["keys"] if tag else entry["keys"]
    spelling = entry["files"][tag]["spelling"] if tag else entry["spelling"]
    family = entry["files"][tag].get("family", entry["family"]) if tag else entry["family"]
    # BFL's control LoRA also sets norm scales and widens img_in: not a LoRA; its LoRA modules are checked here
    lora_keys = {k: v for k, v in keys.items() if _LORA_KEY.search(k)}
    file = save(_tiny(lora_keys, entry["shapes"] == "real"), tmp_path / f"{name}.safetensors")
    adapter = load_adapter(file, require_scale=False)
    km = keymap(family)
    if entry["shapes"] == "real":  # names and shapes: what inspect says
        identity = identify(adapter)
        assert identity.spelling in (spelling, spelling.split("/")[0]), (identity.spelling, spelling)
        assert identity.family is not None and identity.family.name == family or family in identity.candidates, (
            identity.family, identity.candidates)  # fmt: skip
    else:  # a sample's shapes are not a model's: its names fit the family, in the expected naming
        naming = naming_of(km, denoiser_patches(adapter))
        assert naming is not False and naming in (None, *spelling.split("/")[1:]), (name, naming)
    folder, single = _bases(family)
    checked = 0
    for shapes in (folder, single):
        resolver = DiffusionResolver(km, {"transformer": ("", dict(km.defaults))}, shapes)
        for ap in denoiser_patches(adapter):
            places = resolver.resolve_all(ap.module, ap.param, ap.component, ap.flat)
            assert places, f"{name}: {ap.native} lands on no tensor of the {'folder' if shapes is folder else 'file'}"
            if entry["shapes"] != "real" or not ap.native or ap.module in entry.get("unfit", {}):
                continue
            out, rank = keys[f"{ap.native}{_suffix(keys, ap.native, 'up')}"]
            rank_, cols = keys[f"{ap.native}{_suffix(keys, ap.native, 'down')}"]
            assert rank == rank_ and (_rows(places, shapes), shapes[places[0].key][1]) == (out, cols), (
                f"{name}: {ap.native} ({out}x{cols}) on {', '.join(map(str, places))}")  # fmt: skip
            checked += 1
    assert entry["shapes"] != "real" or checked, "no module's shape was checked"
    text = [ap for ap in adapter.patches if (ap.component or "").startswith("text_encoder")]
    if family == "flux" and text:  # FLUX.1's CLIP-L (lora_te1_) and T5 (OneTrainer lora_te2_), on the encoders' keys
        encoders = _flux_text_encoders()
        resolver = DiffusionResolver(km, {c: (f"{c}/", {}) for c in ("text_encoder", "text_encoder_2")}, encoders)
        for ap in text:
            assert resolver.resolve_all(ap.module, ap.param, ap.component, ap.flat), f"{name}: {ap.native}"


def _rows(places: list, shapes: dict) -> int:
    """The output rows of the delta these placements take: the fused span they tile, a row slice, or the tensor."""
    if any(p.src for p in places):
        return max(p.src[1] for p in places)
    place = places[0]
    return place.rows[1] - place.rows[0] if place.rows else shapes[place.key][0]


def _suffix(keys: dict, stem: str, role: str) -> str:
    for s in {"up": (".lora_up.weight", ".lora_B.weight"), "down": (".lora_down.weight", ".lora_A.weight")}[role]:
        if stem + s in keys:
            return s
    raise KeyError(f"{stem}: no {role} factor")


def test_the_control_lora_is_refused_with_its_reason(tmp_path):
    """BFL's control LoRA sets norm scales (not deltas) and widens img_in to twice the channels: a one-line error,
    not a partial merge."""
    keys = SETS["flux_control_lora_format"]["keys"]
    file = save(_tiny(keys, real=False), tmp_path / "control.safetensors")
    with pytest.raises(AdapterFormatError, match=r"norm\.key_norm\.scale is a norm scale: this is a FLUX control LoRA"):
        load_adapter(file)
