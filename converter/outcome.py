"""What a verb did, as one typed object: its verdict, why, what it wrote and published, and what its proofs found.

Why one object: every front end reads results, and none of them may read words. The command line prints the
outcome (`--json`), the batch runner reads it back from its child processes, and the exit code is derived from it
here (`exit_code`), nowhere else. It sits at the bottom of the layers and imports nothing of converter: the errors
carry their verdict (errors.py), and the typed reports summarise themselves into `Proofs` (the verification report,
a GGUF file's proof, a conversion's proof), so this module knows their summaries, not their classes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, ClassVar

#: The outcome's JSON layout; `from_json` reads this and earlier ones (unknown keys of later ones are ignored).
VERSION = 1


class Verdict(StrEnum):
    """How a verb ended. `not verified` comes with a reason: not asked for (`--no-verify`, a verb with nothing to
    prove) exits 0, a proof that was asked for and could not judge exits 5."""

    PROVEN = "proven"  # every proof that was asked for ran and passed
    FAILED = "failed"  # a proof found the result wrong (nothing published)
    NOT_VERIFIED = "not verified"  # no proof judged the result: `Outcome.reason` says why
    REFUSED = "refused"  # bad input or usage, an unusable output path, a Hub error: the reason names it
    CRASHED = "crashed"  # an unexpected failure, i.e. a bug in converter
    INTERRUPTED = "interrupted"  # stopped by the user (Ctrl-C)


#: The reason of a `not verified` outcome whose proof was switched off (`--no-verify`).
NOT_ASKED = "not asked for"

_EXIT_CODES = {
    Verdict.PROVEN: 0,
    Verdict.FAILED: 3,
    Verdict.NOT_VERIFIED: 5,
    Verdict.REFUSED: 2,
    Verdict.CRASHED: 1,
    Verdict.INTERRUPTED: 130,
}
#: `converter batch` ran, and some of its jobs failed (the report says which and why).
SOME_JOBS_FAILED = 4


def exit_code(verdict: Verdict, *, proof_asked: bool = True, verb: str = "") -> int:
    """The process exit code of a verdict: the one place exit codes are decided."""
    if verdict is Verdict.NOT_VERIFIED and not proof_asked:
        return 0
    if verdict is Verdict.FAILED and verb == "batch":
        return SOME_JOBS_FAILED
    return _EXIT_CODES[verdict]


@dataclass(frozen=True)
class TensorProof:
    """The tensor proof: every output tensor against base + ΔW from an independent referee. `worst_ratio`: the
    largest |merged − expected| / bound over the changed tensors (at most 1 passes), on `worst_tensor`."""

    ran: bool
    reason: str | None = None  # why it did not run
    referee: str | None = None  # "PEFT", "diffusers", "published formula", ...
    tensors: int = 0
    changed: int = 0
    failed: int = 0
    worst_ratio: float = 0.0
    worst_tensor: str | None = None
    passed: bool | None = None


@dataclass(frozen=True)
class BehaviourProof:
    """The behavioural comparison with the unmerged reference: whether it ran (else why not) and its key metrics
    (a language model: mean_kl, top1_agreement, confident_top1_agreement, max_abs_logit_diff, and their limits
    as limit_mean_kl, ...; a diffusion pipeline: each component's rel_err and the limit_output_rel_err)."""

    ran: bool
    reason: str | None = None
    reference: str | None = None
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    passed: bool | None = None


@dataclass
class ProofPart:
    """One part of a runtime's proof of a written file or folder (GGUF, MLX): passed, one line saying what was
    checked or what is wrong. A part that could not judge (`judged` False) passes, says why, and is not named
    among the checks that ran."""

    name: str
    passed: bool
    detail: str
    judged: bool = True

    @property
    def verdict(self) -> str:
        return ("ok" if self.passed else "FAILED") if self.judged else "not judged"


@dataclass
class PartsProof:
    """A written file's or folder's proof as a runtime's parts are made (GGUF files, MLX folders): it passes when
    every part does. `KEY` names it in the proof's JSON ("file", "folder")."""

    KEY: ClassVar[str] = "file"
    name: str
    type: str
    parts: list[ProofPart] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.parts)

    def to_json(self) -> dict:
        return {self.KEY: self.name, "type": self.type, "passed": self.passed,
                "parts": [p.__dict__ for p in self.parts]}  # fmt: skip

    def summary(self) -> FileProof:
        return FileProof.of(self.name, self.type, self.parts)


@dataclass(frozen=True)
class FileProof:
    """One GGUF file's or MLX folder's proof: each part ("metadata", "tensors", "tokenizer", "behaviour"; MLX:
    "config", "tensors", "behaviour") as "ok", "FAILED" or "not judged"."""

    file: str
    type: str
    passed: bool
    parts: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, file: str, type: str, parts: list[ProofPart]) -> FileProof:
        """The summary of a proof's parts (it passes when every part does)."""
        return cls(file, type, all(p.passed for p in parts), {p.name: p.verdict for p in parts})


@dataclass(frozen=True)
class ConversionProof:
    """A converted adapter read back: modules whose ΔW is identical to the source's, within float32 rounding,
    within their reported SVD error, or not comparable one to one (fused / split on the way)."""

    identical: int = 0
    within_rounding: int = 0
    approximated: int = 0
    not_compared: int = 0
    worst_module: str | None = None
    worst_error: float | None = None
    on_base: int = 0  # base tensors compared (0: compared module by module)

    @property
    def compared(self) -> int:
        return self.identical + self.within_rounding + self.approximated


@dataclass(frozen=True)
class Proofs:
    """Every proof a verb ran: a merge's two (tensors, behaviour), GGUF files', MLX folders', a conversion's;
    `problems` and `notes` as the report states them (for people: nothing reads them back)."""

    tensors: TensorProof | None = None
    behaviour: BehaviourProof | None = None
    gguf: tuple[FileProof, ...] = ()
    conversion: ConversionProof | None = None
    mlx: tuple[FileProof, ...] = ()  # MLX folders' proofs (`file` names the folder)
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __add__(self, other: Proofs) -> Proofs:
        """Both together (a merge's proofs and its GGUF files'); `other`'s single proofs win where both have one."""
        return Proofs(
            tensors=other.tensors or self.tensors,
            behaviour=other.behaviour or self.behaviour,
            gguf=self.gguf + other.gguf,
            conversion=other.conversion or self.conversion,
            mlx=self.mlx + other.mlx,
            problems=self.problems + other.problems,
            notes=self.notes + other.notes,
        )


@dataclass(frozen=True)
class Published:
    """One Hub commit (or pull request) a verb made: `changed` False when the repo already held these files (no
    commit); `pr_updated` when our open pull request was updated instead of a new one opened."""

    repo_id: str
    url: str  # the repo's page
    commit: str | None = None
    pr_url: str | None = None
    changed: bool = True
    pr_updated: bool = False


@dataclass(frozen=True)
class ErrorInfo:
    """The error a failed verb raised: its class, message and data fields (file, tensor, path, repo_id, status,
    reason, ...), and `transient` (a Hub failure worth retrying later)."""

    type: str
    message: str
    fields: Mapping[str, str | int | float | bool | None] = field(default_factory=dict)
    transient: bool = False

    @classmethod
    def of(cls, error: BaseException) -> ErrorInfo:
        data = {
            k: v
            for k, v in vars(error).items()
            if not k.startswith("_") and isinstance(v, str | int | float | bool | type(None))
        }
        return cls(type(error).__name__, _one_line(str(error)), data, bool(getattr(error, "transient", False)))


@dataclass(frozen=True)
class Outcome:
    """One verb's result. `reason`: why the verdict is not `proven` (the one-line message of a non-zero exit);
    `proof_asked`: False where no proof was asked for (exit 0 even when not verified); `published`: the verb's Hub
    commits, its own repo first; `details`: what only this verb has (inspect's description, batch's counts)."""

    verb: str
    verdict: Verdict
    reason: str = ""
    proof_asked: bool = True
    out: str | None = None
    files: tuple[str, ...] = ()
    modules: int | None = None  # LoRA modules written (convert, extract, resize, combine)
    published: tuple[Published, ...] = ()
    proofs: Proofs = field(default_factory=Proofs)
    error: ErrorInfo | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    version: int = VERSION

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict, proof_asked=self.proof_asked, verb=self.verb)

    @property
    def publication(self) -> Published | None:
        """The verb's own commit or pull request (None: nothing was published)."""
        return self.published[0] if self.published else None

    @classmethod
    def failure(cls, verb: str, error: BaseException) -> Outcome:
        """The outcome of a verb that raised `error`: the verdict its class carries (errors.py; anything else is a
        bug), its message as the reason, its fields, and the proofs of its `report` where it has one."""
        verdict = getattr(error, "verdict", None)
        if not isinstance(verdict, Verdict):
            verdict = Verdict.INTERRUPTED if isinstance(error, KeyboardInterrupt) else Verdict.CRASHED
        reason = {Verdict.INTERRUPTED: "interrupted", Verdict.CRASHED: f"unexpected failure: {type(error).__name__}"}
        report = getattr(error, "report", None)
        return cls(
            verb,
            verdict,
            reason.get(verdict, _one_line(str(error))),
            proofs=report.as_proofs() if hasattr(report, "as_proofs") else Proofs(),
            error=ErrorInfo.of(error),
        )

    def with_proofs(self, proofs: Proofs) -> Outcome:
        return replace(self, proofs=self.proofs + proofs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, `exit_code` included (derived: `from_dict` does not read it back)."""
        data = _plain(self)
        data["exit_code"] = self.exit_code
        return data

    def to_json(self) -> str:
        """One line of strict JSON (non-finite numbers as null, other values, such as paths, as text)."""
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=str)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Outcome:
        """An outcome from `to_dict`'s JSON, this version's or an earlier one's; unknown keys are ignored."""
        if not isinstance(data, Mapping) or "verb" not in data or "verdict" not in data:
            raise ValueError("not a converter outcome: it needs at least verb and verdict")
        proofs = data.get("proofs") or {}
        error = data.get("error")
        return cls(
            verb=str(data["verb"]),
            verdict=Verdict(data["verdict"]),
            reason=str(data.get("reason") or ""),
            proof_asked=bool(data.get("proof_asked", True)),
            out=data.get("out"),
            files=tuple(data.get("files") or ()),
            modules=data.get("modules"),
            published=tuple(_record(Published, p) for p in data.get("published") or ()),
            proofs=Proofs(
                tensors=_record(TensorProof, proofs["tensors"]) if proofs.get("tensors") else None,
                behaviour=_record(BehaviourProof, proofs["behaviour"]) if proofs.get("behaviour") else None,
                gguf=tuple(_record(FileProof, f) for f in proofs.get("gguf") or ()),
                conversion=_record(ConversionProof, proofs["conversion"]) if proofs.get("conversion") else None,
                mlx=tuple(_record(FileProof, f) for f in proofs.get("mlx") or ()),
                problems=tuple(proofs.get("problems") or ()),
                notes=tuple(proofs.get("notes") or ()),
            ),
            error=_record(ErrorInfo, error) if error else None,
            details=dict(data.get("details") or {}),
            version=int(data.get("version", VERSION)),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Outcome:
        return cls.from_dict(json.loads(text))


def last_outcome(stdout: str) -> Outcome:
    """The outcome a `converter --json ...` process printed: its stdout's last line (ValueError if it is none)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("no outcome: the process printed nothing")
    try:
        return Outcome.from_json(lines[-1])
    except json.JSONDecodeError as e:
        raise ValueError(f"no outcome: the last line is not JSON ({e.msg})") from None


def _record(kind: type, data: Mapping[str, Any]):
    """A flat record (no nested records) from its JSON; keys it does not know are ignored."""
    known = {f.name for f in fields(kind)}
    return kind(**{k: v for k, v in data.items() if k in known})


def _plain(value: object) -> Any:
    if isinstance(value, Verdict):
        return value.value
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _one_line(text: str) -> str:
    return " ".join(text.split())
