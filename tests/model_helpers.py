"""Tiny causal LMs built from configs, PEFT adapters with non-zero weights, PEFT as the oracle, and the CLI
in-process: the plain functions the LLM tests share (the fixtures are in conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from converter.cli import main
from converter.outcome import Outcome

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(arch: str, **overrides):
    import transformers as tf

    if arch == "gpt2":
        small = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2)
        return tf.GPT2Config(**{**small, **overrides})
    cls = {
        "llama": tf.LlamaConfig,
        "mistral": tf.MistralConfig,
        "qwen2": tf.Qwen2Config,
        "qwen3": tf.Qwen3Config,
        "gemma2": tf.Gemma2Config,
        "gemma3_text": tf.Gemma3TextConfig,
        "phi3": tf.Phi3Config,
        "mixtral": tf.MixtralConfig,
        "qwen2_moe": tf.Qwen2MoeConfig,
        "qwen3_moe": tf.Qwen3MoeConfig,
    }[arch]
    extra = {"head_dim": 16} if arch in ("gemma2", "gemma3_text", "qwen3") else {}
    if arch == "phi3":
        extra["pad_token_id"] = 0
    if arch == "mixtral":
        extra.update(num_local_experts=4, num_experts_per_tok=2)
    if arch in ("qwen2_moe", "qwen3_moe"):
        extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen2_moe":
        extra["shared_expert_intermediate_size"] = 64
    if arch == "qwen3_moe":
        extra["head_dim"] = 16
    return cls(**{**SMALL, **extra, **overrides})


def make_base(
    folder: Path, arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).to(dtype)
    with torch.no_grad():  # norms start at 1 / 0: make them non-trivial so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


def make_adapter(base: Path, folder: Path, seed: int = 1, **lora) -> Path:
    """A PEFT adapter whose every trainable tensor is random and non-zero (so no part of the merge is a no-op)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora.setdefault("target_modules", "all-linear")
    lora.setdefault("init_lora_weights", False)
    peft_model = get_peft_model(model, LoraConfig(**lora))
    return save_perturbed(peft_model, folder)


def save_perturbed(peft_model, folder: Path, scale: float = 0.05) -> Path:
    """Every trainable tensor moved by seeded noise of `scale` (so no adapter is a no-op), then saved at `folder`."""
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * scale)
    peft_model.save_pretrained(folder)
    return folder


CLASSIFIERS = {"SEQ_CLS": "AutoModelForSequenceClassification", "TOKEN_CLS": "AutoModelForTokenClassification"}


def make_classifier_adapter(base: Path, folder: Path, task: str, labels: int, seed: int = 1,
                            dtype: torch.dtype = torch.float32, said: bool = True, **lora) -> Path:  # fmt: skip
    """A classifier made from a causal LM's checkpoint as TRL's RewardTrainer makes one (`from_pretrained(base,
    num_labels=labels)`, the pad token id the eos id where the base has none), and PEFT's adapter for it (`task`:
    SEQ_CLS or TOKEN_CLS; the new head saved whole; not `said`: no task_type, the head in modules_to_save), every
    trainable tensor random."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = getattr(transformers, CLASSIFIERS[task]).from_pretrained(base, num_labels=labels, dtype=dtype)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    lora.setdefault("target_modules", "all-linear")
    lora.update({"task_type": task} if said else {"modules_to_save": ["score"]})
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    return save_perturbed(peft_model, folder)


def reference_model(
    base: Path, adapters: list[Path], weights: list[float] | None = None, dtype: torch.dtype = torch.float32
):
    """PEFT's own unmerged model: base + adapters (each scaled by its weight), all active."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    names = [f"a{i}" for i in range(len(adapters))]
    model = PeftModel.from_pretrained(model, adapters[0], adapter_name=names[0])
    for name, path in zip(names[1:], adapters[1:], strict=True):
        model.load_adapter(path, adapter_name=name)
    if len(names) > 1:
        model.base_model.set_adapter(names)
    for name, w in zip(names, weights or [1.0] * len(names), strict=True):
        for module in model.modules():
            if hasattr(module, "set_scale") and name in getattr(module, "scaling", {}):
                module.set_scale(name, w)
    return model.eval()


def load_merged(folder: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def token_ids(vocab: int = 256, batch: int = 2, length: int = 16, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.float()


def peft_merged_fp64(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """PEFT's merge_and_unload done in float64: the exact reference, to be rounded once by the caller."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64), adapter)
    return {k: v.detach().clone() for k, v in model.merge_and_unload().state_dict().items()}


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run_cli(*args: str | Path) -> int:
    return main([str(a) for a in args])


class CliRun(tuple):
    """What the `cli` fixture returns: (exit code, stdout, stderr), which tests unpack, and `.outcome`, the command's
    typed outcome (converter.outcome.Outcome), which tests of behaviour read instead of the printed words."""

    outcome: Outcome

    def __new__(cls, outcome: Outcome, out: str, err: str) -> CliRun:
        run = super().__new__(cls, (outcome.exit_code, out, err))
        run.outcome = outcome
        return run


def assert_proven(run: CliRun, proofs: int = 2) -> None:
    """The command proved its result: verdict proven, and both proofs (the tensors and the behaviour; `proofs=1`:
    at least one) ran and passed."""
    from converter.outcome import Verdict

    outcome, (_, out, err) = run.outcome, run
    assert outcome.verdict is Verdict.PROVEN, (outcome.verdict, outcome.reason, out + err)
    ran = [p for p in (outcome.proofs.tensors, outcome.proofs.behaviour) if p is not None and p.ran]
    assert all(p.passed for p in ran) and len(ran) >= proofs, (outcome.proofs, out + err)


def assert_failed(run: CliRun, tensor: str | None = None) -> None:
    """The command's proof found the result wrong (exit 3), naming `tensor` among its failures when given."""
    from converter.outcome import Verdict

    outcome, (_, out, err) = run.outcome, run
    assert outcome.verdict is Verdict.FAILED and run[0] == 3, (outcome.verdict, out + err)
    if tensor is not None:
        assert any(tensor in p for p in outcome.proofs.problems) or tensor in (outcome.reason or ""), outcome


def shown(report: dict) -> str:
    """A verification.json's contents as the log, the card and the app show them (render.py's Markdown)."""
    from converter.verification import VerificationReport, markdown

    return markdown(VerificationReport.from_dict(report))


def assert_round_trips(folder: Path, live=None):
    """verification.json read back typed is the report that was written, to the byte (`live`: the object verify
    returned, which it must equal); returns the typed report."""
    from converter.verification import VerificationReport

    text = (Path(folder) / "verification.json").read_text()
    report = VerificationReport.from_json(text)
    assert report.to_json() == text and VerificationReport.from_json(report.to_json()) == report
    assert "markdown" not in json.loads(text)  # rendered where shown, never stored
    if live is not None:
        assert VerificationReport.from_json(live.to_json()) == live and report == live
    return report
