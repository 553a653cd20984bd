"""`convert --push-pr`: the converted files as a pull request on the adapter's own Hub repo."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from converter.conversion.core import ConvertResult, convert
from converter.conversion.options import FILE_TARGETS, ConvertOptions
from converter.errors import UsageError
from converter.hub import client as hub
from converter.hub.publish import our_open_pr
from converter.hub.sources import parse_source
from converter.io.scratch import temp_folder

PR_TITLE = "Add a {fmt} version of this adapter (converter)"
TARGET_NAMES = {"peft": "PEFT", "diffusers": "diffusers", "kohya": "kohya", "comfyui": "ComfyUI"}


@dataclass(frozen=True)
class PullRequest:
    """What `push_pr` did, typed (the Space and batch read it, not the log): our pull request's `url` and `commit`,
    `updated` when our open one got the commit instead of a new one being opened; or, when the repo has the
    format already, `existing` (the file that shows it) and no pull request. `conversion`: the converted files and
    their proof."""

    repo_id: str
    repo_url: str
    url: str | None = None
    commit: str | None = None
    updated: bool = False
    existing: str | None = None
    conversion: ConvertResult | None = None


def push_pr(
    adapter_spec: str,
    options: ConvertOptions,
    *,
    token: str | None = None,
    log: Callable[[str], None] = print,
) -> PullRequest:
    """Open a pull request on the adapter's own Hub repo adding the converted files, like the safetensors
    conversion bot (docs/PEERS.md): our open PR with the same title is updated instead of
    opening another, and a repo that already has the target format gets none (`existing` says why)."""
    to = options.to
    source = parse_source(adapter_spec)
    if source.repo_id is None:
        raise UsageError(f"--push-pr: {adapter_spec} is local; give the adapter as a Hub id org/name[/file]")
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    repo = source.repo_id
    me = hub.whoami(token)
    revision = source.revision or "main"
    info = hub.call(repo, lambda: api.model_info(repo, revision=revision), repo_id=repo, revision=revision)
    names = [s.rfilename for s in info.siblings or []]
    folder = source.path.rsplit("/", 1)[0] + "/" if source.path and "/" in source.path else ""
    if (have := _has_format(api, repo, info.sha, names, to)) is not None:
        log(f"{repo} already has a {TARGET_NAMES[to]} version ({have}); no pull request opened")
        return PullRequest(repo, f"{api.endpoint.rstrip('/')}/{repo}", existing=have)
    title = PR_TITLE.format(fmt=TARGET_NAMES[to])
    with temp_folder("convert", log=log) as scratch:
        stem = Path(source.path).stem if source.path else "adapter"
        out = Path(scratch) / (f"{stem}_{to}.safetensors" if to in FILE_TARGETS else "out")
        result = convert(adapter_spec, out, options, token=token, log=log)
        paths = [out] if out.is_file() else sorted(p for p in out.rglob("*") if p.is_file())
        ops = [
            CommitOperationAdd(
                path_in_repo=folder + (p.name if p == out else p.relative_to(out).as_posix()), path_or_fileobj=p
            )
            for p in paths
        ]
        description = _pr_description(adapter_spec, to, info.sha, result, options.base)
        open_pr = our_open_pr(api, repo, me, title)
        if open_pr is not None:
            log(f"updating our open pull request #{open_pr.num}")
        commit = hub.call(
            repo,
            lambda: api.create_commit(
                repo,
                ops,
                commit_message=title,
                commit_description=description,
                revision=open_pr.git_reference if open_pr is not None else None,
                create_pr=open_pr is None,
            ),
            repo_id=repo,
        )
    endpoint = api.endpoint.rstrip("/")
    url = commit.pr_url or f"{endpoint}/{repo}/discussions/{open_pr.num}"
    return PullRequest(repo, f"{endpoint}/{repo}", url, commit.oid, updated=open_pr is not None, conversion=result)


def _pr_description(spec: str, to: str, sha: str, result: ConvertResult, base: str | None) -> str:
    alphas = {
        "kohya": "a real `.alpha` per module",
        "comfyui": "its scale alpha / rank folded into `lora_B` (the form ComfyUI and diffusers read)",
    }.get(to, "`rank_pattern` / `alpha_pattern` (nothing folded)")
    lines = [
        f"This PR adds a {TARGET_NAMES[to]} version of `{spec}` (commit {sha[:10]}), converted by converter "
        "without merging.",
        "",
        f"- {result.modules} LoRA modules, each with its own rank and alpha ({alphas}).",
        f"- Files: {', '.join(result.files)}.",
    ]
    if base:
        lines.append(f"- Module names were looked up in `{base}`.")
    if result.svd_errors:
        lines.append(f"- Approximated by SVD: max relative error {max(result.svd_errors.values()):.2e}.")
    return "\n".join(lines) + "\n"


def _has_format(api, repo: str, sha: str, names: list[str], to: str) -> str | None:
    """The file that shows the repo already has format `to` (a PEFT adapter_config.json, or a safetensors file
    whose tensor names are kohya's or diffusers'), read from headers only."""
    if to == "peft":
        return next((n for n in names if n.rsplit("/", 1)[-1] == "adapter_config.json"), None)
    for name in [n for n in names if n.endswith(".safetensors")][:32]:
        meta = hub.call(
            name, lambda name=name: api.parse_safetensors_file_metadata(repo, name, revision=sha), repo_id=repo
        )
        keys = list(meta.tensor_info) if hasattr(meta, "tensor_info") else list(meta.tensors)
        if to == "kohya" and any(
            k.startswith(("lora_unet_", "lora_te")) and k.endswith(".lora_down.weight") for k in keys
        ):
            return name
        if to == "comfyui" and any(k.startswith("diffusion_model.") and k.endswith(".lora_A.weight") for k in keys):
            return name
        if to == "diffusers" and any(
            k.startswith(("unet.", "transformer.", "text_encoder")) and k.endswith(".lora_A.weight") for k in keys
        ):
            return name
    return None
