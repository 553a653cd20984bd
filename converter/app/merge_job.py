"""One Space job, start to end: check, then the pipelined push (download, merge and upload at once → verify →
one commit), in its own temp folder and HF cache.

Why a module of its own: a web server runs many jobs in one long-lived process, so each job must clean up after
itself (the temp folder, cache included, is removed in `finally`, also on failure), must refuse jobs too large for
the machine before downloading anything, and must never let the user's token reach a log line or an error.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from converter.app.check import check, space_machine
from converter.engine.recipe import AdapterSpec, Recipe
from converter.errors import ConverterError, DoesNotFit, UsageError
from converter.gguf.types import ALL_TYPES as ALL_GGUF_TYPES
from converter.hub import client as hub
from converter.hub.publish import check_repo_id, check_writable
from converter.hub.sources import cache_dir, job_sources
from converter.io.records import read_report
from converter.io.scratch import make_temp
from converter.jobs.fit import duration, money
from converter.jobs.options import PushOptions
from converter.jobs.pipeline import STAGES as PUSH_STAGES
from converter.jobs.pipeline import push
from converter.verification import VerificationReport

STAGES = ("check", *PUSH_STAGES)
DTYPES = ("keep", "float32", "float16", "bfloat16", "bnb-nf4", "bnb-fp4")
GGUF_CHOICES = ("none", *ALL_GGUF_TYPES)  # "none": no GGUF (the default)


@dataclass
class JobRequest:
    """What the form asks for; `adapters` is the text box (one `source [weight]` per line)."""

    base: str
    adapters: str
    repo_id: str = ""
    dtype: str = "keep"
    qlora_base: str = "original"
    verify: bool = True
    prompts: str = ""
    private: bool = False
    create_pr: bool = False
    gguf: str = "none"  # also a GGUF of this type, proven, in REPO-GGUF
    on_jobs: bool = False  # run as a Hugging Face Job with the user's token (a model too big for this Space)

    def recipe(self) -> Recipe:
        base = self.base.strip()
        if not base:
            raise UsageError("base model: give a Hub repo id like org/name")
        if self.dtype not in DTYPES:
            raise UsageError(f"output dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.gguf not in GGUF_CHOICES:
            raise UsageError(f"GGUF type {self.gguf!r}: choose one of {', '.join(GGUF_CHOICES)}")
        return Recipe(
            base=base,
            adapters=parse_adapters(self.adapters),
            dtype=None if self.dtype == "keep" else self.dtype,
            qlora_base=self.qlora_base,
        )

    def prompt_list(self) -> list[str] | None:
        return [p.strip() for p in self.prompts.splitlines() if p.strip()] or None

    def verify_settings(self) -> dict | None:
        """The page shows the greedy continuations side by side: the full check (same verdict as quick)."""
        return {"prompts": self.prompt_list(), "mode": "full"} if self.verify else None

    def push_options(self, on_jobs: bool = False) -> PushOptions:
        """The push the page asks for (a Job's verification uses the built-in prompts: it cannot read the page's)."""
        verify = self.verify_settings()
        if on_jobs and verify is not None:
            verify = {**verify, "prompts": None}
        gguf = None if self.gguf == "none" else self.gguf
        return PushOptions(private=self.private, create_pr=self.create_pr, verify=verify, gguf=gguf)


@dataclass
class JobResult:
    repo_id: str
    url: str
    pr_url: str | None
    commit: str | None
    changed: bool
    report: dict | None
    card: str
    log: list[str] = field(default_factory=list)
    images: list[tuple[object, str]] = field(default_factory=list)  # (PIL image, caption): diffusion side by side
    gguf_url: str | None = None  # REPO-GGUF, when a GGUF was asked for


def report_images(folder: Path, report: dict | None) -> list[tuple[object, str]]:
    """A diffusion report's base / reference / merged PNGs (paths relative to the merged folder), read into memory
    before the job folder goes: (image, caption) in gallery order, a row of three per prompt."""
    typed = VerificationReport.from_dict(report) if report else None
    if typed is None or typed.kind != "diffusion":
        return []
    from PIL import Image

    referee = "published formula" if "formula" in typed.reference else "diffusers, unmerged"
    out = []
    for row in typed.images:
        for key, label in (("base", "base"), ("reference", f"base + LoRA ({referee})"), ("merged", "merged")):
            path = getattr(row, key)
            if not path or not (folder / path).is_file():
                continue
            with Image.open(folder / path) as image:
                image.load()
                metrics = f" · PSNR {row.psnr} dB, max |Δ| {row.max_abs}" if key == "merged" else ""
                out.append((image.copy(), f"{label}: {row.prompt}{metrics}"))
    return out


def parse_weight(text: str, where: str) -> float | dict[str, float]:
    """`0.8`, or per component of a diffusion base: `unet=0.8,text_encoder=0.5` (kohya's separate strengths)."""
    try:
        if "=" not in text:
            return float(text)
        pairs = [item.split("=") for item in text.split(",") if item.strip()]
        return {name.strip(): float(value) for name, value in pairs}
    except ValueError:
        raise UsageError(
            f"{where}: weight {text!r} is not a number or `component=number,...` (e.g. unet=0.8,text_encoder=0.5)"
        ) from None


def parse_adapters(text: str) -> list[AdapterSpec]:
    """`org/name[@rev][/file] [weight]`, one per line; the weight (default 1.0) may be per component."""
    specs = []
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) > 2:
            raise UsageError(
                f"adapters, line {n}: write `org/name [weight]` (per component without spaces: "
                f"unet=0.8,text_encoder=0.5), got {line.strip()!r}"
            )
        weight = parse_weight(parts[1], f"adapters, line {n}") if len(parts) == 2 else 1.0
        specs.append(AdapterSpec(parts[0], weight))
    if not specs:
        raise UsageError("adapters: give at least one adapter (a Hub repo id like org/my-lora)")
    return specs


def _name(spec: str) -> str:
    """The repo name of a source spec, without revision or file: `org/name@rev/file` -> `name`."""
    return spec.split("@")[0].split("/")[1] if "/" in spec else spec


def default_repo(user: str, base: str, adapters: str) -> str:
    """`{user}/{base}-{adapter}-merged`, trimmed to what a repo name may hold."""
    try:
        first = parse_adapters(adapters)[0].source
    except ConverterError:
        first = "adapter"
    name = f"{_name(base.strip()) if '/' in base else 'base'}-{_name(first)}-merged"
    name = re.sub(r"[^\w.-]", "-", name).strip(".-")[:96]
    return f"{user}/{name}"


def redactor(token: str | None) -> Callable[[str], str]:
    """A filter that replaces the token wherever it appears (a last line of defence for logs and errors)."""
    if not token:
        return lambda text: text
    return lambda text: text.replace(token, "<token>")


# A file in an HF cache: .../models--org--name/snapshots/<sha>[/path]; shown as org/name@<sha7>[/path].
_CACHED = re.compile(r"[^\s'\"(]*/models--([^/\s]+?)--([^/\s]+)/snapshots/([0-9a-f]{7})[0-9a-f]*(/[^\s'\",)]*)?")


def public_paths(text: str, *roots: Path | str) -> str:
    """Server paths out of a line a user sees: cached Hub files by repo name, and anything under the job's own
    folders (`roots`: the jobs folder, a check's temp folder) relative to them. The user named Hub ids only; the
    server's layout is none of their business (and can say who else is running jobs)."""
    text = _CACHED.sub(lambda m: f"{m[1]}/{m[2]}@{m[3]}{m[4] or ''}", text)
    for root in sorted({str(Path(r)) for r in roots if r}, key=len, reverse=True):
        # converter-push.<owner>/: the push's own temp folder inside the job's (its owner names the host)
        inner = r"/(?:converter-[a-z]+\.[^/\s]+/)?(?:(?:out|check|standin|base)/)?"
        text = re.sub(re.escape(root) + inner, "", text).replace(root, "<job>")
    return text


def check_namespace(repo_id: str, token: str) -> str:
    """The signed-in user's name; refuses a target namespace the user cannot write (before any work starts)."""
    check_repo_id(repo_id)
    who = hub.whoami_info(token)
    check_writable(who, repo_id)
    return who["name"]


def run_job(
    request: JobRequest,
    token: str,
    *,
    workroot: str | Path | None = None,
    machine=None,
    stage: Callable[[str], None] = lambda name: None,
    log: Callable[[str], None] = print,
) -> JobResult:
    """Run the whole job with the user's `token` (required: nothing runs signed out). Raises ConverterError."""
    if not token:
        raise UsageError("sign in with Hugging Face first: every download and upload uses your account")
    clean = redactor(token)
    recipe = request.recipe()
    if workroot is not None:
        Path(workroot).mkdir(parents=True, exist_ok=True)
    tmp = make_temp("job", workroot, log)
    roots = (tmp, *([workroot] if workroot else []))
    lines: list[str] = []

    def say(message: str) -> None:
        message = public_paths(clean(message), *roots)
        lines.append(message)
        log(message)

    try:
        return _job(request, token, recipe, tmp, machine or space_machine(workroot), stage, say, lines)
    except ConverterError as e:  # the page shows the message: no server paths in it either
        e.args = (public_paths(clean(str(e)), *roots),)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _job(request: JobRequest, token: str, recipe: Recipe, tmp: Path, machine, stage, say, lines) -> JobResult:
    """Check, then the pipelined push (download, merge and upload at once; verification; one commit)."""
    repo_id = request.repo_id.strip()
    with job_sources(tmp / "hf-cache"):
        stage("check")
        check_namespace(repo_id, token)
        verify = request.verify_settings()
        plan = check(recipe, token, tmp / "check", machine, verify)
        shutil.rmtree(tmp / "check", ignore_errors=True)
        for w in plan.warnings:
            say(f"warning: {w}")
        if request.on_jobs:
            return _on_jobs(request, token, recipe, tmp, stage, say, lines)
        if not plan.fits:
            raise _too_big(recipe.base, plan)
        say(f"downloading {plan.bytes_to_download / 1e6:,.1f} MB")
        published: dict = {}

        def finished(folder: Path, report) -> None:  # the job folder goes with the push: read what the page shows now
            published["report"] = read_report(folder) if request.verify else None
            published["card"] = (folder / "README.md").read_text()
            published["images"] = report_images(folder, published["report"])

        # its GGUF (options.gguf) is proven inside the push, before the commit, and pushed after it
        result = push(repo_id, request.push_options(), recipe=recipe, token=token, workdir=tmp, stage=stage,
                      finished=finished, log=say)  # fmt: skip
        say(result.summary())
        gguf_url = next((c.url for c in result.companions), None)
    return JobResult(
        repo_id, result.url, result.pr_url, result.commit, result.changed, published.get("report"),
        published.get("card", ""), lines, published.get("images", []), gguf_url,
    )  # fmt: skip


def _too_big(base: str, plan) -> DoesNotFit:
    """A job this Space cannot hold, refused before any download, with the way out the page offers."""
    jobs, e = plan.jobs, plan.fit
    way = "run `converter push` on a larger machine"
    if jobs is not None:
        way = (f"tick 'Run on Hugging Face Jobs' to run it with your account on {jobs.machine.name} (about "
               f"{duration(jobs.seconds)}, {money(jobs.usd)})")  # fmt: skip
    return DoesNotFit(
        f"{base}: too big for this Space: {e.short}; {way}",
        disk=e.disk, free=e.machine.disk, memory=e.memory, available=e.machine.memory,
        flavor=jobs.machine.name if jobs else None, seconds=jobs.seconds if jobs else None,
        usd=jobs.usd if jobs else None,
    )  # fmt: skip


def _on_jobs(request: JobRequest, token: str, recipe: Recipe, tmp: Path, stage, say, lines) -> JobResult:
    """The same push as a Hugging Face Job with the user's own token (its secret there), the Job's log streamed
    into the page; the page then shows what the Job published (its verification.json and card, read back)."""
    from converter.jobs import remote

    if request.gguf != "none":
        raise UsageError("a GGUF is made on this Space only; run the merge on Hugging Face Jobs without it")
    options = request.push_options(on_jobs=True)
    if request.prompt_list():
        say("note: a Job verifies with the built-in prompts")
    planned = remote.plan(request.repo_id.strip(), recipe, options, token, workdir=tmp)
    stage(PUSH_STAGES[0])
    outcome = remote.raise_for(remote.run(planned, token, log=say, ask=lambda _question: ""))
    stage(PUSH_STAGES[-1])
    pub = outcome.publication
    report, card = _published_records(pub, token) if pub is not None else (None, "")
    url = pub.url if pub else ""
    return JobResult(pub.repo_id if pub else request.repo_id, url, pub.pr_url if pub else None,
                     pub.commit if pub else None, pub.changed if pub else False, report, card, lines)  # fmt: skip


def _published_records(pub, token: str) -> tuple[dict | None, str]:
    """verification.json and README.md as the Job committed them (the page shows both)."""
    import json

    from huggingface_hub import hf_hub_download

    def read(name: str) -> str | None:
        def download() -> str:
            return hf_hub_download(pub.repo_id, name, revision=pub.commit, token=token, cache_dir=cache_dir())

        try:
            path = hub.call(f"{pub.repo_id}/{name}", download, repo_id=pub.repo_id)
        except ConverterError:
            return None
        return Path(path).read_text()

    report = read("verification.json")
    return (json.loads(report) if report else None), read("README.md") or ""
