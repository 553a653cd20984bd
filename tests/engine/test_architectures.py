"""Every supported architecture: the merged folder must behave like PEFT's unmerged model, and its tensors must
equal PEFT's float64 merge rounded once."""

from __future__ import annotations

import pytest
import torch
from model_helpers import (
    assert_proven,
    load_merged,
    logits,
    make_adapter,
    make_base,
    peft_merged_fp64,
    read_tensors,
    reference_model,
    token_ids,
)

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_merge_matches_unmerged_peft(arch, tmp_path, cli):
    base = make_base(tmp_path / "base", arch)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8)
    assert_proven(cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "merged", verify=True))
    ids = token_ids()
    ref = logits(reference_model(base, [adapter]), ids)
    merged = logits(load_merged(tmp_path / "merged"), ids)
    bare = logits(load_merged(base), ids)
    assert (ref - bare).abs().max() > 1e-2, "the adapter must change the model, or this test proves nothing"
    torch.testing.assert_close(merged, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text", "phi3", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_equal_float64_reference_rounded_once(arch, dtype, tmp_path, cli):
    base = make_base(tmp_path / "base", arch, dtype=dtype)
    adapter = make_adapter(base, tmp_path / "lora", r=8, lora_alpha=16)
    assert cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "merged")[0] == 0
    ours = read_tensors(tmp_path / "merged")
    base_tensors = read_tensors(base)
    reference = peft_merged_fp64(base, adapter)
    changed = 0
    for name, tensor in ours.items():
        assert tensor.dtype == dtype
        expected = reference[name].to(dtype)
        if torch.equal(tensor, base_tensors[name]):
            assert torch.equal(expected, tensor), f"{name} should have changed"
            continue
        changed += 1
        if dtype == torch.float32:
            torch.testing.assert_close(tensor, expected, atol=1e-6, rtol=1e-6)
        else:
            # float32 math rounded once to bf16 vs float64 rounded once: equal but for rare ties at one ulp.
            same = (tensor == expected).float().mean().item()
            assert same > 0.99, f"{name}: only {same:.2%} identical to the float64 reference"
            torch.testing.assert_close(tensor.float(), expected.float(), atol=0, rtol=2**-7)
    assert changed > 0
