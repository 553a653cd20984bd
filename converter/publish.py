"""Publish an output folder as one Hub commit (or a pull request). Idempotent; never leaves an empty repo.

The repo is created only when the upload starts. If the upload fails on a repo this run created, the repo is
deleted again, so a failed job leaves nothing behind; an existing repo is left exactly as it was (the commit
is atomic on the Hub side).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from converter import hub
from converter.errors import ConverterError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
MODEL_FILES = re.compile(r"(^|/)(config\.json|.*\.safetensors|.*\.bin|.*\.gguf|adapter_config\.json)$")


@dataclass
class PushResult:
    url: str
    commit: str | None
    pr_url: str | None
    changed: bool

    def summary(self) -> str:
        """The one line the CLI and the Space print after a push."""
        if self.pr_url:
            return f"pull request: {self.pr_url}"
        if not self.changed:
            return f"nothing changed: {self.url} already has these files"
        return f"pushed: {self.url}/commit/{self.commit}"


def check_repo_id(repo_id: str) -> None:
    if not REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith((".git", ".")):
        raise ConverterError(f"{repo_id!r} is not a valid repo id: write namespace/name (letters, digits, - _ .)")


def push_folder(
    folder: Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    create_pr: bool = False,
    overwrite: bool = False,
    message: str = "Upload merged model (converter)",
    replace: dict[str, bytes] | None = None,
    log: Callable[[str], None] = print,
) -> PushResult:
    """Upload every file of `folder` to `repo_id` in one commit (or one PR); `replace` gives other bytes for
    some of them (the public versions of files that name local paths)."""
    replace = replace or {}
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    check_repo_id(repo_id)
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise ConverterError(f"{folder}: nothing to push (not a folder, or empty)")
    api = HfApi(token=token)
    me = hub.whoami(token)
    exists = hub.call(repo_id, lambda: api.repo_exists(repo_id))
    remote: list[str] = []
    if exists:
        remote = hub.call(repo_id, lambda: api.list_repo_files(repo_id))
        if any(MODEL_FILES.search(f) for f in remote) and not (create_pr or overwrite):
            if _same_files(api, repo_id, folder, replace):
                head = hub.call(repo_id, lambda: api.model_info(repo_id).sha)
                return PushResult(url=f"{api.endpoint.rstrip('/')}/{repo_id}", commit=head, pr_url=None, changed=False)
            raise ConverterError(
                f"{repo_id} already has a model; use --create-pr to propose this one, or --overwrite to replace it"
            )
    local = _local_files(folder)
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=replace.get(name, folder / name)) for name in local
    ]
    if overwrite and not create_pr:
        operations += [
            CommitOperationDelete(path_in_repo=f) for f in remote if f not in local and f != ".gitattributes"
        ]

    created = False
    if not exists:
        hub.call(repo_id, lambda: api.create_repo(repo_id, private=private, exist_ok=True))
        created = True
        log(f"created {'private ' if private else ''}repo {repo_id}")
    revision, open_pr = None, None
    if create_pr and exists:
        open_pr = _our_open_pr(api, repo_id, me, message)
        if open_pr is not None:
            revision = open_pr.git_reference
            log(f"updating our open pull request #{open_pr.num}")
    # huggingface_hub skips files the Hub already has; when nothing changed it makes no commit and reports the
    # current head, so comparing heads tells a no-op push.
    head = hub.call(repo_id, lambda: api.model_info(repo_id, revision=revision).sha) if exists else None
    try:
        info = hub.call(
            repo_id,
            lambda: api.create_commit(
                repo_id,
                operations,
                commit_message=message,
                revision=revision,
                create_pr=create_pr and open_pr is None and exists,
            ),
        )
    except BaseException:
        if created:
            try:
                api.delete_repo(repo_id)
            except Exception:  # noqa: BLE001 - the upload error is the one to report
                log(f"warning: could not delete the empty repo {repo_id}")
        raise
    endpoint = api.endpoint.rstrip("/")
    pr_url = info.pr_url or (f"{endpoint}/{repo_id}/discussions/{open_pr.num}" if open_pr else None)
    return PushResult(url=f"{endpoint}/{repo_id}", commit=info.oid, pr_url=pr_url, changed=info.oid != head)


def _local_files(folder: Path) -> list[str]:
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _same_files(api, repo_id: str, folder: Path, replace: dict[str, bytes]) -> bool:
    """Whether the repo's main already holds exactly these files (by sha256 for LFS files, git blob id else)."""
    info = hub.call(repo_id, lambda: api.model_info(repo_id, files_metadata=True))
    remote = {s.rfilename: s for s in info.siblings or [] if s.rfilename != ".gitattributes"}
    local = _local_files(folder)
    if sorted(remote) != local:
        return False
    for name in local:
        sibling = remote[name]
        if name in replace:
            data = replace[name]
            if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != sibling.blob_id:
                return False
        elif sibling.lfs is not None:
            if _digest(folder / name, hashlib.sha256()) != sibling.lfs.sha256:
                return False
        elif _digest(folder / name, hashlib.sha1(b"blob %d\0" % (folder / name).stat().st_size)) != sibling.blob_id:
            return False
    return True


def _digest(path: Path, h) -> str:
    """Stream a file into hash `h` (LFS files are model shards: never read them whole)."""
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def _our_open_pr(api, repo_id: str, me: str, title: str):
    """An open pull request we opened earlier with the same title: re-runs update it instead of opening more."""
    for discussion in hub.call(
        repo_id,
        lambda: list(
            api.get_repo_discussions(repo_id, author=me, discussion_type="pull_request", discussion_status="open")
        ),
    ):
        if discussion.title == title:
            return discussion
    return None
