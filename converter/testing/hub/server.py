"""A small in-process Hugging Face Hub that the real ``huggingface_hub`` client (2.4) talks to over HTTP.

Why: the converter downloads bases/adapters and publishes merged repos, PRs and a Space. Mocking
``huggingface_hub`` functions would test our assumptions about the client, not the client; this server speaks the
wire protocol the client really uses (docs/PEERS.md, "The huggingface_hub protocol"), keeps
real commit history on disk, enforces auth/private/gated rules, and injects faults (5xx, 429, dropped connections,
slowness) on demand so retry and resume paths can be tested offline. For benchmarks it can also hold transfers to
a bandwidth (``down_rate`` / ``up_rate``: one shared link each way), streaming file bodies both ways.

Usage::

    with HubServer(tmp_path / "hub") as hub:
        hub.add_user("alice", "hf_alice")
        hub.seed_folder("alice/base", folder)
        run_client(hub, "from huggingface_hub import snapshot_download; print(snapshot_download('alice/base'))")

``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HUB_DISABLE_XET`` and ``HF_HOME`` at import time, so client code must
run in a subprocess (``run_client`` / ``client_env``) or the env (``hub_env``) must be set before the first import of
``huggingface_hub`` (e.g. start the server at the top of a conftest). ``HF_HUB_DISABLE_XET=1`` is mandatory: with
hf_xet installed the 2.x client uploads through Xet and never calls the LFS endpoints served here.

Not served (404): Xet, git smart HTTP, branch/tag creation, PR merge, settings, likes, search/listing of repos.
Tokens are never logged: request logging goes to the ``converter.testing.hub`` logger at DEBUG level and only
carries the request line.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = [
    "Commit",
    "Fault",
    "FileEntry",
    "HubError",
    "HubServer",
    "Link",
    "Seen",
    "client_env",
    "git_blob_sha1",
    "hub_env",
    "run_client",
]

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------------------
# Constants: the Hub's rules that the client relies on
# ----------------------------------------------------------------------------------------------------------------------

REPO_TYPES = ("model", "dataset", "space")
SPACE_SDKS = ("gradio", "docker", "static", "streamlit")
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_TYPE_FROM_SEGMENT = {"models": "model", "datasets": "dataset", "spaces": "space", "": "model"}

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
_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)
_DISCUSSIONS_PAGE = 50
_STREAM_CHUNK = 256 * 1024  # file bodies move in chunks of this size (through the bandwidth links)
_COMMITS_PAGE = 100


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a blob: the oid the Hub reports (and uses as ETag) for regular files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file stored in git in place of an LFS file; its blob sha1 is the file's git oid."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


# ----------------------------------------------------------------------------------------------------------------------
# Data model (persisted as JSON under root/repos, blobs content-addressed under root/blobs)
# ----------------------------------------------------------------------------------------------------------------------


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
class _User:
    name: str
    orgs: set[str]


@dataclass
class Fault:
    """A fault served to the next ``times`` requests whose method and path (no query) match; ``hits`` counts them."""

    method: str | None
    path_regex: re.Pattern[str]
    status: int | None = None
    times: int = 1
    retry_after: float | None = None
    drop_connection: bool = False
    delay: float = 0.0
    hits: int = 0
    after: int = 0  # matching requests let through untouched before the fault starts
    passed: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (
            self.hits < self.times
            and (self.method is None or self.method.upper() == method)
            and self.path_regex.search(path) is not None
        )


@dataclass(frozen=True)
class Seen:
    """One request as served (never its headers beyond Range: tokens stay out of logs)."""

    method: str
    path: str
    query: str
    status: int
    range: str | None
    authenticated: bool
    fault: bool


class HubError(Exception):
    """An HTTP error as the Hub sends it: status, ``X-Error-Code`` (how the client picks its exception), message."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})

    def response(self, head: bool) -> _Response:
        headers = dict(self.headers)
        if self.code:
            headers["X-Error-Code"] = self.code
        if head:  # no body on HEAD: the client reads the message from this header
            headers["X-Error-Message"] = self.message
        return _json({"error": self.message}, self.status, headers)


@dataclass
class _Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    file: tuple[Path, int, int] | None = None  # (path, start, length): a blob range streamed after the lock


@dataclass(frozen=True)
class _Upload:
    """A request body streamed to a file (LFS uploads): never held in memory."""

    path: Path
    sha256: str
    size: int


class Link:
    """One network link shared by every transfer in one direction, at `rate` bytes/s (None: unlimited).

    Each chunk reserves the next free slot on the link, so concurrent transfers share the rate like one wire."""

    def __init__(self, rate: float | None = None):
        self.rate = rate
        self._lock = threading.Lock()
        self._free = 0.0

    def take(self, n: int) -> None:
        """Block until `n` more bytes may pass."""
        if not self.rate or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free)
            self._free = start + n / self.rate
            until = self._free
        if until > now:
            time.sleep(until - now)


def _json(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> _Response:
    body = json.dumps(obj).encode()
    return _Response(status, body, {"Content-Type": "application/json; charset=utf-8", **(headers or {})})


@dataclass
class _Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Mapping[str, str]
    body: bytes
    user: _User | None
    role: str | None
    params: dict[str, str]
    upload: _Upload | None = None

    def q(self, name: str, default: str | None = None) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else default

    def flag(self, name: str) -> bool:
        return (self.q(name) or "").lower() in ("1", "true", "yes")

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as e:
            raise HubError(400, f"Invalid JSON body: {e}") from None

    @property
    def repo_type(self) -> str:
        return _TYPE_FROM_SEGMENT[self.params.get("type") or self.params.get("prefix", "").rstrip("/") or ""]

    @property
    def repo_id(self) -> str:
        return self.params["repo"]


# ----------------------------------------------------------------------------------------------------------------------
# The server: state, seeding API, rules
# ----------------------------------------------------------------------------------------------------------------------


class HubServer:
    """A fake Hub on 127.0.0.1 (free port, threaded) whose repos live on disk under ``root``.

    State is reloaded from ``root`` on construction, so a "restarted Hub" keeps its repos. ``requests`` lists
    (method, raw path without query) of every request in arrival order, faulted ones included, for assertions like
    "the second run downloaded nothing"; ``seen`` has the same with status, Range and whether a token was sent.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        tree_page_size: int = 1000,
        down_rate: float | None = None,
        up_rate: float | None = None,
    ) -> None:
        """`down_rate` / `up_rate`: bytes/s of the one link each way (server to client / client to server)."""
        self.root = Path(root)
        self.down, self.up = Link(down_rate), Link(up_rate)
        self.root.mkdir(parents=True, exist_ok=True)
        self.tree_page_size = tree_page_size
        self.requests: list[tuple[str, str]] = []
        self.seen: list[Seen] = []
        self._lock = threading.RLock()
        self._users: dict[str, _User] = {}
        self._tokens: dict[str, tuple[str, str]] = {}  # token -> (user, role)
        self._repos: dict[tuple[str, str], Repo] = {}
        self._faults: list[Fault] = []
        self._pending_lfs: dict[str, int] = {}
        self._request_ids = itertools.count(1)
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._load()

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self) -> HubServer:
        """Bind a free port on 127.0.0.1 and serve in a daemon thread."""
        if self._httpd is None:
            self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler, self)
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port (open keep-alive connections die with their daemon threads)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._httpd = self._thread = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The endpoint to give the client as ``HF_ENDPOINT`` (no trailing slash)."""
        if self._httpd is None:
            raise RuntimeError("HubServer is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    # -- users -------------------------------------------------------------------------------------------------------

    def add_user(self, name: str, token: str, orgs: Iterable[str] = (), *, role: str = "write") -> None:
        """Register a user (member of ``orgs``) with one token; ``role`` "read" tokens cannot write."""
        with self._lock:
            self._users[name] = _User(name, set(orgs))
            self._tokens[token] = (name, role)

    def add_token(self, user: str, token: str, role: str = "read") -> None:
        """Give an existing user another token, e.g. a read-only one to test permission errors."""
        with self._lock:
            if user not in self._users:
                raise KeyError(f"unknown user {user!r}")
            self._tokens[token] = (user, role)

    def redact(self, text: str) -> str:
        """Replace every registered token in ``text``: used before showing client output in assertion messages."""
        for token in self._tokens:
            text = text.replace(token, "<TOKEN>")
        return text

    # -- faults ------------------------------------------------------------------------------------------------------

    def inject(
        self,
        method: str | None,
        path_regex: str,
        status: int | None = None,
        times: int = 1,
        retry_after: float | None = None,
        drop_connection: bool = False,
        delay: float = 0.0,
        after: int = 0,
    ) -> Fault:
        """Make the next ``times`` matching requests fail: ``status`` (+ ``Retry-After``), a connection dropped
        half-way through the response body (or before any byte when there is no body), and/or a ``delay``; the
        first ``after`` matching requests pass untouched (e.g. a file's header reads before its download).

        ``path_regex`` is searched in the raw request path without query string (revision ``refs/pr/1`` appears as
        ``refs%2Fpr%2F1``). Note the 2.4 client only parses integer ``Retry-After`` values.
        """
        if status is None and not drop_connection and not delay:
            raise ValueError("a fault needs a status, drop_connection or a delay")
        fault = Fault(
            method.upper() if method else None,
            re.compile(path_regex),
            status,
            times,
            retry_after,
            drop_connection,
            delay,
            after=after,
        )
        with self._lock:
            self._faults.append(fault)
        return fault

    def reset_log(self) -> None:
        """Forget ``requests`` and ``seen`` (e.g. between the two runs of a caching test)."""
        self.requests.clear()
        self.seen.clear()

    def clear_faults(self) -> None:
        """Drop faults not yet consumed, so one test's leftovers cannot hit the next."""
        with self._lock:
            self._faults.clear()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path):
                    if fault.passed < fault.after:
                        fault.passed += 1
                        continue
                    fault.hits += 1
                    return fault
        return None

    # -- seeding API (no HTTP) ---------------------------------------------------------------------------------------

    def create_repo(
        self,
        repo_id: str,
        private: bool = False,
        owner_token: str | None = None,
        gated: bool | str = False,
        *,
        repo_type: str = "model",
        sdk: str | None = None,
        exist_ok: bool = False,
    ) -> str:
        """Create a repo with the Hub's "initial commit" (.gitattributes; README for Spaces); returns its URL.

        ``owner_token`` (optional) must belong to a user who may write the namespace; it becomes the author.
        """
        author = repo_id.split("/")[0]
        if owner_token is not None:
            name, role = self._tokens[owner_token]
            user = self._users[name]
            if not self._can_write(user, role, author):
                raise PermissionError(f"{name} cannot create repos under {author}")
            author = name
        with self._lock:
            repo = self._repos.get((repo_type, repo_id))
            if repo is None:
                repo = self._create(repo_id, repo_type, private=private, gated=gated, sdk=sdk, author=author)
            elif not exist_ok:
                raise FileExistsError(repo_id)
            return self._repo_url(repo)

    def commit_files(
        self,
        repo_id: str,
        files: Mapping[str, bytes | Path],
        message: str = "Upload files",
        revision: str = "main",
        *,
        repo_type: str = "model",
        delete: Iterable[str] = (),
        author: str | None = None,
        description: str = "",
    ) -> str:
        """Commit ``files`` (and deletions) on top of ``revision`` (a branch, created from main if missing, or a
        ``refs/pr/N``); LFS or not is decided like the Hub's preupload. Returns the new commit sha."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            ref = _ref_name(revision)
            if ref not in repo.refs:
                if not ref.startswith("refs/heads/"):
                    raise KeyError(f"no ref {ref} in {repo_id}")
                repo.refs[ref] = repo.refs["refs/heads/main"]
            parent = repo.commits[repo.refs[ref]]
            tree = dict(parent.files)
            for path in delete:
                tree.pop(_clean_path(path))
            for path, content in files.items():
                path = _clean_path(path)
                if isinstance(content, Path):
                    tree[path] = self._store_file(parent.files, path, content)
                    continue
                data = bytes(content)
                tree[path] = self._store(data, lfs=self._is_lfs(parent.files, path, len(data), data[:512]))
            commit = self._commit(repo, parent.sha, tree, message, description, author or repo.namespace)
            self._move_ref(repo, ref, commit)
            self._save_repo(repo)
            return commit.sha

    def seed_folder(
        self,
        repo_id: str,
        folder: Path | str,
        message: str = "Upload folder using huggingface_hub",
        *,
        repo_type: str = "model",
        private: bool = False,
        revision: str = "main",
    ) -> str:
        """Create the repo if needed and commit every file under ``folder`` (like upload_folder); returns the sha."""
        folder = Path(folder)
        files: dict[str, bytes | Path] = {}
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if path.is_file() and not (rel.startswith(".git/") or rel.startswith(".cache/huggingface")):
                files[rel] = path
        self.create_repo(
            repo_id, private, repo_type=repo_type, exist_ok=True, sdk="gradio" if repo_type == "space" else None
        )
        return self.commit_files(repo_id, files, message, revision, repo_type=repo_type)

    def grant_access(self, repo_id: str, user: str, repo_type: str = "model") -> None:
        """Let ``user`` through the gate of a gated repo (as accepting its conditions would)."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            repo.granted.add(user)
            self._save_repo(repo)

    # -- inspection (no HTTP) ----------------------------------------------------------------------------------------

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        """The live repo object: flags (``private``, ``gated``) changed on it take effect on the next request."""
        return self._repos[(repo_type, repo_id)]

    def exists(self, repo_id: str, repo_type: str = "model") -> bool:
        """Whether the repo exists, seen from the server (no visibility rules), e.g. after a delete."""
        return (repo_type, repo_id) in self._repos

    def head(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> str:
        """The commit sha ``revision`` points at."""
        with self._lock:
            return self._resolve(self._repos[(repo_type, repo_id)], revision)

    def history(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> list[Commit]:
        """Commits reachable from ``revision``, newest first."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            return list(_walk(repo, self._resolve(repo, revision)))

    def files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, FileEntry]:
        """The tree at ``revision``: path -> FileEntry (size, lfs, oid), to assert what a push produced."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            return dict(repo.commits[self._resolve(repo, revision)].files)

    def read_file(self, repo_id: str, path: str, revision: str = "main", repo_type: str = "model") -> bytes:
        """The content of ``path`` at ``revision``, straight from the blob store."""
        return self._read_blob(self.files(repo_id, revision, repo_type)[path].sha256)

    # -- persistence -------------------------------------------------------------------------------------------------

    def _repo_dir(self, repo: Repo) -> Path:
        return self.root / "repos" / f"{repo.repo_type}s" / repo.repo_id

    def _blob_path(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256[:2] / sha256

    def _has_blob(self, sha256: str, size: int | None = None) -> bool:
        path = self._blob_path(sha256)
        return path.is_file() and (size is None or path.stat().st_size == size)

    def _read_blob(self, sha256: str, start: int = 0, length: int | None = None) -> bytes:
        with open(self._blob_path(sha256), "rb") as f:
            f.seek(start)
            return f.read() if length is None else f.read(length)

    def _write_atomic(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def _put_blob(self, data: bytes) -> str:
        sha256 = hashlib.sha256(data).hexdigest()
        if not self._has_blob(sha256, len(data)):
            self._write_atomic(self._blob_path(sha256), data)
        return sha256

    def _save_repo(self, repo: Repo) -> None:
        self._write_atomic(self._repo_dir(repo) / "repo.json", json.dumps(repo.meta_json(), indent=1).encode())

    def _save_commit(self, repo: Repo, commit: Commit) -> None:
        self._write_atomic(
            self._repo_dir(repo) / "commits" / f"{commit.sha}.json", json.dumps(commit.to_json()).encode()
        )

    def _load(self) -> None:
        for meta_path in sorted(self.root.glob("repos/*/*/*/repo.json")):
            meta = json.loads(meta_path.read_text())
            repo = Repo(
                meta["repo_id"],
                meta["repo_type"],
                meta["private"],
                meta["gated"],
                meta["sdk"],
                meta["created_at"],
                refs=meta["refs"],
                discussions=meta["discussions"],
                granted=set(meta["granted"]),
            )
            for commit_path in meta_path.parent.glob("commits/*.json"):
                commit = Commit.from_json(json.loads(commit_path.read_text()))
                repo.commits[commit.sha] = commit
            self._repos[(repo.repo_type, repo.repo_id)] = repo

    # -- rules -------------------------------------------------------------------------------------------------------

    def _repo_url(self, repo: Repo) -> str:
        base = self.url if self._httpd is not None else "http://127.0.0.1"
        return f"{base}/{_URL_PREFIX[repo.repo_type]}{repo.repo_id}"

    def _authenticate(self, header: str | None) -> tuple[_User | None, str | None]:
        if not header:
            return None, None
        scheme, _, token = header.partition(" ")
        entry = self._tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if entry is None:
            # huggingface_hub special-cases this exact message (not mapped to RepositoryNotFoundError).
            msg = "Invalid credentials in Authorization header"
            raise HubError(401, msg, headers={"X-Error-Message": msg})
        return self._users[entry[0]], entry[1]

    @staticmethod
    def _is_member(user: _User | None, namespace: str) -> bool:
        return user is not None and (user.name == namespace or namespace in user.orgs)

    def _can_write(self, user: _User | None, role: str | None, namespace: str) -> bool:
        return self._is_member(user, namespace) and role == "write"

    def _check_write(self, req: _Request, namespace: str) -> None:
        if req.user is None:
            raise HubError(401, "You must be authenticated to perform this operation")
        if req.role != "write":
            raise HubError(403, "You have read access but not the required permissions for this operation")
        if not self._is_member(req.user, namespace):
            raise HubError(403, f"You don't have the rights to write to the namespace {namespace!r}")

    def _require_repo(self, req: _Request, *, write: bool = False, content: bool = False) -> Repo:
        """The repo of the request, with the Hub's visibility (private -> not found), gate and write rules."""
        repo = self._repos.get((req.repo_type, req.repo_id))
        if repo is None or (repo.private and not self._is_member(req.user, repo.namespace)):
            raise HubError(401 if req.user is None else 404, "Repository not found", "RepoNotFound")
        if content and repo.gated and not self._passes_gate(repo, req.user):
            msg = f"Access to {repo.repo_type} {repo.repo_id} is restricted. You must have access to it."
            raise HubError(401 if req.user is None else 403, msg, "GatedRepo")
        if write:
            self._check_write(req, repo.namespace)
        return repo

    def _passes_gate(self, repo: Repo, user: _User | None) -> bool:
        return user is not None and (self._is_member(user, repo.namespace) or user.name in repo.granted)

    def _resolve(self, repo: Repo, revision: str) -> str:
        ref = _ref_name(revision)
        if ref in repo.refs:
            return repo.refs[ref]
        if re.fullmatch(r"[0-9a-f]{7,40}", revision):
            found = [sha for sha in repo.commits if sha.startswith(revision)]
            if len(found) == 1:
                return found[0]
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _is_lfs(self, base: Mapping[str, FileEntry], path: str, size: int, sample: bytes) -> bool:
        """The preupload decision: big, binary, a known weight format, or matched by .gitattributes filter=lfs."""
        if size > MAX_REGULAR_FILE_SIZE or b"\0" in sample or path.lower().endswith(LFS_SUFFIXES):
            return True
        attrs = base.get(".gitattributes")
        patterns = _lfs_patterns(self._read_blob(attrs.sha256)) if attrs else []
        return _match_any(path, patterns)

    def _store_file(self, base: Mapping[str, FileEntry], path: str, source: Path) -> FileEntry:
        """Like _store for a file on disk, copied into the blob store without reading it into memory."""
        size = source.stat().st_size
        with open(source, "rb") as f:
            sample = f.read(512)
        if not self._is_lfs(base, path, size, sample):
            return self._store(source.read_bytes(), lfs=False)
        h = hashlib.sha256()
        with open(source, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        sha256 = h.hexdigest()
        if not self._has_blob(sha256, size):
            target = self._blob_path(sha256)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{threading.get_ident()}.tmp")
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        return FileEntry(sha256, size, True, git_blob_sha1(lfs_pointer(sha256, size)))

    def _store(self, data: bytes, *, lfs: bool) -> FileEntry:
        sha256 = self._put_blob(data)
        oid = git_blob_sha1(lfs_pointer(sha256, len(data)) if lfs else data)
        return FileEntry(sha256, len(data), lfs, oid)

    def _create(
        self, repo_id: str, repo_type: str, *, private: bool, gated: bool | str, sdk: str | None, author: str
    ) -> Repo:
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Invalid repo type {repo_type!r}")
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
            raise HubError(400, f"Invalid repo name {repo_id!r}")
        repo = Repo(repo_id, repo_type, private, "auto" if gated is True else gated, sdk, _now())
        files = {".gitattributes": self._store(DEFAULT_GITATTRIBUTES, lfs=False)}
        if repo_type == "space":
            name = repo_id.split("/")[1]
            readme = f"---\ntitle: {name}\nemoji: 🚀\ncolorFrom: blue\ncolorTo: red\nsdk: {sdk}\npinned: false\n---\n"
            files["README.md"] = self._store(readme.encode(), lfs=False)
        commit = self._commit(repo, None, files, "initial commit", "", author)
        repo.refs["refs/heads/main"] = commit.sha
        self._repos[(repo_type, repo_id)] = repo
        self._save_repo(repo)
        return repo

    def _commit(
        self, repo: Repo, parent: str | None, files: dict[str, FileEntry], title: str, description: str, author: str
    ) -> Commit:
        date = _now()
        tree = {p: e.oid for p, e in sorted(files.items())}
        payload = json.dumps([parent, tree, title, description, author, date], sort_keys=True).encode()
        commit = Commit(hashlib.sha1(payload).hexdigest(), parent, title, description, author, date, files)
        repo.commits[commit.sha] = commit
        self._save_commit(repo, commit)
        return commit

    def _move_ref(self, repo: Repo, ref: str, commit: Commit) -> None:
        repo.refs[ref] = commit.sha
        if ref.startswith("refs/pr/"):
            discussion = _find_discussion(repo, int(ref.rsplit("/", 1)[1]))
            discussion["events"].append(_event("commit", commit.author, {"subject": commit.title, "oid": commit.sha}))

    def _open_discussion(self, repo: Repo, title: str, description: str, author: str, pr_head: str | None) -> dict:
        num = len(repo.discussions) + 1
        discussion = {
            "num": num,
            "title": title,
            "status": "open",
            "isPullRequest": pr_head is not None,
            "createdAt": _now(),
            "author": author,
            "events": [_event("comment", author, {"edited": False, "hidden": False, "latest": {"raw": description}})],
        }
        repo.discussions.append(discussion)
        if pr_head is not None:
            repo.refs[f"refs/pr/{num}"] = pr_head
            discussion["events"].append(
                _event("commit", author, {"subject": repo.commits[pr_head].title, "oid": pr_head})
            )
        return discussion

    def _repo_info(self, repo: Repo, commit: Commit, blobs: bool) -> dict[str, Any]:
        siblings = []
        for path, entry in sorted(commit.files.items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling.update(size=entry.size, blobId=entry.oid)
                if entry.lfs:
                    sibling["lfs"] = {"size": entry.size, "sha256": entry.sha256, "pointerSize": entry.pointer_size}
            siblings.append(sibling)
        card = self._card_data(commit)
        info: dict[str, Any] = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "author": repo.namespace,
            "sha": commit.sha,
            "lastModified": commit.date,
            "createdAt": repo.created_at,
            "private": repo.private,
            "gated": repo.gated,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": _derive_tags(card, commit),
            "siblings": siblings,
            "usedStorage": sum(e.size for e in commit.files.values()),
        }
        if card is not None:
            info["cardData"] = card
        if repo.repo_type == "model":
            info["modelId"] = repo.repo_id
            info["library_name"] = (card or {}).get("library_name")
            info["pipeline_tag"] = (card or {}).get("pipeline_tag")
            info["config"] = self._config_summary(commit)
            info["safetensors"] = self._safetensors_summary(commit)
            info["spaces"] = []
        elif repo.repo_type == "space":
            info["sdk"] = repo.sdk
        return info

    def _card_data(self, commit: Commit) -> dict[str, Any] | None:
        entry = commit.files.get("README.md")
        if entry is None:
            return None
        try:
            return _front_matter(self._read_blob(entry.sha256).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None

    def _config_summary(self, commit: Commit) -> dict[str, Any] | None:
        entry = commit.files.get("config.json")
        try:
            config = json.loads(self._read_blob(entry.sha256)) if entry else None
        except ValueError:
            return None
        if not isinstance(config, dict):
            return None
        return {k: config[k] for k in ("architectures", "model_type") if k in config}

    def _safetensors_summary(self, commit: Commit) -> dict[str, Any] | None:
        """Parameter counts per dtype from the safetensors headers, like the Hub's ``safetensors`` field."""
        params: dict[str, int] = {}
        for path, entry in commit.files.items():
            if not path.endswith(".safetensors") or entry.size < 8:
                continue
            (n,) = struct.unpack("<Q", self._read_blob(entry.sha256, 0, 8))
            if n > entry.size - 8:
                continue  # not a safetensors file after all: the Hub leaves it out of the summary
            try:
                header = json.loads(self._read_blob(entry.sha256, 8, n))
                counts = {
                    name: (t["dtype"], math.prod(t["shape"])) for name, t in header.items() if name != "__metadata__"
                }
            except (ValueError, AttributeError, KeyError, TypeError):
                continue
            for dtype, count in counts.values():
                params[dtype] = params.get(dtype, 0) + count
        return {"parameters": params, "total": sum(params.values())} if params else None

    def _tree_items(self, commit: Commit, path: str, recursive: bool) -> list[dict[str, Any]]:
        prefix = f"{path}/" if path else ""
        if path and path in commit.files:
            raise HubError(404, f"{path} is a file, not a directory", "EntryNotFound")
        under = {p: e for p, e in commit.files.items() if p.startswith(prefix)}
        if path and not under:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit.sha})
        dirs: set[str] = set()
        files: list[str] = []
        for p in under:
            rest = p[len(prefix) :].split("/")
            for depth in range(1, len(rest)):
                if recursive or depth == 1:
                    dirs.add(prefix + "/".join(rest[:depth]))
            if recursive or len(rest) == 1:
                files.append(p)
        items = [_folder_item(d, commit) for d in sorted(dirs)]
        return items + [_file_item(p, commit.files[p]) for p in sorted(files)]

    def _dispatch(
        self,
        method: str,
        path: str,
        query: dict[str, list[str]],
        headers: Mapping[str, str],
        body: bytes,
        upload: _Upload | None = None,
    ) -> _Response:
        try:
            user, role = self._authenticate(headers.get("Authorization"))
            allowed: list[str] = []
            for methods, pattern, handler in _ROUTES:
                m = pattern.fullmatch(path)
                if m is None:
                    continue
                if method not in methods:
                    allowed += methods
                    continue
                params = {k: unquote(v) for k, v in m.groupdict().items() if v is not None}
                req = _Request(method, path, query, headers, body, user, role, params, upload)
                with self._lock:
                    return handler(self, req)
            if allowed:
                raise HubError(405, f"Method {method} not allowed", headers={"Allow": ", ".join(allowed)})
            raise HubError(404, "Sorry, we can't find the page you are looking for.")
        except HubError as e:
            return e.response(head=method == "HEAD")
        except Exception as e:  # a bug in the fake must show up as a 500, as the real Hub would answer
            log.exception("fake hub: unhandled error on %s %s", method, path)
            return _json({"error": f"Internal Error: {type(e).__name__}"}, 500)


# ----------------------------------------------------------------------------------------------------------------------
# Small pure helpers
# ----------------------------------------------------------------------------------------------------------------------


def _ref_name(revision: str) -> str:
    return revision if revision.startswith("refs/") else f"refs/heads/{revision}"


def _clean_path(path: str) -> str:
    parts = path.strip().split("/")
    if not path.strip() or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] == ".git":
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path.strip()


def _walk(repo: Repo, sha: str | None) -> Iterable[Commit]:
    while sha is not None:
        commit = repo.commits[sha]
        yield commit
        sha = commit.parent


def _lfs_patterns(gitattributes: bytes) -> list[str]:
    patterns = []
    for line in gitattributes.decode("utf-8", "replace").splitlines():
        fields = line.split()
        if fields and not fields[0].startswith("#") and "filter=lfs" in fields[1:]:
            patterns.append(fields[0])
    return patterns


def _match_any(path: str, patterns: Iterable[str]) -> bool:
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


def _front_matter(text: str) -> dict[str, Any] | None:
    m = _FRONT_MATTER.match(text)
    if m is None:
        return None
    import yaml  # a dependency of huggingface_hub and of the converter; imported here to keep the server light

    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError("metadata must be a mapping")
    return data


def _derive_tags(card: Mapping[str, Any] | None, commit: Commit) -> list[str]:
    """The subset of the Hub's computed tags our tests can rely on (card tags, library, license, base_model)."""
    card = card or {}
    tags = list(card.get("tags") or []) if isinstance(card.get("tags"), list) else []
    if card.get("library_name"):
        tags.append(str(card["library_name"]))
    if any(p.endswith(".safetensors") for p in commit.files):
        tags.append("safetensors")
    bases = card.get("base_model")
    relation = card.get("base_model_relation")
    for base in [bases] if isinstance(bases, str) else bases or []:
        tags.append(f"base_model:{base}")
        if relation:
            tags.append(f"base_model:{relation}:{base}")
    if card.get("license"):
        tags.append(f"license:{card['license']}")
    return list(dict.fromkeys(str(t) for t in tags))


def _file_item(path: str, entry: FileEntry) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "file", "oid": entry.oid, "size": entry.size, "path": path}
    if entry.lfs:
        item["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": entry.pointer_size}
    return item


def _folder_item(path: str, commit: Commit) -> dict[str, Any]:
    listing = sorted((p, e.oid) for p, e in commit.files.items() if p.startswith(path + "/"))
    return {"type": "directory", "oid": hashlib.sha1(json.dumps(listing).encode()).hexdigest(), "size": 0, "path": path}


def _event(kind: str, author: str, data: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": hashlib.sha1(f"{kind}{author}{time.time_ns()}".encode()).hexdigest()[:24],
        "type": kind,
        "createdAt": _now(),
        "author": {"name": author, "type": "user"},
        "data": data,
    }


def _find_discussion(repo: Repo, num: int) -> dict[str, Any]:
    for discussion in repo.discussions:
        if discussion["num"] == num:
            return discussion
    raise HubError(404, f"Discussion {num} not found")


def _discussion_summary(repo: Repo, d: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "num": d["num"],
        "title": d["title"],
        "status": d["status"],
        "isPullRequest": d["isPullRequest"],
        "createdAt": d["createdAt"],
        "author": {"name": d["author"], "type": "user"},
        "repo": {"name": repo.repo_id, "type": repo.repo_type},
        "numComments": sum(e["type"] == "comment" for e in d["events"]),
        "pinned": False,
    }


def _paginate(hub: HubServer, req: _Request, items: list[Any], page_size: int) -> _Response:
    """Cursor pagination with a ``Link: <...>; rel="next"`` header, which the client follows."""
    start = int(req.q("cursor") or 0)
    headers = {}
    if start + page_size < len(items):
        query = {k: v[-1] for k, v in req.query.items() if k != "cursor"} | {"cursor": str(start + page_size)}
        qs = "&".join(f"{quote(k)}={quote(v)}" for k, v in query.items())
        headers["Link"] = f'<{hub.url}{req.path}?{qs}>; rel="next"'
    return _json(items[start : start + page_size], headers=headers)


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a single ``bytes=`` range, None to serve everything; 416 when unsatisfiable."""
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header or "")
    if m is None or m.groups() == ("", ""):
        return None
    first, last = m.groups()
    if first:
        start, end = int(first), min(int(last), size - 1) if last else size - 1
    else:
        start, end = max(0, size - int(last)), size - 1
    if start >= size or start > end:
        raise HubError(416, "Requested range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
    return start, end


# ----------------------------------------------------------------------------------------------------------------------
# Endpoint handlers: (hub, request) -> response, called under the hub lock
# ----------------------------------------------------------------------------------------------------------------------


def _h_whoami(hub: HubServer, req: _Request) -> _Response:
    if req.user is None:
        raise HubError(401, "Invalid username or password.")
    user = req.user
    return _json(
        {
            "type": "user",
            "id": hashlib.sha1(user.name.encode()).hexdigest()[:24],
            "name": user.name,
            "fullname": user.name.title(),
            "email": f"{user.name}@example.com",
            "emailVerified": True,
            "canPay": False,
            "isPro": False,
            "avatarUrl": f"/avatars/{user.name}.svg",
            "orgs": [{"type": "org", "name": org, "fullname": org, "roleInOrg": "write"} for org in sorted(user.orgs)],
            "auth": {
                "type": "access_token",
                "accessToken": {"displayName": "fake-hub", "role": req.role, "createdAt": "2026-01-01T00:00:00.000Z"},
            },
        }
    )


def _h_agent_harnesses(hub: HubServer, req: _Request) -> _Response:
    # The client wants the registry shape (a dict); anything else is swallowed as "no registry".
    return _json({"standardEnvVars": [], "harnesses": {}})


def _h_validate_yaml(hub: HubServer, req: _Request) -> _Response:
    content = req.json().get("content", "")
    try:
        data = _front_matter(content)
    except ValueError as e:
        return _json({"errors": [{"message": f"Invalid YAML metadata: {e}"}], "warnings": []}, 400)
    warnings = [] if data else [{"message": "empty or missing yaml metadata in repo card"}]
    return _json({"errors": [], "warnings": warnings})


def _h_create_repo(hub: HubServer, req: _Request) -> _Response:
    body = req.json()
    name, org = body.get("name"), body.get("organization")
    repo_type = body.get("type") or "model"
    if req.user is None:
        raise HubError(401, "You must be authenticated to create a repo")
    namespace = org or req.user.name
    if not hub._can_write(req.user, req.role, namespace):
        raise HubError(403, f"You don't have the rights to create a {repo_type} under the namespace {namespace!r}")
    visibility = body.get("visibility")
    private = visibility == "private" if visibility is not None else bool(body.get("private", False))
    sdk = body.get("sdk")
    if repo_type == "space" and sdk not in SPACE_SDKS:
        raise HubError(400, f"Invalid sdk {sdk!r}: a Space needs one of {', '.join(SPACE_SDKS)}")
    repo_id = f"{namespace}/{name}"
    existing = hub._repos.get((repo_type, repo_id))
    if existing is not None:
        return _json({"error": f"You already created this {repo_type} repo", "url": hub._repo_url(existing)}, 409)
    repo = hub._create(repo_id, repo_type, private=private, gated=False, sdk=sdk, author=req.user.name)
    return _json({"url": hub._repo_url(repo), "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]})


def _h_delete_repo(hub: HubServer, req: _Request) -> _Response:
    body = req.json()
    namespace = body.get("organization") or (req.user.name if req.user else "")
    req.params.update(repo=f"{namespace}/{body.get('name')}", type=f"{body.get('type') or 'model'}s")
    repo = hub._require_repo(req, write=True)
    del hub._repos[(repo.repo_type, repo.repo_id)]
    shutil.rmtree(hub._repo_dir(repo), ignore_errors=True)
    return _json({})


def _h_repo_info(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req)
    commit = repo.commits[hub._resolve(repo, req.params.get("rev", "main"))]
    info = hub._repo_info(repo, commit, blobs=req.flag("blobs"))
    expand = req.query.get("expand[]") or req.query.get("expand")
    if expand:
        info = {k: v for k, v in info.items() if k in ("_id", "id", *expand)}
    return _json(info)


def _h_tree(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req)
    commit = repo.commits[hub._resolve(repo, req.params["rev"])]
    items = hub._tree_items(commit, req.params.get("path", "").strip("/"), recursive=req.flag("recursive"))
    return _paginate(hub, req, items, hub.tree_page_size)


def _h_paths_info(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req)
    commit = repo.commits[hub._resolve(repo, req.params["rev"])]
    if "json" in req.headers.get("Content-Type", ""):
        paths = req.json().get("paths", [])
    else:
        paths = parse_qs(req.body.decode()).get("paths", [])
    items = []
    for path in paths:
        path = path.strip("/")
        if path in commit.files:
            items.append(_file_item(path, commit.files[path]))
        elif any(p.startswith(path + "/") for p in commit.files):
            items.append(_folder_item(path, commit))
    return _json(items)


def _h_refs(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req)

    def refs(prefix: str, strip: bool) -> list[dict[str, str]]:
        return [
            {"name": ref.removeprefix(prefix) if strip else ref, "ref": ref, "targetCommit": sha}
            for ref, sha in sorted(repo.refs.items())
            if ref.startswith(prefix)
        ]

    result: dict[str, Any] = {"branches": refs("refs/heads/", True), "converts": [], "tags": refs("refs/tags/", True)}
    if req.flag("include_prs"):
        result["pullRequests"] = refs("refs/pr/", False)
    return _json(result)


def _h_commits(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req)
    items = [
        {
            "id": c.sha,
            "title": c.title,
            "message": c.title + (f"\n\n{c.description}" if c.description else ""),
            "authors": [{"user": c.author, "avatar": f"/avatars/{c.author}.svg"}],
            "date": c.date,
        }
        for c in _walk(repo, hub._resolve(repo, req.params["rev"]))
    ]
    return _paginate(hub, req, items, _COMMITS_PAGE)


def _check_push(hub: HubServer, req: _Request, repo: Repo, revision: str, create_pr: bool) -> None:
    """Who may push: namespace writers; with create_pr, anyone who can read; on refs/pr/N, also the PR's author."""
    if req.user is None:
        raise HubError(401, "You must be authenticated to push")
    if create_pr:
        return
    pr_num = int(revision.rsplit("/", 1)[1]) if revision.startswith("refs/pr/") and revision in repo.refs else None
    if pr_num is not None and _find_discussion(repo, pr_num)["author"] == req.user.name:
        return
    hub._check_write(req, repo.namespace)


def _h_preupload(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req)
    revision = req.params["rev"]
    _check_push(hub, req, repo, _ref_name(revision), req.flag("create_pr"))
    base = repo.commits[hub._resolve(repo, revision)].files
    body = req.json()
    gitignore = body.get("gitIgnore")
    if gitignore is None and ".gitignore" in base:
        gitignore = hub._read_blob(base[".gitignore"].sha256).decode("utf-8", "replace")
    ignore = [ln.strip() for ln in (gitignore or "").splitlines() if ln.strip() and ln.strip()[0] not in "#!"]
    out = []
    for f in body.get("files", []):
        path, size = f["path"], int(f["size"])
        sample = base64.b64decode(f.get("sample", ""))
        existing = base.get(path)
        out.append(
            {
                "path": path,
                "uploadMode": "lfs" if hub._is_lfs(base, path, size, sample) else "regular",
                "shouldIgnore": _match_any(path, ignore),
                "oid": existing.etag if existing else None,
            }
        )
    return _json({"files": out, "commitOid": repo.refs.get(_ref_name(revision))})


def _h_commit(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req)
    revision, create_pr = req.params["rev"], req.flag("create_pr")
    ref = _ref_name(revision)
    _check_push(hub, req, repo, ref, create_pr)
    try:
        lines = [json.loads(line) for line in req.body.splitlines() if line.strip()]
    except ValueError as e:
        raise HubError(400, f"Invalid NDJSON payload: {e}") from None
    if not lines or lines[0].get("key") != "header":
        raise HubError(400, "The first line of a commit payload must be its header")
    header = lines[0]["value"]
    parent_commit = header.get("parentCommit")
    if ref not in repo.refs:
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
    head = repo.refs[ref]
    if parent_commit and create_pr:
        head = hub._resolve(repo, parent_commit)
    elif parent_commit and parent_commit != head:
        raise HubError(412, "A commit has happened since. Please refresh and try again.")
    files = dict(repo.commits[head].files)
    for op in lines[1:]:
        _apply_op(hub, files, op.get("key"), op.get("value") or {})
    author = req.user.name if req.user else repo.namespace
    commit = hub._commit(repo, head, files, header.get("summary") or "Update", header.get("description") or "", author)
    pr_url = None
    if create_pr:
        discussion = hub._open_discussion(repo, commit.title, commit.description, author, commit.sha)
        pr_url = f"{hub._repo_url(repo)}/discussions/{discussion['num']}"
    else:
        hub._move_ref(repo, ref, commit)
    hub._save_repo(repo)
    return _json(
        {
            "success": True,
            "commitOid": commit.sha,
            "commitUrl": f"{hub._repo_url(repo)}/commit/{commit.sha}",
            "pullRequestUrl": pr_url,
            "hookOutput": "",
        }
    )


def _apply_op(hub: HubServer, files: dict[str, FileEntry], key: str | None, value: Mapping[str, Any]) -> None:
    path = _clean_path(str(value.get("path", "")))
    if key == "file":
        if value.get("encoding", "base64") != "base64":
            raise HubError(400, f"Unsupported encoding for {path}")
        data = base64.b64decode(value.get("content", ""))
        if len(data) > MAX_REGULAR_FILE_SIZE:
            raise HubError(
                400,
                "Your push was rejected because it contains files larger than 10 MiB. Please use "
                f"https://git-lfs.github.com/ to store large files. Offending file: {path}",
            )
        files[path] = hub._store(data, lfs=False)
    elif key == "lfsFile":
        oid, size = str(value.get("oid", "")), value.get("size")
        if value.get("algo", "sha256") != "sha256" or not hub._has_blob(oid, size):
            raise HubError(400, f"LFS object {oid} for {path} was not uploaded (or has another size)")
        size = hub._blob_path(oid).stat().st_size
        files[path] = FileEntry(oid, size, True, git_blob_sha1(lfs_pointer(oid, size)))
    elif key == "deletedFile":
        if files.pop(path, None) is None:
            raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
    elif key == "deletedFolder":
        doomed = [p for p in files if p.startswith(path.rstrip("/") + "/")]
        if not doomed:
            raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
        for p in doomed:
            del files[p]
    else:
        raise HubError(400, f"Unknown commit operation {key!r}")


def _h_discussions(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req)
    kind, status, author = req.q("type", "all"), req.q("status", "all"), req.q("author")
    selected = [
        d
        for d in reversed(repo.discussions)
        if (kind == "all" or d["isPullRequest"] == (kind == "pull_request"))
        and (status == "all" or d["status"] == status)
        and (author is None or d["author"] == author)
    ]
    start = int(req.q("p") or 0) * _DISCUSSIONS_PAGE
    page = [_discussion_summary(repo, d) for d in selected[start : start + _DISCUSSIONS_PAGE]]
    return _json({"discussions": page, "count": len(selected), "start": start})


def _h_discussion(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req)
    d = _find_discussion(repo, int(req.params["num"]))
    details = _discussion_summary(repo, d) | {"events": d["events"], "diff": None, "locked": False}
    if d["isPullRequest"]:
        details |= {"changes": {"base": "refs/heads/main"}, "filesWithConflicts": []}
    return _json(details)


def _h_create_discussion(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req)
    if req.user is None:
        raise HubError(401, "You must be authenticated to open a discussion")
    body = req.json()
    title = str(body.get("title", "")).strip()
    if not 3 <= len(title) <= 200:
        raise HubError(400, "Title must be between 3 and 200 characters")
    pr_head = repo.refs["refs/heads/main"] if body.get("pullRequest") else None
    d = hub._open_discussion(repo, title, str(body.get("description", "")), req.user.name, pr_head)
    if pr_head is not None:
        d["status"] = "draft"  # PRs opened without changes are drafts on the Hub
    hub._save_repo(repo)
    return _json({"num": d["num"], "pullRequest": d["isPullRequest"]})


def _h_lfs_batch(hub: HubServer, req: _Request) -> _Response:
    hub._require_repo(req)  # read access is enough: blobs are content-addressed, the commit is what gets authorized
    if req.user is None:
        raise HubError(401, "You must be authenticated to upload LFS objects")
    body = req.json()
    if body.get("operation") != "upload":
        raise HubError(400, "Only the upload operation is served by this fake Hub")
    objects = []
    for obj in body.get("objects", []):
        oid, size = str(obj.get("oid", "")), obj.get("size")
        if not re.fullmatch(r"[0-9a-f]{64}", oid) or not isinstance(size, int) or size < 0:
            objects.append({"oid": oid, "size": size, "error": {"code": 422, "message": "Invalid object"}})
        elif hub._has_blob(oid, size):
            objects.append({"oid": oid, "size": size})  # no actions: the client skips the upload
        else:
            hub._pending_lfs[oid] = size
            actions = {"upload": {"href": f"{hub.url}/_lfs/{oid}"}, "verify": {"href": f"{hub.url}/_lfs/{oid}/verify"}}
            objects.append({"oid": oid, "size": size, "authenticated": True, "actions": actions})
    return _json({"transfer": "basic", "objects": objects}, headers={"Content-Type": "application/vnd.git-lfs+json"})


def _h_lfs_put(hub: HubServer, req: _Request) -> _Response:
    oid, upload = req.params["oid"], req.upload
    received = upload.size if upload else len(req.body)
    size = hub._pending_lfs.get(oid)
    if size is None and hub._has_blob(oid, received):
        size = received  # one object under two paths of a commit: the client uploads it twice, like S3 allows
    if size is None:
        raise HubError(403, "No upload was requested for this object")
    digest = upload.sha256 if upload else hashlib.sha256(req.body).hexdigest()
    if received != size or digest != oid:
        raise HubError(400, "Uploaded content does not match the announced oid/size")
    if upload is None:
        hub._put_blob(req.body)
    elif not hub._has_blob(oid, size):
        hub._blob_path(oid).parent.mkdir(parents=True, exist_ok=True)
        os.replace(upload.path, hub._blob_path(oid))
    hub._pending_lfs.pop(oid, None)
    return _Response(200)


def _h_lfs_verify(hub: HubServer, req: _Request) -> _Response:
    if req.user is None:
        raise HubError(401, "You must be authenticated to verify LFS objects")
    body = req.json()
    if body.get("oid") != req.params["oid"] or not hub._has_blob(req.params["oid"], body.get("size")):
        raise HubError(404, "Object not found")
    return _json({})


def _h_resolve(hub: HubServer, req: _Request) -> _Response:
    repo = hub._require_repo(req, content=True)
    sha = hub._resolve(repo, req.params["rev"])
    entry = repo.commits[sha].files.get(req.params["path"])
    if entry is None:
        raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": sha})
    headers = {
        "X-Repo-Commit": sha,
        "ETag": f'"{entry.etag}"',
        "X-Linked-Etag": f'"{entry.etag}"',
        "X-Linked-Size": str(entry.size),
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
    }
    try:
        span = _parse_range(req.headers.get("Range"), entry.size)
    except HubError as e:
        e.headers.update(headers)
        raise
    start, end, status = (0, entry.size - 1, 200) if span is None else (*span, 206)
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
    headers["Content-Length"] = str(end - start + 1)
    if req.method == "HEAD":
        return _Response(status, b"", headers)
    return _Response(status, b"", headers, file=(hub._blob_path(entry.sha256), start, end - start + 1))


_T = r"/api/(?P<type>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)"
_P = r"/(?P<prefix>datasets/|spaces/)?(?P<repo>[^/]+/[^/]+?)"
_HandlerFn = Callable[[HubServer, _Request], _Response]
_ROUTES: list[tuple[tuple[str, ...], re.Pattern[str], _HandlerFn]] = [
    (methods, re.compile(pattern), handler)
    for methods, pattern, handler in [
        (("GET",), r"/api/whoami-v2", _h_whoami),
        (("GET",), r"/api/agent-harnesses", _h_agent_harnesses),
        (("POST",), r"/api/validate-yaml", _h_validate_yaml),
        (("POST",), r"/api/repos/create", _h_create_repo),
        (("DELETE", "POST"), r"/api/repos/delete", _h_delete_repo),
        (("GET",), _T, _h_repo_info),
        (("GET",), _T + r"/revision/(?P<rev>[^/]+)", _h_repo_info),
        (("GET",), _T + r"/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", _h_tree),
        (("POST",), _T + r"/paths-info/(?P<rev>[^/]+)", _h_paths_info),
        (("GET",), _T + r"/refs", _h_refs),
        (("GET",), _T + r"/commits/(?P<rev>[^/]+)", _h_commits),
        (("POST",), _T + r"/preupload/(?P<rev>[^/]+)", _h_preupload),
        (("POST",), _T + r"/commit/(?P<rev>[^/]+)", _h_commit),
        (("GET",), _T + r"/discussions", _h_discussions),
        (("POST",), _T + r"/discussions", _h_create_discussion),
        (("GET",), _T + r"/discussions/(?P<num>\d+)", _h_discussion),
        (("PUT",), r"/_lfs/(?P<oid>[0-9a-f]{64})", _h_lfs_put),
        (("POST",), r"/_lfs/(?P<oid>[0-9a-f]{64})/verify", _h_lfs_verify),
        (("POST",), _P + r"\.git/info/lfs/objects/batch", _h_lfs_batch),
        (("GET", "HEAD"), _P + r"/resolve/(?P<rev>[^/]+)/(?P<path>.+)", _h_resolve),
    ]
]


# ----------------------------------------------------------------------------------------------------------------------
# HTTP plumbing
# ----------------------------------------------------------------------------------------------------------------------


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], hub: HubServer) -> None:
        super().__init__(address, handler)
        self.hub = hub

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hanging up (e.g. after a dropped-connection fault) are expected; keep stderr clean.
        log.debug("fake hub: connection error from %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "converter-fake-hub/1.0"
    timeout = 60  # idle keep-alive connections close after this

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def log_message(self, format: str, *args: Any) -> None:
        # Only the request line / status, never headers: tokens travel in Authorization.
        log.debug("fake hub: %s", format % args)

    def _read_body(self) -> bytes:
        up: Link = self.server.hub.up  # type: ignore[attr-defined]
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                up.take(size)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        up.take(length)
        return self.rfile.read(length)

    def _receive_upload(self, hub: HubServer) -> _Upload:
        """An LFS upload body, streamed to a file under the hub's root and hashed on the way (through the link)."""
        length = int(self.headers.get("Content-Length") or 0)
        folder = hub.root / "uploads"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{threading.get_ident()}-{time.monotonic_ns()}"
        h, left = hashlib.sha256(), length
        with open(path, "wb") as f:
            while left:
                n = min(left, _STREAM_CHUNK)
                hub.up.take(n)
                chunk = self.rfile.read(n)
                if not chunk:
                    break
                h.update(chunk)
                f.write(chunk)
                left -= len(chunk)
        return _Upload(path, h.hexdigest(), length - left)

    def _handle(self) -> None:
        hub: HubServer = self.server.hub  # type: ignore[attr-defined]
        split = urlsplit(self.path)
        method = self.command
        upload = None
        if (
            method == "PUT"
            and split.path.startswith("/_lfs/")
            and "chunked" not in self.headers.get("Transfer-Encoding", "")
        ):
            upload, body = self._receive_upload(hub), b""
        else:
            body = self._read_body()
        try:
            hub.requests.append((method, split.path))
            fault = hub._take_fault(method, split.path)
            if fault is not None and fault.delay:
                time.sleep(fault.delay)
            if fault is not None and fault.status is not None:
                headers = {} if fault.retry_after is None else {"Retry-After": _retry_after(fault.retry_after)}
                response = HubError(fault.status, f"Injected fault: HTTP {fault.status}", headers=headers).response(
                    head=method == "HEAD"
                )
            else:
                query = parse_qs(split.query, keep_blank_values=True)
                response = hub._dispatch(method, split.path, query, self.headers, body, upload)
        finally:
            if upload is not None:
                upload.path.unlink(missing_ok=True)
        response.headers["X-Request-Id"] = f"fake-{next(hub._request_ids)}"
        auth = "Authorization" in self.headers
        record = Seen(method, split.path, split.query, response.status, self.headers.get("Range"), auth, bool(fault))
        hub.seen.append(record)
        if fault is not None and fault.drop_connection:
            self._write(response, method, drop=True)
        else:
            self._write(response, method)

    def _write(self, response: _Response, method: str, drop: bool = False) -> None:
        body = b"" if method == "HEAD" else response.body
        size = response.file[2] if response.file and method != "HEAD" else len(body)
        if drop and not size:
            self._hang_up()  # nothing to cut in half: drop before any byte
            return
        self.send_response(response.status)
        response.headers.setdefault("Content-Length", str(len(response.body)))
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.end_headers()
        limit = max(1, size // 2) if drop else size
        if response.file and method != "HEAD":
            self._send_file(*response.file, limit)
        else:
            self.server.hub.down.take(limit)  # type: ignore[attr-defined]
            self.wfile.write(body[:limit])
        if drop:
            self._hang_up()

    def _send_file(self, path: Path, start: int, length: int, limit: int) -> None:
        """A blob range, in chunks through the down link (never read whole; the hub lock is not held)."""
        down: Link = self.server.hub.down  # type: ignore[attr-defined]
        with open(path, "rb") as f:
            f.seek(start)
            left = min(length, limit)
            while left:
                chunk = f.read(min(left, _STREAM_CHUNK))
                if not chunk:
                    return
                down.take(len(chunk))
                self.wfile.write(chunk)
                left -= len(chunk)

    def _hang_up(self) -> None:
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _retry_after(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else str(seconds)


# ----------------------------------------------------------------------------------------------------------------------
# Running the real client against the server
# ----------------------------------------------------------------------------------------------------------------------


def hub_env(server: HubServer, token: str | None = None, home: Path | str | None = None) -> dict[str, str]:
    """Env vars that point ``huggingface_hub`` at ``server``; set them before it is imported (it reads them then).

    ``home`` (HF_HOME: cache, token file) defaults to ``<root>/_client_home``, shared by all clients of the server
    so a second download can hit the cache. Offline switches are forced off (the repo's conftest turns them on).
    """
    env = {
        "HF_ENDPOINT": server.url,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "HF_HOME": str(home if home is not None else server.root / "_client_home"),
    }
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def client_env(
    server: HubServer,
    token: str | None = None,
    home: Path | str | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A full subprocess environment: ``base`` (default os.environ) without any HF_* / HUGGING* variable (a
    developer's real token or cache must not leak in), plus ``hub_env``."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith(("HF_", "HUGGING_FACE_", "HUGGINGFACE_")) and k != "TRANSFORMERS_OFFLINE"
    }
    return env | hub_env(server, token, home)


def run_client(
    server: HubServer,
    code: str,
    *,
    token: str | None = None,
    home: Path | str | None = None,
    timeout: float = 120.0,
    check: bool = True,
    cwd: Path | str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with ``python -c`` against ``server``; with ``check``, a non-zero exit raises AssertionError
    carrying the (token-redacted) output."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=client_env(server, token, home),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    if check and proc.returncode != 0:
        out = server.redact(f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        raise AssertionError(f"client exited with {proc.returncode}\n{out}")
    return proc


def main(argv: list[str] | None = None) -> None:
    """`python -m converter.testing.hub --root DIR [--user NAME:TOKEN] [--down MB/s] [--up MB/s]`: serve until
    killed, printing the endpoint URL on the first line (benchmarks run it as a process of its own)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m converter.testing.hub", description=main.__doc__)
    p.add_argument("--root", required=True, help="folder holding the repos (kept across restarts)")
    p.add_argument("--user", action="append", default=[], help="NAME:TOKEN, a user with a write token")
    p.add_argument("--down", type=float, help="server-to-client bandwidth, MB/s (10^6 bytes)")
    p.add_argument("--up", type=float, help="client-to-server bandwidth, MB/s")
    args = p.parse_args(argv)
    rate = lambda mb: mb * 1e6 if mb else None  # noqa: E731
    server = HubServer(args.root, down_rate=rate(args.down), up_rate=rate(args.up)).start()
    for user in args.user:
        name, token = user.split(":", 1)
        server.add_user(name, token)
    print(server.url, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
