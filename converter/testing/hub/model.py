"""What the local Hub stores: files, commits, repos and users, and the Hub's rules about them that need no server.

Kept apart from the HTTP side so the data can be read (and reloaded from disk) without any request in sight.
"""

from __future__ import annotations

import fnmatch
import hashlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from converter.testing.hub.wire import HubError

REPO_TYPES = ("model", "dataset", "space")
SPACE_SDKS = ("gradio", "docker", "static", "streamlit")
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}

#: The Hub refuses non-LFS files above this size in a commit (hh#2666); preupload answers "lfs" above it.
MAX_REGULAR_FILE_SIZE = 10 * 1024 * 1024
#: Extensions always stored in LFS, even in a repo without .gitattributes (seeded repos).
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx", ".pkl", ".npz")
_LFS_PATTERNS = (
    *("*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*", "*.mlmodel"),
    *("*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb", "*.pickle", "*.pkl", "*.pt"),
    *("*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*", "*.tar", "*.tflite", "*.tgz", "*.wasm"),
    *("*.xz", "*.zip", "*.zst", "*tfevents*"),
)
#: What the Hub commits as "initial commit" in every new repo.
DEFAULT_GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in _LFS_PATTERNS).encode()


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a blob: the oid the Hub reports (and uses as ETag) for regular files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file stored in git in place of an LFS file; its blob sha1 is the file's git oid."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def now() -> str:
    """The Hub's timestamp format (UTC, microseconds, trailing Z), which the client's parser requires."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def object_id(text: str) -> str:
    """A stable 24-hex id for a name, shaped like the Hub's (Mongo) ids."""
    return hashlib.sha1(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class FileEntry:
    """One file of a commit's tree: content is the blob ``sha256``; ``oid`` is the git object id."""

    sha256: str
    size: int
    lfs: bool
    oid: str

    @property
    def etag(self) -> str:
        """What the client caches the blob under: sha256 for LFS files, git blob sha1 otherwise."""
        return self.sha256 if self.lfs else self.oid

    @property
    def pointer_size(self) -> int:
        return len(lfs_pointer(self.sha256, self.size))

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size, "lfs": self.lfs, "oid": self.oid}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FileEntry:
        return cls(sha256=d["sha256"], size=d["size"], lfs=d["lfs"], oid=d["oid"])


@dataclass
class Commit:
    """A commit with a full snapshot of the tree (path -> FileEntry), so any revision can be served directly."""

    sha: str
    parent: str | None
    title: str
    description: str
    author: str
    date: str
    files: dict[str, FileEntry]

    def to_json(self) -> dict[str, Any]:
        return {
            "sha": self.sha,
            "parent": self.parent,
            "title": self.title,
            "description": self.description,
            "author": self.author,
            "date": self.date,
            "files": {p: e.to_json() for p, e in sorted(self.files.items())},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Commit:
        files = {p: FileEntry.from_json(e) for p, e in d["files"].items()}
        return cls(d["sha"], d["parent"], d["title"], d["description"], d["author"], d["date"], files)


@dataclass
class Repo:
    """A repo: refs (``refs/heads/<b>``, ``refs/pr/<n>``) over a commit graph, plus discussions and gate grants."""

    repo_id: str
    repo_type: str
    private: bool
    gated: str | bool
    sdk: str | None
    created_at: str
    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    discussions: list[dict[str, Any]] = field(default_factory=list)
    granted: set[str] = field(default_factory=set)

    @property
    def namespace(self) -> str:
        return self.repo_id.split("/")[0]

    def meta_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "repo_type": self.repo_type,
            "private": self.private,
            "gated": self.gated,
            "sdk": self.sdk,
            "created_at": self.created_at,
            "refs": self.refs,
            "discussions": self.discussions,
            "granted": sorted(self.granted),
        }


@dataclass
class User:
    """A user, the orgs it belongs to, and whether it can pay for compute (PRO): Jobs refuse those who cannot."""

    name: str
    orgs: set[str]
    can_pay: bool = True


def ref_name(revision: str) -> str:
    return revision if revision.startswith("refs/") else f"refs/heads/{revision}"


def clean_path(path: str) -> str:
    parts = path.strip().split("/")
    if not path.strip() or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] == ".git":
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path.strip()


def walk(repo: Repo, sha: str | None) -> Iterable[Commit]:
    """Commits from ``sha`` back to the first, newest first."""
    while sha is not None:
        commit = repo.commits[sha]
        yield commit
        sha = commit.parent


def lfs_patterns(gitattributes: bytes) -> list[str]:
    patterns = []
    for line in gitattributes.decode("utf-8", "replace").splitlines():
        fields = line.split()
        if fields and not fields[0].startswith("#") and "filter=lfs" in fields[1:]:
            patterns.append(fields[0])
    return patterns


def match_any(path: str, patterns: Iterable[str]) -> bool:
    """gitignore/gitattributes-style match: a pattern without "/" matches the basename anywhere."""
    name = path.rsplit("/", 1)[-1]
    for pattern in patterns:
        pattern = pattern.rstrip("/")
        if "/" in pattern:
            if fnmatch.fnmatchcase(path, pattern.lstrip("/").replace("**/", "*")):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def event(kind: str, author: str, data: dict[str, Any]) -> dict[str, Any]:
    """One event of a discussion (a comment, a commit on a PR), as the Hub lists them."""
    return {
        "id": hashlib.sha1(f"{kind}{author}{time.time_ns()}".encode()).hexdigest()[:24],
        "type": kind,
        "createdAt": now(),
        "author": {"name": author, "type": "user"},
        "data": data,
    }


def find_discussion(repo: Repo, num: int) -> dict[str, Any]:
    for discussion in repo.discussions:
        if discussion["num"] == num:
            return discussion
    raise HubError(404, f"Discussion {num} not found")
