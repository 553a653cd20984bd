"""The verification report, typed: the tensor proof's result, the behavioural comparison's measurements, the
verdict, and how it is written (verification.json next to the model, which the card reads back)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from converter.io.records import REPORT_FILE
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
    tolerance: dict
    inputs: dict
    merged_vs_reference: dict
    base_vs_reference: dict | None  # None: the bare base was not run (a passed tensor proof shows what changed)
    first_disagreeing_module: dict | None = None
    generations: list = field(default_factory=list)
    qlora: dict | None = None


@dataclass
class DiffusionBehaviour:
    """Each touched component of the merged pipeline against diffusers' unmerged reference, on fixed inputs."""

    reference: str
    compute_dtype: str
    output_dtype: str
    tolerance: dict
    inputs: dict
    components: dict
    first_disagreeing_module: dict | None = None


@dataclass
class VerificationReport:
    """Both proofs of one merge and the verdict. `tensors_skipped` / `behaviour_skipped` say why a proof did
    not run; `images`: a diffusion merge's base / reference / merged pictures (shown, never judged)."""

    kind: str  # "llm" or "diffusion"
    verdict: str = "skipped"  # "pass", "fail" or "skipped" (neither proof could run)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tensors: TensorProofResult | None = None
    tensors_skipped: str | None = None
    behaviour: LLMBehaviour | DiffusionBehaviour | None = None
    behaviour_skipped: str | None = None
    images: list = field(default_factory=list)
    seconds: float = 0.0
    phase_seconds: dict = field(default_factory=dict)
    phase_cpu_seconds: dict = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    markdown: str = ""

    @property
    def reference(self) -> str:
        """Who refereed, in words (the app and the card's image grid name it)."""
        if self.behaviour is not None:
            return self.behaviour.reference
        return f"the {self.tensors.referee.name} referee" if self.tensors else ""

    def to_dict(self) -> dict:
        """JSON-ready: the behaviour's measurements at the top level (as consumers of verification.json read
        them), the tensor proof under "tensors"."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "behaviour"}
        if self.behaviour is not None:
            out.update(dataclasses.asdict(self.behaviour))
        out["reference"] = self.reference
        return out

    def to_json(self) -> str:
        return json.dumps(_plain(self.to_dict()), indent=2) + "\n"

    def save(self, folder: Path) -> None:
        (Path(folder) / REPORT_FILE).write_text(self.to_json())


def _plain(value):
    """Strict JSON: infinite or NaN numbers (a tensor off beyond any bound) as strings, paths as text."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)
