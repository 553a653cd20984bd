"""The verification report, typed all the way down: the tensor proof's result, the behavioural comparison's
measurements, the verdict, and how it is written and read back (verification.json next to the model). It holds
no prose: render.py writes it in Markdown where it is shown (the log, the card, the app)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from converter import outcome
from converter.engine.model_inputs import ModelLogits
from converter.io.records import REPORT_FILE, read_report
from converter.verification.plain import OMIT_NONE, from_plain, to_plain
from converter.verification.tensors import TensorProofResult


class Clock:
    """Seconds per phase, wall and CPU (the whole process's, every thread): the verification benchmark compares
    the phases of one run, and on a shared machine only the CPU seconds compare across runs."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._last, self._last_cpu = time.perf_counter(), time.process_time()

    def lap(self, phase: str) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        self.phases[phase] = round(now - self._last, 2)
        self.cpu[phase] = round(cpu - self._last_cpu, 2)
        self._last, self._last_cpu = now, cpu


class Skip(Exception):
    """The behavioural comparison cannot run here (the LLM or the diffusion check); the reason is reported."""


@dataclass
class LogitComparison:
    """One model's logits against the reference's on the same prompts (metrics.compare)."""

    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    mean_kl: float
    top1_agreement: float
    confident_positions: int
    confident_top1_agreement: float
    greedy_identical: int
    greedy_total: int
    first_divergence: list[int | None]  # per continuation: the first token that differs (None: identical)
    perplexity: float  # NaN: the perplexity text did not run, or the model is no language model
    perplexity_reference: float = math.nan


@dataclass
class LLMTolerance:
    """Pass thresholds of an LLM's behaviour (metrics.tolerance), widened by a 4-bit reference's kernel noise."""

    mean_kl: float
    confident_top1_agreement: float
    module_rel_err: float
    kernel_noise_mean_kl: float | None = field(default=None, metadata=OMIT_NONE)


@dataclass
class LLMInputs:
    count: int
    chat_template: bool
    tokenizer: bool
    max_new_tokens: int


@dataclass
class Generation:
    """One prompt's greedy continuations, side by side."""

    prompt: str
    base: str
    reference: str
    merged: str


@dataclass
class Disagreement:
    """The first module (in execution order) whose output is off by more than rounding explains."""

    module: str
    relative_error: float


@dataclass
class MetricSummary:
    mean_kl: float
    max_abs_logit_diff: float
    top1_agreement: float
    greedy_identical: int
    greedy_total: int


@dataclass
class QLoRAMerge:
    """One merge base of QLoRA adapters (the original weights, or the 4-bit ones dequantized) against both
    references."""

    this_merge: bool
    vs_qlora_reference: MetricSummary
    vs_full_precision_reference: MetricSummary
    perplexity: float


@dataclass
class QLoRAStudy:
    """QLoRA adapters: both merge bases against the 4-bit training setting (fourbit.qlora_study)."""

    reference: str
    modes: dict[str, QLoRAMerge]  # "original", "dequantized"
    closer: str
    kl_ratio: float
    perplexity_qlora_reference: float
    perplexity_full_precision_reference: float
    dequantized_perplexity_change: float


@dataclass
class LLMBehaviour:
    """The merged model against PEFT's unmerged reference and the bare base, on the same prompts."""

    mode: str  # "quick" (logits) or "full" (+ greedy continuations)
    reference: str  # in words: what the merged model was compared with
    compute_dtype: str
    weights_in_memory: str
    offloaded: bool
    execution: str
    offload_memory_bytes: int | None
    output_dtype: str
    tolerance: LLMTolerance
    inputs: LLMInputs
    merged_vs_reference: LogitComparison
    base_vs_reference: LogitComparison | None  # None: the bare base was not run (a passed tensor proof shows it)
    first_disagreeing_module: Disagreement | None = None
    generations: list[Generation] = field(default_factory=list)
    qlora: QLoRAStudy | None = None


@dataclass
class DiffusionTolerance:
    output_rel_err: float
    module_rel_err: float


@dataclass
class DiffusionInputs:
    timesteps: list[int]
    components: list[str]
    image_steps: int


@dataclass
class OutputDifference:
    """One component's outputs against the reference's, over every fixed input."""

    rel_err: float
    max_abs: float
    mean_abs: float


@dataclass
class ComponentComparison:
    merged_vs_reference: OutputDifference
    base_vs_reference: OutputDifference


@dataclass
class DiffusionBehaviour:
    """Each touched component of the merged pipeline against diffusers' unmerged reference, on fixed inputs."""

    reference: str
    compute_dtype: str
    output_dtype: str
    tolerance: DiffusionTolerance
    inputs: DiffusionInputs
    components: dict[str, ComponentComparison]
    first_disagreeing_module: Disagreement | None = None


@dataclass
class ImageRow:
    """One prompt's pictures (paths relative to the merged folder): shown, never judged."""

    prompt: str
    base: str
    reference: str
    merged: str
    psnr: float  # merged vs reference, dB (99: identical)
    max_abs: int


NOT_SAVED = {"behaviour", "merged_logits"}  # the behaviour is saved at the top level; the logits are not saved


@dataclass(eq=False)
class VerificationReport:
    """Both proofs of one merge and the verdict. `tensors_skipped` / `behaviour_skipped` say why a proof did
    not run; `images`: a diffusion merge's base / reference / merged pictures (shown, never judged). Rendered
    only where it is shown (render.py); equal when it says the same (NaN included)."""

    kind: str  # "llm" or "diffusion"
    verdict: str = "skipped"  # "pass", "fail" or "skipped" (neither proof could run)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tensors: TensorProofResult | None = None
    tensors_skipped: str | None = None
    behaviour: LLMBehaviour | DiffusionBehaviour | None = None
    behaviour_skipped: str | None = None
    images: list[ImageRow] = field(default_factory=list)
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    phase_cpu_seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    # the merged model's float32 logits on the inputs, kept in memory for a proof that follows (a GGUF file's
    # behaviour) instead of running the model again; never written to verification.json
    merged_logits: ModelLogits | None = field(default=None, repr=False)

    @property
    def reference(self) -> str:
        """Who refereed, in words (the app and the card's image grid name it)."""
        if self.behaviour is not None:
            return self.behaviour.reference
        return f"the {self.tensors.referee.name} referee" if self.tensors else ""

    def to_dict(self) -> dict:
        """JSON-ready: the behaviour's measurements at the top level (as consumers of verification.json read
        them), the tensor proof under "tensors"."""
        out = {f.name: to_plain(getattr(self, f.name)) for f in fields(self) if f.name not in NOT_SAVED}
        if self.behaviour is not None:
            out.update(to_plain(self.behaviour))
        out["reference"] = self.reference
        return out

    @classmethod
    def from_dict(cls, data: dict) -> VerificationReport:
        """A report from verification.json's contents, this version's or an older one's (unknown keys, such as
        the Markdown older reports stored, are ignored; missing ones take their defaults)."""
        own = {f.name for f in fields(cls)} - NOT_SAVED
        report = from_plain(cls, {k: v for k, v in data.items() if k in own})
        if data.get("merged_vs_reference") is not None:
            report.behaviour = from_plain(LLMBehaviour, data)
        elif data.get("components") is not None:
            report.behaviour = from_plain(DiffusionBehaviour, data)
        return report

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @property
    def outcome_verdict(self) -> outcome.Verdict:
        """The report's verdict as the outcome's (verification.json keeps "pass" / "fail" / "skipped")."""
        return VERDICTS[self.verdict]

    def as_proofs(self) -> outcome.Proofs:
        """Both proofs summarised for a verb's outcome (converter.outcome)."""
        return outcome.Proofs(
            tensors=_tensor_summary(self.tensors, self.tensors_skipped),
            behaviour=_behaviour_summary(self),
            problems=tuple(self.problems),
            notes=tuple(self.notes),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> VerificationReport:
        return cls.from_dict(json.loads(text))

    def save(self, folder: Path) -> None:
        (Path(folder) / REPORT_FILE).write_text(self.to_json())

    @classmethod
    def load(cls, folder: Path) -> VerificationReport | None:
        """The folder's verification.json, or None when it was not verified."""
        data = read_report(folder)
        return None if data is None else cls.from_dict(data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VerificationReport) and self.to_dict() == other.to_dict()


VERDICTS = {"pass": outcome.Verdict.PROVEN, "fail": outcome.Verdict.FAILED, "skipped": outcome.Verdict.NOT_VERIFIED}


def _tensor_summary(result: TensorProofResult | None, skipped: str | None) -> outcome.TensorProof | None:
    if result is None:
        return outcome.TensorProof(ran=False, reason=skipped) if skipped else None
    worst = max((c for c in (result.worst, *result.failures) if c is not None), key=lambda c: c.ratio, default=None)
    return outcome.TensorProof(
        ran=True,
        referee=result.referee.name,
        tensors=result.tensors,
        changed=result.changed,
        failed=result.failed,
        worst_ratio=worst.ratio if worst else 0.0,
        worst_tensor=worst.name if worst else None,
        passed=result.passed,
    )


def _behaviour_summary(report: VerificationReport) -> outcome.BehaviourProof | None:
    b = report.behaviour
    if b is None:
        return outcome.BehaviourProof(ran=False, reason=report.behaviour_skipped) if report.behaviour_skipped else None
    tensors_failed = report.tensors is not None and not report.tensors.passed
    passed = report.verdict != "fail" or tensors_failed  # a fail the tensors explain is not the behaviour's
    if isinstance(b, LLMBehaviour):
        m = b.merged_vs_reference
        metrics = {
            "mean_kl": m.mean_kl,
            "top1_agreement": m.top1_agreement,
            "confident_top1_agreement": m.confident_top1_agreement,
            "max_abs_logit_diff": m.max_abs_logit_diff,
            "limit_mean_kl": b.tolerance.mean_kl,
            "limit_confident_top1_agreement": b.tolerance.confident_top1_agreement,
        }
    else:
        metrics = {f"{name}.rel_err": c.merged_vs_reference.rel_err for name, c in b.components.items()}
        metrics["limit_output_rel_err"] = b.tolerance.output_rel_err
    return outcome.BehaviourProof(ran=True, reference=b.reference, metrics=metrics, passed=passed)
