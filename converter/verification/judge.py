"""The verdict, from what the two proofs measured: pure functions, no I/O (tests/verification/test_verify_judge.py).

A merge passes when every proof that ran passed and the tensor proof ran (or was not the proof for this output:
a 4-bit one is judged by its behaviour; or not asked for); it fails on any problem; it is "skipped" (the card
says "not verified") when no referee could judge its tensors and nothing found a problem. Problems name what is
wrong: the tensor and how far off in units of its rounding bound, or the behavioural metric and its threshold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from converter.verification.report import (
    ComponentComparison,
    DiffusionTolerance,
    Disagreement,
    LLMTolerance,
    LogitComparison,
)
from converter.verification.tensors import TensorProofResult

EFFECT_SHARE = 0.25  # the merged model must sit this much closer to the reference than the bare base does
MAX_LISTED = 5  # missing / extra tensor names listed one by one


@dataclass
class Verdict:
    verdict: str  # "pass", "fail", "skipped"
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def judge(
    tensors: TensorProofResult | None,
    behaviour: tuple[list[str], list[str]] | None,
    skipped: tuple[str | None, str | None] = (None, None),
    tensors_needed: bool = False,
) -> Verdict:
    """Combine the tensor proof's result and the behavioural findings (problems, notes) into one verdict.
    `skipped`: why each proof did not run (tensors, behaviour), said in the notes. `tensors_needed`: without
    the tensor proof the merge is not verified, whatever its behaviour showed ("passed" means every tensor)."""
    problems, notes = [], []
    if tensors is not None:
        p, n = judge_tensors(tensors)
        problems += p
        notes += n
    if behaviour is not None:
        problems += behaviour[0]
        notes += behaviour[1]
    for what, why in zip(("tensor proof", "behavioural comparison"), skipped, strict=True):
        if why:
            notes.append(f"{what} not run: {why}")
    if problems:
        return Verdict("fail", problems, notes)
    proven = tensors is not None or (behaviour is not None and not tensors_needed)
    return Verdict("pass" if proven else "skipped", problems, notes)


def judge_tensors(result: TensorProofResult) -> tuple[list[str], list[str]]:
    problems = [f"{c.name}{_who(c.module, c.kind)}: {c.problem}" for c in result.failures]
    if result.failed > len(result.failures):
        problems.append(f"... and {result.failed - len(result.failures)} more tensors wrong")
    if result.missing:
        problems.append(f"{len(result.missing)} tensor(s) of the base missing from the output: {_few(result.missing)}")
    if result.extra:
        problems.append(f"{len(result.extra)} tensor(s) in the output that the base does not have: "
                        f"{_few(result.extra)}")  # fmt: skip
    notes = []
    weak = result.weakest_effect
    if weak is not None and weak.changed == 0:
        notes.append(f"{weak.name}: the adapters change none of its elements at the output's precision; a merge "
                     "that left it unchanged could not be told apart")  # fmt: skip
    if result.changed == 0 and not problems:
        notes.append("no tensor is changed by the adapters: the output is the base")
    return problems, notes


def judge_llm(
    merged: LogitComparison, bare: LogitComparison | None, tol: LLMTolerance, culprit: Disagreement | None = None
) -> tuple[list[str], list[str]]:
    """The behavioural verdict of a causal LM: KL and confident top-1 agreement within the thresholds, and the
    merged model clearly closer to the reference than the bare base (else nothing was merged; `bare` None: not run,
    the tensor proof answered that)."""
    problems, notes = [], []
    if merged.mean_kl > tol.mean_kl:
        problems.append(f"mean KL(reference‖merged) {merged.mean_kl:.3g} > {tol.mean_kl:.3g}")
    if merged.confident_top1_agreement < tol.confident_top1_agreement:
        problems.append(
            f"top-1 agreement where the reference is confident {merged.confident_top1_agreement:.2%} "
            f"< {tol.confident_top1_agreement:.0%}"
        )
    if bare is None:
        pass
    elif bare.mean_kl <= tol.mean_kl:
        notes.append("the adapters barely change the base's outputs here: a merge that did nothing could not be "
                     "told apart by behaviour")  # fmt: skip
    elif merged.mean_kl >= EFFECT_SHARE * bare.mean_kl:
        problems.append("the merged model is as far from the reference as the bare base is (was anything merged?)")
    if problems and culprit:
        problems.append(_located(culprit))
    return problems, notes


def judge_diffusion(
    components: dict[str, ComponentComparison], tol: DiffusionTolerance, culprits: list[Disagreement] = ()
) -> tuple[list[str], list[str]]:
    """The behavioural verdict of a diffusion merge, per touched component: relative error of its outputs within
    what rounding explains, and clearly below the adapters' own effect."""
    problems, notes = [], []
    for name, c in components.items():
        m, b = c.merged_vs_reference.rel_err, c.base_vs_reference.rel_err
        if m > tol.output_rel_err:
            problems.append(f"{name}: relative error {m:.3g} > {tol.output_rel_err:.3g}")
        if b <= tol.output_rel_err:
            notes.append(f"{name}: the adapters barely change it here; a merge that did nothing could not be "
                         "told apart by behaviour")  # fmt: skip
        elif m >= EFFECT_SHARE * b:
            problems.append(f"{name} is as far from the reference as the bare base is ({m:.3g} vs {b:.3g}): was "
                            "anything merged?")  # fmt: skip
    problems += [_located(c) for c in culprits]
    return problems, notes


def _located(culprit: Disagreement) -> str:
    return f"first module that disagrees: {culprit.module} (relative error {culprit.relative_error:.3g})"


def failing_components(components: dict[str, ComponentComparison], tol: DiffusionTolerance) -> list[str]:
    """The components judge_diffusion finds a problem with (the module probe runs on those only)."""
    return [n for n in components if judge_diffusion({n: components[n]}, tol)[0]]


def _who(module: str | None, kind: str) -> str:
    if kind == "untouched" or not module:
        return ""
    return f" ({kind}, module {module})"


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f" ... (+{len(names) - MAX_LISTED})" if len(names) > MAX_LISTED else "")
