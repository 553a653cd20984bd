"""Reward models and classifiers made from a causal LM's checkpoint, as TRL's RewardTrainer makes them:
`AutoModelFor{Sequence,Token}Classification.from_pretrained(causal_lm, num_labels=N)`, a LoRA with that task_type,
the new head (`score`) saved whole by PEFT. The base given is the causal LM as published; the merge writes the
class the adapter was trained as (its head from the adapter, the LM head dropped), and both proofs run with PEFT
as referee: every tensor (the head included), then PEFT's own unmerged classifier against the output.

Each case: exit 0; the output loads with its Auto class, no key missing or unexpected, and gives the logits of
PEFT's own merge of the same classifier; verification.json says both proofs ran and passed with PEFT as referee,
the head added and the LM head dropped; one sabotage (the head altered, or one module put back unmerged) exits 3.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from model_helpers import CLASSIFIERS, make_base, make_classifier_adapter

DECODER = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Case:
    arch: str
    task: str
    labels: int
    targets: object
    dtype: torch.dtype = torch.float32
    base: dict = field(default_factory=dict)  # the causal LM's config, over tiny_config's
    saved_config: dict | None = None  # a config.json saved beside the adapter (as some trainers do)
    sabotage: str = "head"  # "head": the head altered; "module": one LoRA-changed tensor put back to the base
    said: bool = True  # the adapter says its task_type (else only its saved head tells)

    @property
    def auto(self) -> str:
        return CLASSIFIERS[self.task]


LABELS = {"0": "negative", "1": "neutral", "2": "positive"}
CASES = {
    # a reward model: one label, all-linear; the base has no pad token id (Llama 3's): the eos id, said
    "reward-llama": Case("llama", "SEQ_CLS", 1, "all-linear", base={"pad_token_id": None}),
    # a 3-label classifier on a bfloat16 Qwen2, its labels in a config.json beside the adapter
    "qwen2-3-labels": Case(
        "qwen2",
        "SEQ_CLS",
        3,
        ["q_proj", "v_proj", "down_proj"],
        torch.bfloat16,
        saved_config={"id2label": LABELS},
        sabotage="module",
    ),
    # a token classifier on a base whose LM head is tied to its embedding (no lm_head in its files)
    "token-llama-tied": Case("llama", "TOKEN_CLS", 3, DECODER, base={"tie_word_embeddings": True}),
    # no task_type, the head in modules_to_save by hand: a sequence classifier's, as its saved head says
    "untyped-llama": Case("llama", "SEQ_CLS", 2, ["q_proj", "v_proj"], said=False, sabotage="module"),
}


def build(root: Path, c: Case) -> tuple[Path, Path]:
    """The causal LM as published, and the adapter PEFT saves for the classifier made from it."""
    base = make_base(root / "base", c.arch, dtype=c.dtype, **c.base)
    adapter = make_classifier_adapter(base, root / "adapter", c.task, c.labels, dtype=c.dtype, said=c.said, r=4,
                                      lora_alpha=8, target_modules=c.targets)  # fmt: skip
    if c.saved_config is not None:
        (adapter / "config.json").write_text(json.dumps({**json.loads((base / "config.json").read_text()),
                                                         **c.saved_config}))  # fmt: skip
    return base, adapter


def peft_merge(c: Case, base: Path, adapter: Path, out_dtype: torch.dtype):
    """PEFT's own merge of the classifier as it was trained (float64, rounded once to the output's dtype), run in
    float32."""
    import transformers
    from peft import PeftModel

    settings = json.loads((base / "config.json").read_text())
    pad = settings.get("pad_token_id")
    model = getattr(transformers, c.auto).from_pretrained(
        base, num_labels=c.labels, dtype=torch.float64, pad_token_id=settings["eos_token_id"] if pad is None else pad
    )
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return merged.to(out_dtype).to(torch.float32).eval()


@pytest.mark.parametrize("name", CASES)
def test_a_classifier_from_a_causal_lm_merges_as_trained_and_is_proven(name, tmp_path, cli):
    import transformers

    c = CASES[name]
    base, adapter = build(tmp_path, c)
    out = tmp_path / "out"
    code, _, err = cli("merge", "--base", base, "--adapter", adapter, "--out", out, verify=True)
    assert code == 0, err

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [f"{c.arch.capitalize()}For{_kind(c)}"]
    assert config["num_labels"] == c.labels and len(config["id2label"]) == c.labels
    if c.saved_config:
        assert config["id2label"] == LABELS and config["label2id"] == {v: int(k) for k, v in LABELS.items()}
    pad = config["eos_token_id"] if "pad_token_id" in c.base else 0  # (the base's, else eos as TRL pads)
    assert config["pad_token_id"] == pad

    model, info = getattr(transformers, c.auto).from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model.eval()(ids).logits, peft_merge(c, base, adapter, c.dtype)(ids).logits
    assert ours.shape[-1] == c.labels
    torch.testing.assert_close(ours, theirs, atol=1e-3 if c.dtype == torch.bfloat16 else 2e-5, rtol=1e-3)

    report = json.loads((out / "verification.json").read_text())
    assert report["verdict"] == "pass", report["problems"]
    tensors = report["tensors"]
    assert tensors["referee"]["name"] == "PEFT" and f"For{_kind(c)}" in tensors["referee"]["detail"]
    assert tensors["added"] == (["score.bias", "score.weight"] if c.task == "TOKEN_CLS" else ["score.weight"])
    assert tensors["dropped"] == ([] if c.base.get("tie_word_embeddings") else ["lm_head.weight"])
    assert not tensors["missing"] and not tensors["extra"] and not tensors["failures"]
    assert report["behaviour_skipped"] is None and f"For{_kind(c)}" in report["reference"]  # (its fields at the top)
    assert report["merged_vs_reference"]["mean_kl"] <= report["tolerance"]["mean_kl"]

    victim = sabotage(out, base, c)
    code, stdout, _ = cli("--json", "verify", out)
    assert code == 3
    failed = json.loads((out / "verification.json").read_text())
    assert failed["verdict"] == "fail" and [f["name"] for f in failed["tensors"]["failures"]] == [victim]
    assert json.loads(stdout.strip().splitlines()[-1])["verdict"] == "failed"  # (the --json outcome)
    if c.sabotage == "head":  # the behaviour alone sees it too: PEFT's classifier scores otherwise
        code, _, _ = cli("verify", out, "--proof", "behaviour")
        failed = json.loads((out / "verification.json").read_text())
        assert code == 3 and failed["verdict"] == "fail" and failed["tensors"] is None
        assert failed["merged_vs_reference"]["mean_kl"] > failed["tolerance"]["mean_kl"]


def _kind(c: Case) -> str:
    return {"SEQ_CLS": "SequenceClassification", "TOKEN_CLS": "TokenClassification"}[c.task]


def sabotage(out: Path, base: Path, c: Case) -> str:
    """The head altered (its first element moved by a tenth), or one LoRA-changed tensor put back to the base's
    value (a module left unmerged); returns the tensor's name."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    if c.sabotage == "head":
        victim = "score.weight"
        tensors[victim][0, 0] += 0.1
    else:
        victim = f"model.layers.1.{'mlp.down_proj' if 'down_proj' in c.targets else 'self_attn.v_proj'}.weight"
        tensors[victim] = load_file(base / "model.safetensors")[victim]
    save_file(tensors, path, metadata={"format": "pt"})
    return victim


def test_the_plan_says_what_is_written(tmp_path, cli):
    """--dry-run: the class written, its head from the adapter, the LM head left out, config.json's changes; the
    plan as data (--json) too."""
    c = CASES["reward-llama"]
    base, adapter = build(tmp_path, c)
    code, stdout, stderr = cli("--json", "merge", "--base", base, "--adapter", adapter, "--dry-run")
    assert code == 0, stderr
    assert "writing LlamaForSequenceClassification" in stderr and "lm_head.weight" in stderr
    assert "pad_token_id 2: the eos token id" in stderr
    assert not (tmp_path / "out").exists()
