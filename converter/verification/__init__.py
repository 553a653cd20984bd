"""Prove a merge, two ways, and say both plainly.

1. Tensors (`tensors.py`, `prove.py`): every tensor of the output, read from its files, against the base and an
   independent referee of ΔW (PEFT for PEFT adapters, diffusers' loader for community files it reads, else the
   published formula, labelled as such): untouched tensors byte for byte, changed ones within one rounding of
   base + ΔW. Streamed, memory independent of the model's size. A failure names the tensor, the module and how
   far off it is in units of its rounding bound.
2. Behaviour (`llm.py`, `diffusion.py`): the merged model against the base with the adapters applied unmerged, on
   prompts (logits, KL, perplexity, continuations) or fixed latents (component outputs, images). It proves what
   tensors cannot: config, tokenizer, tied heads, a model class that loads differently.

The behaviour is compared only when the tensors pass (a wrong tensor is already a fail, named). `judge.py` turns
what both measured into the verdict, `report.py` holds it, typed (verification.json), and `render.py` writes it in
Markdown where it is shown.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from converter.engine.model_class import NoModelClass
from converter.engine.model_inputs import PROMPTS
from converter.engine.recipe import Recipe
from converter.errors import ConverterError, NotVerified, VerificationFailed
from converter.hub.sources import fetch
from converter.io.optional import require
from converter.io.records import REPORT_FILE
from converter.io.scratch import temp_folder
from converter.verification.heap import reused_heap
from converter.verification.judge import judge
from converter.verification.llm import LLMCheck, Settings
from converter.verification.loading import Offload, PeftRefused
from converter.verification.metrics import NOISE_MARGIN, UNIT_ROUNDOFF, Run, tolerance
from converter.verification.prove import is_peft_folder, prove_tensors
from converter.verification.referee import could_not
from converter.verification.render import card_section, markdown
from converter.verification.report import Clock, Skip, VerificationReport
from converter.verification.task_check import TaskCheck, is_causal_lm, trained_class
from converter.verification.warmup import import_peft, wait

MODES = ("quick", "full")
PROOFS = ("tensors", "behaviour")

__all__ = [
    "MODES",
    "NOISE_MARGIN",
    "PROOFS",
    "PROMPTS",
    "REPORT_FILE",
    "UNIT_ROUNDOFF",
    "Offload",
    "Run",
    "VerificationReport",
    "card_section",
    "markdown",
    "require_pass",
    "tolerance",
    "verify",
]


def verify(
    merged: Path,
    recipe: Recipe,
    *,
    prompts: list[str] | None = None,
    max_new_tokens: int = 16,
    memory: int | None = None,
    token: str | None = None,
    log: Callable[[str], None] = print,
    mode: str = "quick",
    single_file_config: str | None = None,
    proofs: tuple[str, ...] = PROOFS,
    shard_proof=None,
    streamed=None,
    base: Path | None = None,
    notes: tuple[str, ...] = (),
) -> VerificationReport:
    """Prove `merged` against base + adapters (the recipe); returns the report, also written next to the model.

    `memory` caps the bytes the behavioural comparison's models may take (default: what the machine has
    available; beyond it accelerate offloads to disk). `mode`: "quick" compares logits; "full" also greedy
    continuations for the card. `single_file_config`: diffusers' config for a single-file diffusion base.
    `proofs`: both by default; one of them alone to look at it by itself (the other is reported as not run).
    `shard_proof`: a `shards.ShardProof` that already proved the output's shards as they were written (a
    pipelined push): its verdict is the tensor proof, the files are not read again. `streamed`: a
    `streamed.StreamedLLMCheck` that compared the behaviour while the push streamed (the output's weights are
    then no longer on disk). `base`: the base as the caller already has it (a push's streamed download), else it
    is fetched. `notes`: what the caller knows about this verification, noted after the verdict's
    own notes."""
    if mode not in MODES:
        raise ValueError(f"verification mode {mode!r}: use one of {', '.join(MODES)}")

    wait()  # a warm-up import started beside the merge (cli) must finish before this thread imports anything
    import_peft()
    started = time.time()
    job = Job(Path(merged), recipe, *sources(recipe, token, base), log, Clock())
    if job.diffusion:  # never a weaker referee because diffusers is missing: one line naming the extra
        require("diffusers", "verifying a diffusion merge")
    report = VerificationReport("diffusion" if job.diffusion else "llm")
    log(f"verifying {job.merged.name}: {' and '.join(proofs)}")

    with reused_heap():
        referee = _tensor_proof(job, report, shard_proof, streamed) if "tensors" in proofs else None
        if "tensors" not in proofs:
            report.tensors_skipped = "not asked for"
        settings = Settings(prompts, mode, max_new_tokens, memory, token, bare_base=not _proven(report))
        if streamed is not None:
            findings = _streamed_behaviour(job, report, streamed)
        elif "behaviour" in proofs:
            findings = _behaviour(job, report, referee, settings, single_file_config)
        else:
            findings = None
    if "behaviour" not in proofs:
        report.behaviour_skipped = "not asked for"
    needed = "tensors" in proofs and not job.tensors_by_design
    verdict = judge(report.tensors, findings, (report.tensors_skipped, report.behaviour_skipped), needed)
    report.verdict, report.problems, report.notes = verdict.verdict, verdict.problems, [*verdict.notes, *notes]
    report.seconds, report.phase_seconds = round(time.time() - started, 1), job.clock.phases
    report.phase_cpu_seconds = job.clock.cpu
    report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report.save(job.merged)
    return report


@dataclass
class Job:
    """What one verification works on."""

    merged: Path
    recipe: Recipe
    base: Path
    adapters: list[Path]
    log: Callable[[str], None]
    clock: Clock
    tensors_by_design: bool = False  # the tensor proof is not this output's proof (4-bit: its behaviour is)

    @property
    def diffusion(self) -> bool:
        return (self.merged / "model_index.json").is_file() or not (self.merged / "config.json").is_file()


def sources(recipe: Recipe, token: str | None, base: Path | None = None) -> tuple[Path, list[Path]]:
    """The base (fetched unless given) and the adapters of `recipe`, as local paths."""
    base = base or fetch(recipe.base, "model", token).local
    return Path(base), [Path(fetch(s.source, "adapter", token).local) for s in recipe.adapters]


def _tensor_proof(job: Job, report: VerificationReport, shard_proof=None, streamed=None):
    """The tensor proof into the report; returns its referee (the diffusion images may use it)."""
    finished = shard_proof.finish() if shard_proof is not None else None
    if finished is not None:
        report.tensors, referee = finished
        job.log(f"tensor proof: {report.tensors.tensors} tensors, proven shard by shard as they were written")
        job.clock.lap("tensor proof")
        return referee
    if streamed is not None:  # the shards are gone: what stopped the proof on the way is the reason
        report.tensors_skipped = getattr(shard_proof, "declined", None) or "not run while the output streamed"
        job.log(f"tensor proof not run: {report.tensors_skipped}")
        return None
    report.tensors, declined, referee = prove_tensors(job.merged, job.recipe, job.base, job.adapters, job.log)
    if declined is not None:
        report.tensors_skipped, job.tensors_by_design = str(declined), declined.by_design
        job.log(f"tensor proof not run: {declined}")
    job.clock.lap("tensor proof")
    return referee


def _proven(report: VerificationReport) -> bool:
    """Whether the tensor proof passed with an independent referee and saw the adapters change something: then
    it has answered "was anything merged?", element by element, and the bare base need not run."""
    t = report.tensors
    return t is not None and t.passed and t.referee.independent and t.changed > 0


def _behaviour(job: Job, report: VerificationReport, referee, settings, single_file_config):
    """The behavioural comparison into the report, when it can and should run; returns its findings."""
    if report.tensors is not None and not report.tensors.passed:
        report.behaviour_skipped = "the tensor proof already failed"
    elif not job.adapters:
        report.behaviour_skipped = "no adapters: there is no other model to compare with"
    else:
        try:
            if job.diffusion:
                return _diffusion_behaviour(report, job, single_file_config, referee)
            return _llm_behaviour(report, job, settings)
        except ConverterError:
            raise
        except Exception as e:  # noqa: BLE001 - the libraries could not build or run the reference: said, not a bug
            report.behaviour_skipped = could_not("the reference could not be run for this model", e)
            job.log(f"behavioural comparison not run: {report.behaviour_skipped}")
    return None


def _streamed_behaviour(job: Job, report: VerificationReport, streamed):
    """The comparison that ran while the push streamed, into the report (its forwards are over by now)."""
    if report.tensors is not None and not report.tensors.passed:
        streamed.abort()
        report.behaviour_skipped = "the tensor proof already failed"
        return None
    try:
        report.behaviour, findings = streamed.finish()
        report.merged_logits = streamed.merged_logits
    except Skip as e:
        report.behaviour_skipped = str(e)
        job.log(f"behavioural comparison not run: {e}")
        return None
    job.clock.lap("behaviour, compared as both models streamed")
    return findings


def _llm_behaviour(report: VerificationReport, job: Job, settings):
    """The model's behaviour against PEFT's unmerged reference (a causal LM: llm.py; another model PEFT adapts:
    task_check.py); None (with the reason) when it cannot run."""
    if job.recipe.method not in (None, "sum"):
        report.behaviour_skipped = (f"a --method {job.recipe.method} merge has no unmerged PEFT forward to compare "
                                    "with (its tensors are the proof)")  # fmt: skip
        return None
    if not_peft := [a.name for a in job.adapters if not is_peft_folder(a)]:
        report.behaviour_skipped = (f"PEFT builds its unmerged reference from PEFT adapter folders with their "
                                    f"adapter_config.json; {', '.join(not_peft)} is not one")  # fmt: skip
        return None
    folders = [a if a.is_dir() else a.parent for a in job.adapters]
    check = _check_for(job.base, folders)
    if isinstance(check, str):
        report.behaviour_skipped = check
        return None
    if check is LLMCheck:
        ran, findings = _hollow_behaviour(report, job, folders, settings)
        if ran:
            return findings
    with temp_folder("verify", log=job.log) as scratch:
        try:
            report.behaviour, findings = check(job.merged, job.recipe, job.base, folders, settings, Path(scratch),
                                               job.log, job.clock).run()  # fmt: skip
        except (Skip, PeftRefused) as e:
            report.behaviour_skipped = str(e)
            return None
    return findings


def _hollow_behaviour(report: VerificationReport, job: Job, adapters: list[Path], settings):
    """The quick comparison with both models hollow (streamed.py, as a push runs it), where it can run: (whether it
    ran, its findings). Where it cannot or its forwards fail, the models are loaded instead (LLMCheck), which says
    why in its own words; and so they are when it finds a problem: their module probe names the first module
    that disagrees."""
    from converter.verification.streamed import Unstreamable, compare_finished

    try:
        behaviour, findings, merged_logits = compare_finished(job.merged, job.recipe, job.base, adapters, settings,
                                                              job.log, job.clock)  # fmt: skip
    except (Unstreamable, Skip, PeftRefused):
        return False, None
    if findings[0]:
        return False, None
    report.behaviour, report.merged_logits = behaviour, merged_logits
    return True, findings


def _check_for(base: Path, adapters: list[Path]):
    """LLMCheck for a causal LM, TaskCheck (its class set) for the other models PEFT adapts; a string: why none."""
    from functools import partial

    try:
        name = trained_class(base, adapters)
    except NoModelClass as e:
        return f"the behaviour needs the base's transformers model: {e}"
    if is_causal_lm(name):
        return LLMCheck
    return partial(TaskCheck, model_class=name)


def _diffusion_behaviour(report: VerificationReport, job: Job, single_file_config, referee):
    """A diffusion merge's behaviour against diffusers' unmerged loader; images either way."""
    from converter.verification.diffusion import DiffusionCheck

    check = DiffusionCheck(job.merged, job.recipe, job.base, job.adapters, single_file_config, job.log, job.clock)
    findings = None
    try:
        report.behaviour, findings = check.run()
    except Skip as e:
        report.behaviour_skipped = str(e)
    report.images = check.images(referee if report.tensors is not None and report.tensors.passed else None)
    return findings


def require_pass(report: VerificationReport, then: str = "") -> None:
    """VerificationFailed on a fail; NotVerified when nothing could judge the merge (`then`: what became of the
    output, said after the reason)."""
    if report.verdict == "fail":
        raise VerificationFailed("verification failed: " + "; ".join(report.problems), report=report)
    if report.verdict == "skipped":
        why = report.tensors_skipped or "; ".join(report.notes) or "no proof could run"
        raise NotVerified(f"not verified: {why}{then}", report=report)
