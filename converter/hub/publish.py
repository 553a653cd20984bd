"""Publish an output folder as one Hub commit (or a pull request). Idempotent; never leaves an empty repo.

The repo is created only when the first file goes up (`Publication`). If the job fails on a repo this run
created, the repo is deleted again, so a failed job leaves nothing behind; an existing repo is left exactly as it
was (the commit is atomic on the Hub side, and blobs uploaded before it belong to no commit).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from converter import outcome
from converter.errors import BadInputError, PushError, UsageError
from converter.hub import client as hub
from converter.io.records import REPORT_FILE

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
MODEL_FILES = re.compile(r"(^|/)(config\.json|.*\.safetensors|.*\.bin|.*\.gguf|adapter_config\.json)$")


@dataclass
class PushResult:
    url: str
    commit: str | None
    pr_url: str | None
    changed: bool
    pr_updated: bool = False  # our open pull request got the commit (no new one opened)
    repo_id: str = ""
    companions: tuple[PushResult, ...] = ()  # the repos pushed beside it (its GGUF, its MLX folders), in that order
    proofs: outcome.Proofs = field(default_factory=outcome.Proofs)  # their files' proofs

    def published(self) -> outcome.Published:
        """For a verb's outcome (converter.outcome)."""
        return outcome.Published(self.repo_id, self.url, self.commit, self.pr_url, self.changed, self.pr_updated)

    def summary(self) -> str:
        """The one line the CLI and the Space print after a push."""
        if self.pr_url:
            return f"pull request: {self.pr_url}"
        if not self.changed:
            return f"nothing changed: {self.url} already has these files"
        return f"pushed: {self.url}/commit/{self.commit}"


def check_repo_id(repo_id: str) -> None:
    if not REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith((".git", ".")):
        raise UsageError(f"{repo_id!r} is not a valid repo id: write namespace/name (letters, digits, - _ .)")


@dataclass
class Target:
    """The repo a push goes to, as it is before the push."""

    repo_id: str
    me: str
    exists: bool
    remote: list[str]

    @property
    def has_model(self) -> bool:
        return any(MODEL_FILES.search(f) for f in self.remote)


def inspect_target(api, repo_id: str, token: str | None, create_pr: bool = False, who: dict | None = None) -> Target:
    """The repo as it is, after checking that the token may write there (or open a pull request there); `who`:
    whoami's answer for the token where the caller has it already (one request fewer)."""
    who = who or hub.whoami_info(token)
    check_writable(who, repo_id, create_pr)
    exists = hub.call(repo_id, lambda: api.repo_exists(repo_id), repo_id=repo_id)
    remote = hub.call(repo_id, lambda: api.list_repo_files(repo_id), repo_id=repo_id) if exists else []
    return Target(repo_id, who["name"], exists, remote)


def check_writable(who: dict, repo_id: str, create_pr: bool = False) -> None:
    """Refuse, before any work, a push the Hub would refuse at its upload (`who`: whoami's answer): a namespace that
    is neither the user's nor one of their orgs where they may write (no token grants more than its user has), or
    a read-only classic token. A pull request, which anyone may open, and the scopes of fine-grained tokens are left
    for the Hub to judge."""
    if create_pr:
        return
    namespace, name = repo_id.split("/", 1)[0], who["name"]
    orgs = {o.get("name"): o.get("roleInOrg") for o in who.get("orgs") or []}
    if ((who.get("auth") or {}).get("accessToken") or {}).get("role") == "read":
        problem = "the token is read-only; use a token with write access"
    elif namespace == name:
        return
    elif namespace not in orgs:
        problem = (f"you ({name}) cannot write under {namespace!r}; use {name}/NAME or one of your organizations, "
                   "or open a pull request")  # fmt: skip
    elif orgs[namespace] == "read":
        problem = f"you ({name}) may only read in the org {namespace!r}; ask one of its admins for write access"
    else:
        return
    raise PushError(f"{repo_id}: {problem}", repo_id=repo_id, reason="forbidden")


class Publication:
    """One commit (or pull request) being prepared: the repo is created only when the first file goes up, and
    deleted again if this run created it and the job fails before its commit."""

    def __init__(
        self,
        api,
        target: Target,
        *,
        private: bool = False,
        create_pr: bool = False,
        overwrite: bool = False,
        message: str = "Upload merged model (converter)",
        log: Callable[[str], None] = print,
    ):
        self.api, self.target, self.private, self.overwrite, self.message, self.log = (
            api, target, private, overwrite, message, log,
        )  # fmt: skip
        self.create_pr = create_pr
        self.created = False
        self._lock = threading.Lock()
        self.revision, self.open_pr = None, None
        if create_pr and target.exists:
            self.open_pr = our_open_pr(api, target.repo_id, target.me, message)
            if self.open_pr is not None:
                self.revision = self.open_pr.git_reference
                log(f"updating our open pull request #{self.open_pr.num}")

    @property
    def new_pr(self) -> bool:
        """Whether the commit opens a pull request (a new repo gets its first commit on main instead)."""
        return self.create_pr and self.open_pr is None and self.target.exists

    def ensure_repo(self) -> None:
        """Create the repo if it does not exist yet (once; thread-safe): uploads need it."""
        with self._lock:
            if self.target.exists or self.created:
                return
            repo_id = self.target.repo_id
            hub.call(
                repo_id, lambda: self.api.create_repo(repo_id, private=self.private, exist_ok=True), repo_id=repo_id
            )
            self.created = True
            self.log(f"created {'private ' if self.private else ''}repo {repo_id}")

    def commit(self, operations: list, local: list[str]) -> PushResult:
        """The one commit: `operations` add `local` (the output's files); with overwrite, the rest is deleted."""
        from huggingface_hub import CommitOperationDelete

        api, repo_id = self.api, self.target.repo_id
        if self.overwrite and not self.create_pr:
            operations = operations + [
                CommitOperationDelete(path_in_repo=f)
                for f in self.target.remote
                if f not in local and f != ".gitattributes"
            ]
        self.ensure_repo()
        # huggingface_hub skips files the Hub already has; when nothing changed it makes no commit and reports the
        # current head, so comparing heads tells a no-op push.
        exists = self.target.exists
        ids = {"repo_id": repo_id, "revision": self.revision}
        head = hub.call(repo_id, lambda: api.model_info(repo_id, revision=self.revision).sha, **ids) if exists else None
        info = hub.call(
            repo_id,
            lambda: api.create_commit(
                repo_id, operations, commit_message=self.message, revision=self.revision, create_pr=self.new_pr
            ),
            **ids,
        )
        endpoint = api.endpoint.rstrip("/")
        pr_url = info.pr_url or (f"{endpoint}/{repo_id}/discussions/{self.open_pr.num}" if self.open_pr else None)
        return PushResult(url=f"{endpoint}/{repo_id}", commit=info.oid, pr_url=pr_url, changed=info.oid != head,
                          pr_updated=self.open_pr is not None, repo_id=repo_id)  # fmt: skip

    def abandon(self) -> None:
        """The job failed: remove the repo if this run created it (uploaded blobs without a commit are not
        visible anywhere)."""
        if self.created:
            try:
                self.api.delete_repo(self.target.repo_id)
            except Exception:  # noqa: BLE001 - the job's error is the one to report
                self.log(f"warning: could not delete the empty repo {self.target.repo_id}")
            self.created = False


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
    who: dict | None = None,
) -> PushResult:
    """Upload every file of `folder` to `repo_id` in one commit (or one PR); `replace` gives other bytes for
    some of them (the public versions of files that name local paths); `who` as for inspect_target."""
    replace = replace or {}
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise BadInputError(f"{folder}: nothing to push (not a folder, or empty)", file=folder)
    api = HfApi(token=token)
    target = inspect_target(api, repo_id, token, create_pr, who)
    if target.has_model and not (create_pr or overwrite):
        if _same_files(api, repo_id, folder, replace):
            head = hub.call(repo_id, lambda: api.model_info(repo_id).sha, repo_id=repo_id)
            url = f"{api.endpoint.rstrip('/')}/{repo_id}"
            return PushResult(url=url, commit=head, pr_url=None, changed=False, repo_id=repo_id)
        raise PushError(
            f"{repo_id} already has a model; use --create-pr to propose this one, or --overwrite to replace it",
            repo_id=repo_id,
            reason="conflict",
        )
    publication = Publication(
        api, target, private=private, create_pr=create_pr, overwrite=overwrite, message=message, log=log
    )
    local = local_files(folder)
    try:
        return publication.commit(additions(folder, local, replace), local)
    except BaseException:
        publication.abandon()
        raise


def additions(folder: Path, names: list[str], replace: dict[str, bytes]) -> list:
    """CommitOperationAdd for each of `names` (files of `folder`), with `replace`'s bytes where it has them."""
    from huggingface_hub import CommitOperationAdd

    return [CommitOperationAdd(path_in_repo=n, path_or_fileobj=replace.get(n, folder / n)) for n in names]


def local_files(folder: Path) -> list[str]:
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _same_files(api, repo_id: str, folder: Path, replace: dict[str, bytes]) -> bool:
    """Whether the repo's main already holds exactly these files (by sha256 for LFS files, git blob id else)."""
    info = hub.call(repo_id, lambda: api.model_info(repo_id, files_metadata=True), repo_id=repo_id)
    remote = {s.rfilename: s for s in info.siblings or [] if s.rfilename != ".gitattributes"}
    local = local_files(folder)
    if sorted(remote) != local:
        return False
    for name in local:
        sibling = remote[name]
        if name == REPORT_FILE:  # verified again before this push: the same verdict, other timings
            data = replace[name] if name in replace else (folder / name).read_bytes()
            if not _same_report(api, repo_id, info.sha, data):
                return False
        elif name in replace:
            data = replace[name]
            if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != sibling.blob_id:
                return False
        elif sibling.lfs is not None:
            if _digest(folder / name, hashlib.sha256()) != sibling.lfs.sha256:
                return False
        elif _digest(folder / name, hashlib.sha1(b"blob %d\0" % (folder / name).stat().st_size)) != sibling.blob_id:
            return False
    return True


# What a verification measures of itself, run to run
MEASURED = ("seconds", "phase_seconds", "phase_cpu_seconds", "peak_rss_mb")
# What older reports stored beside the facts: their Markdown, written from the rest (now rendered where shown)
DERIVED = ("markdown",)


def _same_report(api, repo_id: str, revision: str, local: bytes) -> bool:
    """Whether the repo's verification report says what `local` says, its own time and memory aside."""
    import json

    from huggingface_hub import hf_hub_download

    def facts(data: bytes) -> dict:
        report = json.loads(data)
        for part in (report, report.get("tensors") or {}):
            for key in MEASURED:
                part.pop(key, None)
        for key in DERIVED:
            report.pop(key, None)
        return report

    path = hub.call(
        repo_id,
        lambda: hf_hub_download(repo_id, REPORT_FILE, revision=revision, token=api.token),
        repo_id=repo_id,
        revision=revision,
    )
    try:
        return facts(Path(path).read_bytes()) == facts(local)
    except (ValueError, AttributeError):  # not a report of ours
        return False


def _digest(path: Path, h) -> str:
    """Stream a file into hash `h` (LFS files are model shards: never read them whole)."""
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def our_open_pr(api, repo_id: str, me: str, title: str):
    """An open pull request we opened earlier with the same title: re-runs update it instead of opening more."""
    for discussion in hub.call(
        repo_id,
        lambda: list(
            api.get_repo_discussions(repo_id, author=me, discussion_type="pull_request", discussion_status="open")
        ),
        repo_id=repo_id,
    ):
        if discussion.title == title:
            return discussion
    return None
