"""Every diffusion family whose denoiser has seeded inputs (converter.engine.denoiser_inputs) gets its behaviour
compared, not only its tensors: a right merge passes with the transformer's output judged, and one module's change
applied twice fails the behaviour proof on its own, which names a module of the transformer.

Each family's tiny diffusers folder and LoRA come from tests/family_cases.py; the reference is diffusers' own LoRA
loader applied unmerged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from family_cases import CASES, make_bases, make_lora, tiny, write_spelling  # noqa: E402

# families judged through the shared seeded inputs (FLUX.1, Wan and the UNets have their own tests)
FAMILIES = ["chronoedit", "flux2", "hidream", "hunyuan_video", "ltx2", "ltx_video", "lumina2", "qwen_image",
            "skyreels_v2", "z_image"]  # fmt: skip


def _merged(name: str, root: Path, cli) -> Path:
    case = CASES[name]
    model = tiny(case)
    folder, _ = make_bases(case, model, root)
    spelling = next(s for s in case.spellings if s.startswith("diffusers"))
    adapter = write_spelling(make_lora(case, model), spelling, root / "lora")
    # float32: one module's change applied twice stays above the output's rounding
    code, out, err = cli("merge", "--base", folder, "--adapter", adapter, "--out", root / "m", "--dtype", "float32",
                         verify=True)  # fmt: skip
    assert code == 0, out + err
    return folder


@pytest.mark.parametrize("name", FAMILIES)
def test_the_behaviour_is_judged_and_a_doubled_change_fails_it(name, tmp_path, cli):
    folder = _merged(name, tmp_path, cli)
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert report["verdict"] == "pass" and report["behaviour_skipped"] is None, report["behaviour_skipped"]
    assert list(report["components"]) == ["transformer"], report["components"]
    file = next((tmp_path / "m" / "transformer").glob("*.safetensors"))
    merged, base = load_file(file), load_file(folder / "transformer" / file.name)
    key = next(k for k in sorted(merged) if k.endswith(".weight") and not torch.equal(merged[k], base[k]))
    merged[key] = 2 * merged[key] - base[key]  # its change applied twice
    save_file(merged, file, metadata={"format": "pt"})
    code, out, err = cli("verify", tmp_path / "m", "--proof", "behaviour")
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert code == 3 and report["first_disagreeing_module"]["module"].startswith("transformer."), out + err
