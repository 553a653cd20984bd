"""The Space's "Convert a LoRA" job: an adapter on the Hub → another format, as a pull request on the adapter's own
repo (`convert --push-pr`) or a new repo in the signed-in user's account.

Why a module of its own: like a merge job, it runs in a long-lived server, so it works in its own temp folder and
HF cache (removed in `finally`), keeps the user's token out of every line it shows, and creates nothing on the Hub
when the conversion fails (the upload is the last step).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from converter.app.merge_job import check_namespace, public_paths, redactor
from converter.conversion.core import ConvertResult, convert
from converter.conversion.options import FILE_TARGETS, TARGETS, ConvertOptions
from converter.conversion.pr import push_pr
from converter.errors import ConverterError, UsageError
from converter.hub import client as hub
from converter.hub.publish import push_folder
from converter.hub.sources import job_sources
from converter.io.scratch import make_temp

MODES = ("pr", "push")  # a PR on the adapter's repo, or a repo of one's own
# An owned scratch folder (converter.io.scratch names them converter-<kind>.<pid>-<start>-<made>@<host>): `--push-pr`
# converts in one of its own, outside the job's folder; its path is the server's business only.
_SCRATCH = re.compile(r"[^\s'\"(]*/\.?converter-[\w-]+\.\d+-[\w.-]+@[^/\s:'\",)]+/?")


@dataclass
class ConvertRequest:
    adapter: str  # org/name[@rev][/file.safetensors]
    to: str = "diffusers"
    base: str = ""
    mode: str = "pr"
    repo_id: str = ""  # for mode "push"; empty: {user}/{adapter name}-{to}

    def check(self) -> None:
        if "/" not in self.adapter.strip():
            raise UsageError("adapter: give a Hub id like org/name/file.safetensors")
        if self.to not in TARGETS:
            raise UsageError(f"target format {self.to!r}: choose one of {', '.join(TARGETS)}")
        if self.mode not in MODES:
            raise UsageError(f"mode {self.mode!r}: choose pr (a pull request on the adapter's repo) or push")


@dataclass
class ConvertJobResult:
    url: str | None  # the PR, or the pushed repo; None: the adapter's repo already has the format
    repo_id: str
    modules: int
    files: list[str]
    log: list[str] = field(default_factory=list)
    conversion: ConvertResult | None = None  # None: nothing converted (the repo has the format already)
    updated: bool = False  # our open pull request got the commit (no second one opened)

    @property
    def proofs(self) -> list[str]:
        """The conversion's ΔW check (and SVD error), rendered from its typed result, shown under the result."""
        c = self.conversion
        if c is None:
            return []
        lines = [c.read_back.summary()] if c.read_back is not None else []
        if c.svd_errors:
            worst = max(c.svd_errors.values())
            lines.append(f"{len(c.svd_errors)} modules approximated by SVD: relative error max {worst:.3e}")
        return lines


def default_convert_repo(user: str, adapter: str, to: str) -> str:
    stem = adapter.split("@")[0].rstrip("/").split("/")
    name = Path(stem[-1]).stem if len(stem) > 2 else stem[-1]
    return f"{user}/" + re.sub(r"[^\w.-]", "-", f"{name}-{to}").strip(".-")[:96]


def run_convert(
    request: ConvertRequest,
    token: str,
    *,
    workroot: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> ConvertJobResult:
    """Convert with the user's `token` (required) and open the PR or push; raises ConverterError."""
    if not token:
        raise UsageError("sign in with Hugging Face first: every download and upload uses your account")
    request.check()
    clean = redactor(token)
    if workroot is not None:
        Path(workroot).mkdir(parents=True, exist_ok=True)
    tmp = make_temp("convert-job", workroot, log)
    roots = (tmp, *([workroot] if workroot else []))
    lines: list[str] = []

    def say(message: str) -> None:
        message = _SCRATCH.sub("", public_paths(clean(message), *roots)) or "."
        lines.append(message)
        log(message)

    try:
        return _convert(request, token, tmp, say, lines)
    except ConverterError as e:
        e.args = (_SCRATCH.sub("", public_paths(clean(str(e)), *roots)),)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert(request: ConvertRequest, token: str, tmp: Path, say, lines: list[str]) -> ConvertJobResult:
    adapter, base = request.adapter.strip(), request.base.strip() or None
    with job_sources(tmp / "hf-cache"):
        if request.mode == "pr":
            pr = push_pr(adapter, ConvertOptions(to=request.to, base=base), token=token, log=say)
            if pr.url:
                say(f"pull request: {pr.url}")
            modules = pr.conversion.modules if pr.conversion is not None else 0
            return ConvertJobResult(pr.url, pr.repo_id, modules, [], lines, pr.conversion, pr.updated)
        repo_id = request.repo_id.strip() or default_convert_repo(hub.whoami(token), adapter, request.to)
        check_namespace(repo_id, token)
        folder = tmp / "out"
        folder.mkdir()
        stem = Path(adapter.split("@")[0]).stem
        out = folder / f"{stem}_{request.to}.safetensors" if request.to in FILE_TARGETS else folder / "adapter"
        result = convert(adapter, out, ConvertOptions(to=request.to, base=base), token=token, log=say)
        if out.is_dir():  # the folder's files at the top of the new repo
            for p in out.iterdir():
                p.rename(folder / p.name)
            out.rmdir()
        pushed = push_folder(folder, repo_id, token=token, message=f"Add a {request.to} version of {adapter}", log=say)
    link = pushed.pr_url or pushed.url
    say(f"pushed: {link}")
    return ConvertJobResult(link, repo_id, result.modules, result.files, lines, result)
