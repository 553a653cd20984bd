"""The diffusion GGUF repo's card names the diffusers class that loads its files: the one diffusers ran them as in
the behaviour proof, or the architecture's only one; none where several families share the architecture name and
none ran (Flux.1 and Flux.2 are both `flux` to ComfyUI-GGUF, and a wrong class would load the wrong model), and none
for a UNet, whose files diffusers does not load."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from converter.gguf import diffusion_export, diffusion_publish
from converter.gguf.proof import FileProof, Part

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from family_cases import CASES, make_bases, tiny  # noqa: E402
from test_gguf_diffusion import WAN  # noqa: E402


def _result(tmp_path: Path, arch: str, ran: str | None) -> diffusion_export.DiffusionResult:
    file = tmp_path / "m-Q8_0.gguf"
    file.write_bytes(b"GGUF")
    proof = FileProof(file.name, "Q8_0", [Part("metadata", True, "ok")])
    return diffusion_export.DiffusionResult(tmp_path, arch, [file], [proof], diffusers_class=ran)


def test_the_card_names_the_class_diffusers_ran_and_no_guess_for_a_shared_architecture(tmp_path):
    ran = diffusion_publish.card(_result(tmp_path, "flux", "Flux2Transformer2DModel"), "alice/f", "alice/f-GGUF")
    assert "from diffusers import GGUFQuantizationConfig, Flux2Transformer2DModel" in ran
    shared = diffusion_publish.card(_result(tmp_path, "flux", None), "alice/f", "alice/f-GGUF")
    assert "FluxTransformer2DModel" not in shared and "import" not in shared and "GGUF loader" in shared
    only = diffusion_publish.card(_result(tmp_path, "sd3", None), "alice/s", "alice/s-GGUF")
    assert "SD3Transformer2DModel.from_single_file(" in only


def test_a_unet_s_card_sends_diffusers_users_to_comfyui(tmp_path):
    """diffusers' GGUF loader does not read a UNet's reshaped tensors: the card names no class to load them with,
    even though the proof ran them as UNet2DConditionModel."""
    unet = diffusion_publish.card(_result(tmp_path, "sdxl", "UNet2DConditionModel"), "alice/x", "alice/x-GGUF")
    assert "from_single_file" not in unet and "does not load these files" in unet and "orig_shape" in unet
    assert "- diffusers" not in unet and "UnetLoaderGGUF" in unet


def test_an_export_records_the_class_its_behaviour_proof_ran(tmp_path):
    case = dataclasses.replace(CASES["wan"], config=WAN)
    _, single = make_bases(case, tiny(case).to(torch.bfloat16), tmp_path)
    result = diffusion_export.export(single, ["F16"], tmp_path / "out", log=lambda _: None)
    assert result.diffusers_class == "WanTransformer3DModel"
    proof = json.loads((tmp_path / "out" / diffusion_export.PROOF_FILE).read_text())
    assert proof["diffusers_class"] == "WanTransformer3DModel"
