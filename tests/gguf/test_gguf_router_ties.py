"""Near ties of a MoE router in the GGUF behaviour proof: left out only where they could fail a right file.

In F32 / F16 / BF16 a flipped expert choice moves a position's logits past the type's limit, so each text is
compared up to its first near tie. In the quantized types a flip is far inside the limit, and cutting texts short
there hid wrong files that the whole texts catch: every position is compared. Measured per type on tiny Mixtral,
Qwen2-MoE and Qwen3-MoE with a LoRA on their routers (bench/README.md); this is the Qwen2-MoE whose wrong rope base
passed Q8_0 when only the positions before its near ties were compared (0.36 against 0.45; every position: 0.58).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from model_helpers import make_adapter, run_cli
from test_gguf import TINY, needs_llama

from converter.gguf import arch, export, proof, write


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, proof.Reference]:
    """A tiny Qwen2-MoE merged with a LoRA on its attention and its routers (PEFT's target_parameters), and the
    proof's reference for it."""
    root = tmp_path_factory.mktemp("router-ties")
    base = TINY["qwen2_moe"](root / "base")
    lora = make_adapter(base, root / "lora", seed=1, r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.gate.weight"])  # fmt: skip
    assert run_cli("merge", "--base", base, "--adapter", lora, "--out", root / "m", "--no-verify") == 0
    return root / "m", proof.reference(export.open_source(root / "m"), with_logits=True)


def gguf_of(folder: Path, type_name: str, path: Path) -> Path:
    source = export.open_source(folder)
    write.write_gguf(source, arch.family_of(source.config, folder), type_name, path, name="m")
    return path


def test_the_float_types_leave_near_ties_out_and_the_quantized_ones_do_not(moe):
    _, ref = moe
    total = sum(len(i) for i in ref.inputs)
    assert sum(ref.compared("F32")) < total  # this model has near ties
    assert sum(ref.compared("BF16")) <= sum(ref.compared("F32"))
    for type_name in ("Q8_0", "Q6_K", "Q4_K_M", "Q4_0"):
        assert sum(ref.compared(type_name)) == total


@needs_llama
def test_a_right_q8_file_passes_on_every_position_and_a_wrong_rope_base_fails(moe, tmp_path):
    merged, ref = moe
    right = proof.prove_behaviour(gguf_of(merged, "Q8_0", tmp_path / "right.gguf"), ref, "Q8_0")
    assert right.passed and right.judged and "positions compared" not in right.detail, right.detail
    wrong = tmp_path / "wrong"
    shutil.copytree(merged, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] /= 10  # the file's metadata then says another rope base
    (wrong / "config.json").write_text(json.dumps(config))
    part = proof.prove_behaviour(gguf_of(wrong, "Q8_0", tmp_path / "wrong.gguf"), ref, "Q8_0")
    assert not part.passed, part.detail
