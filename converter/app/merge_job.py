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

from converter.app.check import check
from converter.engine.recipe import AdapterSpec, Recipe
from converter.errors import ConverterError, UsageError
from converter.gguf.types import ALL_TYPES as ALL_GGUF_TYPES
from converter.hub import client as hub
from converter.hub.publish import check_repo_id, check_writable
from converter.hub.sources import job_sources
from converter.io.records import read_report
from converter.io.scratch import make_temp
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
    limits=None,
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
        return _job(request, token, recipe, tmp, limits, stage, say, lines)
    except ConverterError as e:  # the page shows the message: no server paths in it either
        e.args = (public_paths(clean(str(e)), *roots),)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _job(request: JobRequest, token: str, recipe: Recipe, tmp: Path, limits, stage, say, lines) -> JobResult:
    """Check, then the pipelined push (download, merge and upload at once; verification; one commit)."""
    repo_id = request.repo_id.strip()
    with job_sources(tmp / "hf-cache"):
        stage("check")
        check_namespace(repo_id, token)
        plan = check(recipe, token, tmp / "check", limits)
        shutil.rmtree(tmp / "check", ignore_errors=True)
        for w in plan.warnings:
            say(f"warning: {w}")
        say(f"downloading {plan.bytes_to_download / 1e6:,.1f} MB")
        # The page shows the greedy continuations side by side: the full check (same verdict as quick)
        verify = {"prompts": request.prompt_list(), "mode": "full"} if request.verify else None
        published: dict = {}
        gguf = _pending_gguf(request, repo_id, tmp, say)

        def finished(folder: Path) -> None:  # the job folder goes with the push: read what the page shows now
            published["report"] = read_report(folder) if request.verify else None
            published["card"] = (folder / "README.md").read_text()
            published["images"] = report_images(folder, published["report"])
            if gguf is not None:  # written and proven before the commit: a failed proof commits nothing
                gguf.export(folder)

        result = push(
            repo_id,
            recipe=recipe,
            token=token,
            private=request.private,
            create_pr=request.create_pr,
            workdir=tmp,
            verify=verify,
            stage=stage,
            finished=finished,
            log=say,
            keep_output=gguf is not None,
            tee=gguf.tee() if gguf is not None else None,
        )
        say(result.summary())
        if gguf is not None:
            pushed = gguf.push(repo_id, token=token, private=request.private)
            published["gguf_url"] = pushed.url
            say(f"GGUF: {pushed.summary()}")
    return JobResult(
        repo_id, result.url, result.pr_url, result.commit, result.changed, published.get("report"),
        published.get("card", ""), lines, published.get("images", []), published.get("gguf_url"),
    )  # fmt: skip


def _pending_gguf(request: JobRequest, repo_id: str, tmp: Path, say: Callable[[str], None]):
    """The GGUF choice: its type and the extra it needs checked before the job starts (the architecture when the
    merged folder is there, still before the commit)."""
    if request.gguf == "none":
        return None
    from converter.gguf.export import check_merge_gguf
    from converter.gguf.publish import PendingGGUF

    return PendingGGUF(check_merge_gguf(request.gguf, None), repo_id.split("/")[1], say, workdir=tmp)
