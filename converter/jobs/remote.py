"""`converter push` as a Hugging Face Job, for merges that outgrow the machine they are asked from.

The job is the same command, run next to the Hub: `converter --json push ...` with every source pinned to its
commit, the base mounted read-only as a model volume at that commit (`--base-mounted`: read in place, recorded as
`org/name@sha`), the token as the job's secret HF_TOKEN (never in its command, env, labels or log), the flavor that
fits the estimate (converter.jobs.fit) and a timeout from it. Its labels say which job it is (base and adapter
commits, target repo, a hash of its arguments), so asking again follows the job already running instead of
starting another. Its log streams here as it is printed; its last line is its outcome (converter.outcome), which
becomes this command's outcome and exit code. Nothing here reads the job's other lines.
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from converter.engine.recipe import Recipe
from converter.errors import DoesNotFit, JobInterrupted, RemoteJobError, UsageError
from converter.hub import client as hub
from converter.hub import hf_jobs
from converter.hub.publish import check_repo_id, check_writable
from converter.hub.sources import parse_source, resolve
from converter.io.scratch import temp_folder
from converter.jobs.fit import Estimate, best_flavor, duration, money, on_jobs
from converter.jobs.options import PushOptions
from converter.jobs.shape import shape_of
from converter.outcome import Outcome

#: Where the base is mounted in the job.
MOUNT = "/base"
#: The job's secret that carries the token; converter and huggingface_hub read it in the job.
SECRET = "HF_TOKEN"
#: An image with uv (and so uvx) and a Python converter supports.
DEFAULT_IMAGE = "ghcr.io/astral-sh/uv:python3.12-bookworm"


@dataclass(frozen=True)
class Runner:
    """How converter gets into the job: `image`, and what `uvx --from` installs there (None: the image has the
    `converter` command already)."""

    image: str
    install: str | None

    @classmethod
    def default(cls, image: str | None = None, install: str | None = None) -> Runner:
        """--jobs-image / CONVERTER_JOBS_IMAGE (default: uv's Python image) and --jobs-from / CONVERTER_JOBS_FROM
        (default: this converter's version from PyPI, `converter==X.Y.Z`; "-": the image has converter)."""
        from converter import __version__

        image = image or os.environ.get("CONVERTER_JOBS_IMAGE") or DEFAULT_IMAGE
        install = install if install is not None else os.environ.get("CONVERTER_JOBS_FROM")
        install = f"converter=={__version__}" if install is None else install
        return cls(image, None if install in ("", "-") else install)

    def command(self, arguments: list[str]) -> list[str]:
        head = ["uvx", "--from", self.install, "converter"] if self.install else ["converter"]
        return head + arguments


@dataclass(frozen=True)
class Planned:
    """A job ready to submit: its spec (secrets by name only), the estimate on its flavor and on every flavor."""

    spec: hf_jobs.JobSpec
    estimate: Estimate
    estimates: tuple[Estimate, ...]
    hardware: str  # where the flavor list came from

    def to_dict(self) -> dict:
        return {
            "spec": self.spec.to_dict(),
            "estimate": self.estimate.to_dict(),
            "flavors": [e.to_dict() for e in self.estimates],
            "hardware": self.hardware,
        }

    def summary(self) -> str:
        e = self.estimate
        return (
            f"on Hugging Face Jobs: {e.machine.name} ({e.machine.cores} vCPU, {'streamed' if e.streamed else 'whole'}),"
            f" about {duration(e.seconds)}, {money(e.usd)}; stopped after {duration(self.spec.timeout)}"
        )


def plan(
    repo_id: str,
    recipe: Recipe,
    options: PushOptions,
    token: str,
    *,
    flavor: str | None = None,
    namespace: str | None = None,
    runner: Runner | None = None,
    link: float | None = None,
    workdir: str | Path | None = None,
) -> Planned:
    """The job for `recipe` pushed to `repo_id`, before anything is submitted: the token's right to run Jobs in
    `namespace` (default its user) and to write the repo, every source pinned, the shape from headers, the flavor
    (`flavor`, or the cheapest that fits) and its timeout."""
    check_repo_id(repo_id)
    _option_flags(options)  # what a Job cannot take is refused before the Hub is asked
    who = hub.whoami_info(token)
    namespace = namespace or os.environ.get("CONVERTER_JOBS_NAMESPACE") or who["name"]
    hf_jobs.check_can_pay(who, namespace)
    check_writable(who, repo_id, options.create_pr)
    recipe = pinned(recipe, token)
    arguments = push_arguments(repo_id, recipe, options)
    with temp_folder("jobplan", workdir, log=lambda _line: None) as tmp:
        shape = shape_of(recipe, options.verify, token, tmp)
    hardware = hf_jobs.hardware(token)
    estimates = on_jobs(shape, hardware, link)
    chosen = _flavor(estimates, flavor, hardware, recipe.base)
    base = parse_source(recipe.base)
    runner = runner or Runner.default()
    spec = hf_jobs.JobSpec(
        image=runner.image,
        command=tuple(runner.command(arguments)),
        flavor=chosen.machine.name,
        timeout=chosen.timeout,
        namespace=namespace,
        labels=labels(recipe, repo_id, arguments),
        env={"PYTHONUNBUFFERED": "1"},
        secrets=(SECRET,),
        volumes=({"type": "model", "source": base.repo_id, "mount_path": MOUNT, "revision": base.revision},),
        name=f"converter-push-{_label(repo_id)}"[:100],
    )
    return Planned(spec, chosen, tuple(estimates), hardware.source)


def _flavor(estimates: list[Estimate], name: str | None, hardware: hf_jobs.Hardware, base: str) -> Estimate:
    """The flavor asked for when it fits, else the cheapest that fits; DoesNotFit naming the one that would."""
    cheapest = best_flavor(estimates)
    if name is not None and hardware.get(name) is None:
        known = ", ".join(f.name for f in hardware.cpu)
        raise UsageError(f"--on-jobs {name}: not a Hugging Face Jobs CPU flavor ({known})")
    chosen = best_flavor(estimates, name) if name is not None else cheapest
    if chosen is not None and chosen.fits:
        return chosen
    if chosen is not None and cheapest is not None:
        raise DoesNotFit(
            f"{base}: does not fit {name}: {chosen.short}; {cheapest.machine.name} fits (about "
            f"{duration(cheapest.seconds)}, {money(cheapest.usd)}): --on-jobs {cheapest.machine.name}",
            disk=chosen.disk, free=chosen.machine.disk, memory=chosen.memory, available=chosen.machine.memory,
            flavor=cheapest.machine.name, seconds=cheapest.seconds, usd=cheapest.usd,
        )  # fmt: skip
    worst = (chosen or estimates[-1]) if estimates else None
    raise DoesNotFit(
        f"{base}: no Hugging Face Jobs CPU flavor fits it"
        + (f" ({worst.machine.name}: {worst.short})" if worst is not None else ""),
        disk=worst.disk if worst else 0,
        memory=worst.memory if worst else 0,
    )


def pinned(recipe: Recipe, token: str | None) -> Recipe:
    """The recipe with every source at the commit it is at now (`org/name@sha[/file]`); a local path is refused:
    the job runs on the Hub's machines and reads Hub repos only."""
    out = copy.deepcopy(recipe)
    out.base = _pin(recipe.base, "model", token)
    for spec in out.adapters:
        spec.source = _pin(spec.source, "adapter", token)
    return out


def _pin(spec: str, kind: str, token: str | None) -> str:
    source = parse_source(spec)
    if source.repo_id is None:
        raise UsageError(
            f"{spec}: a local path; a Hugging Face Job reads Hub repos only (push it to the Hub first, or merge here)"
        )
    sha = resolve(source, kind, token).sha
    return f"{source.repo_id}@{sha}" + (f"/{source.path}" if source.path else "")


def push_arguments(repo_id: str, recipe: Recipe, options: PushOptions) -> list[str]:
    """`converter --json push ...` for the job: the recipe and options as the command line says them, the base
    read from the mount. What has no command-line form is refused in one line."""
    if any(s.include or s.exclude for s in recipe.adapters):
        raise UsageError("--on-jobs: an adapter's include / exclude has no command-line form yet; merge it here")
    if recipe.base_config or recipe.base_lora_alpha is not None:
        raise UsageError("--on-jobs: a training checkpoint is a local base; merge it here")
    args = ["--json", "push", "--repo", repo_id, "--base", recipe.base, "--base-mounted", MOUNT]
    for spec in recipe.adapters:
        args += ["--adapter", spec.source]
    if any(s.weight != 1.0 for s in recipe.adapters):
        for spec in recipe.adapters:
            args += ["--weight", _weight(spec.weight)]
    alphas = [s.lora_alpha for s in recipe.adapters]
    if any(a is not None for a in alphas):
        if None in alphas:
            raise UsageError("--on-jobs: give --lora-alpha for every adapter or none")
        for alpha in alphas:
            args += ["--lora-alpha", repr(alpha)]
    args += _recipe_flags(recipe) + _option_flags(options)
    return args


def _weight(weight: float | dict[str, float]) -> str:
    return ",".join(f"{k}={v!r}" for k, v in weight.items()) if isinstance(weight, dict) else repr(weight)


def _recipe_flags(recipe: Recipe) -> list[str]:
    args: list[str] = []
    for key in ("dtype", "max_shard_size", "method", "density", "seed", "qlora_quant", "qlora_blocksize"):
        value = getattr(recipe, key)
        if value is not None and (key, value) not in (("qlora_quant", "nf4"), ("qlora_blocksize", 64)):
            args += [f"--{key.replace('_', '-')}", str(value)]
    if recipe.qlora_base != "original":
        args += ["--qlora-base", recipe.qlora_base]
    flags = {"qlora": recipe.qlora, "no_double_quant": not recipe.qlora_double_quant,
             "allow_unmatched": recipe.allow_unmatched, "allow_pickle": recipe.allow_pickle}  # fmt: skip
    return args + [f"--{k.replace('_', '-')}" for k, on in flags.items() if on]


def _option_flags(options: PushOptions) -> list[str]:
    args = [f"--{k.replace('_', '-')}" for k in ("private", "create_pr", "overwrite") if getattr(options, k)]
    verify = options.verify
    if verify is None:
        args.append("--no-verify")
    else:
        if verify.get("prompts"):
            raise UsageError("--on-jobs: --prompts is a file here, which the job cannot read; it uses the built-in set")
        if verify.get("mode", "quick") != "quick":
            args += ["--verify", verify["mode"]]
        if verify.get("max_new_tokens", 16) != 16:
            args += ["--max-new-tokens", str(verify["max_new_tokens"])]
        if verify.get("memory"):
            args += ["--verify-memory", str(verify["memory"])]
        if config := verify.get("single_file_config"):
            if parse_source(config).repo_id is None:
                raise UsageError(f"--on-jobs: --single-file-config {config} is a local path; give a Hub id")
            args += ["--single-file-config", config]
    if options.mlx:
        raise UsageError("--on-jobs: MLX folders are made and proven with mlx on this machine; push on Jobs without "
                         "--mlx, or merge here")  # fmt: skip
    return args + (["--gguf", options.gguf] if options.gguf else [])


def labels(recipe: Recipe, repo_id: str, arguments: list[str]) -> dict[str, str]:
    """What identifies the job: the base and adapter commits, the target repo, a hash of its arguments (which hold
    all of these and every option). The flavor is not part of it: the same merge on another flavor is the same
    job."""
    out = {"converter": "push", "base": parse_source(recipe.base).revision or "", "target": _label(repo_id)}
    for i, spec in enumerate(recipe.adapters, 1):
        out[f"adapter-{i}"] = parse_source(spec.source).revision or ""
    out["options"] = hashlib.sha256("\0".join(arguments).encode()).hexdigest()[:16]
    return out


def _label(text: str) -> str:
    """A label value (letters, digits, `.`, `-`, `_`): `org/name` as `org--name`."""
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in text.replace("/", "--"))[:100]


def ask_stdin(question: str, log: Callable[[str], None]) -> str:
    """The question as a log line (stderr with --json), the answer a line of stdin ("" at its end)."""
    log(question)
    return sys.stdin.readline()


def run(
    planned: Planned,
    token: str,
    *,
    log: Callable[[str], None] = print,
    ask: Callable[[str], str] | None = None,
) -> Outcome:
    """Submit the job (or follow the same one, still running), stream its log to `log` as it comes, and return the
    outcome its command printed, with `details["job"]`. Ctrl-C asks `ask` whether to cancel it (JobInterrupted
    either way); a job that ends without an outcome is RemoteJobError."""
    spec = planned.spec
    live = hf_jobs.find_live(spec.labels, spec.namespace, token)
    if live is not None:
        job = live
        log(f"the same job is already {live.stage.lower()} on Hugging Face Jobs: {live.url}; following it")
    else:
        log(planned.summary())
        job = hf_jobs.submit(spec, {SECRET: token}, token)
        log(f"submitted: {job.url}")
    last = None
    try:
        for line in hf_jobs.follow(job.id, spec.namespace, token):
            outcome = _outcome(line)
            if outcome is not None:
                last = outcome
            else:
                log(line)
    except KeyboardInterrupt:
        raise _interrupted(job, spec.namespace, token, ask or (lambda q: ask_stdin(q, log))) from None
    end = hf_jobs.status(job.id, spec.namespace, token)
    if last is None:
        raise RemoteJobError(
            f"Job {job.id} ended {end.stage} ({end.message or 'no message'}) without converter's outcome; its log: "
            f"{job.url}",
            job_id=job.id, url=job.url, stage=end.stage, status=end.message,
        )  # fmt: skip
    about = {"id": job.id, "url": job.url, "namespace": spec.namespace, "flavor": end.flavor or spec.flavor,
             "stage": end.stage, "followed": live is not None}  # fmt: skip
    return replace(last, details={**last.details, "job": about})


def _outcome(line: str) -> Outcome | None:
    """A log line that is a converter outcome (JSON), or None: the lines people read are passed on, not parsed."""
    if not line.startswith("{"):
        return None
    try:
        return Outcome.from_json(line)
    except ValueError:
        return None


def _interrupted(job: hf_jobs.Job, namespace: str, token: str, ask: Callable[[str], str]) -> JobInterrupted:
    """Ctrl-C while following: cancel the job when the answer is yes, else leave it running and say how to follow."""
    answer = ask(f"interrupted: cancel Job {job.id} on Hugging Face Jobs? [y/N]")
    if answer.strip().lower() in ("y", "yes"):
        hf_jobs.cancel(job.id, namespace, token)
        return JobInterrupted(f"interrupted; Job {job.id} was canceled ({job.url})", job_id=job.id, url=job.url,
                              canceled=True)  # fmt: skip
    return JobInterrupted(
        f"interrupted; Job {job.id} goes on: follow it at {job.url}, with `hf jobs logs -f {job.id}`, or by running "
        "the same command again",
        job_id=job.id, url=job.url, canceled=False,
    )  # fmt: skip


def raise_for(outcome: Outcome) -> Outcome:
    """The outcome of a job that did what it was asked; else its failure as the error it was in the job (a failed
    proof is VerificationFailed, an impossible one NotVerified, an interruption JobInterrupted, the rest
    RemoteJobError), for callers that take errors rather than outcomes (the Space)."""
    from converter.errors import NotVerified, VerificationFailed
    from converter.outcome import Verdict

    if outcome.exit_code == 0:
        return outcome
    job = outcome.details.get("job") or {}
    if outcome.verdict is Verdict.FAILED:
        raise VerificationFailed(outcome.reason)
    if outcome.verdict is Verdict.NOT_VERIFIED:
        raise NotVerified(outcome.reason)
    raise RemoteJobError(outcome.reason, job_id=job.get("id"), url=job.get("url"), stage=job.get("stage"))
