"""Repos on disk: the seeding and inspection API (no HTTP), the blob store and commit graph, and the Hub's rules on
who sees which repo (private, gated) and which files go to LFS.

Blobs are content-addressed under ``root/blobs``, each repo's refs and commits are JSON under ``root/repos``, so a
server constructed on the same folder again reloads its repos ("a restarted Hub").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from converter.testing.hub.model import (
    DEFAULT_GITATTRIBUTES,
    LFS_SUFFIXES,
    MAX_REGULAR_FILE_SIZE,
    REPO_TYPES,
    URL_PREFIX,
    Commit,
    FileEntry,
    Repo,
    User,
    clean_path,
    event,
    find_discussion,
    git_blob_sha1,
    lfs_patterns,
    lfs_pointer,
    match_any,
    now,
    ref_name,
    walk,
)
from converter.testing.hub.users import UsersMixin
from converter.testing.hub.wire import HubError, Request


class RepoStore(UsersMixin):
    """The server's repos, blobs and their rules (part of HubServer)."""

    root: Path
    _httpd: object | None
    url: str  # the server's endpoint (HubServer.url)
    _repos: dict[tuple[str, str], Repo]

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
            ref = ref_name(revision)
            if ref not in repo.refs:
                if not ref.startswith("refs/heads/"):
                    raise KeyError(f"no ref {ref} in {repo_id}")
                repo.refs[ref] = repo.refs["refs/heads/main"]
            parent = repo.commits[repo.refs[ref]]
            tree = dict(parent.files)
            for path in delete:
                tree.pop(clean_path(path))
            for path, content in files.items():
                path = clean_path(path)
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
            return list(walk(repo, self._resolve(repo, revision)))

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
        return f"{base}/{URL_PREFIX[repo.repo_type]}{repo.repo_id}"

    def _require_repo(self, req: Request, *, write: bool = False, content: bool = False) -> Repo:
        """The repo of the request, with the Hub's visibility (private -> not found), gate and write rules."""
        repo = self._readable_repo(req.repo_type, req.repo_id, req.user, content=content)
        if write:
            self._check_write(req, repo.namespace)
        return repo

    def _readable_repo(self, repo_type: str, repo_id: str, user: User | None, *, content: bool) -> Repo:
        """A repo ``user`` may see (private: members only, else not found) and, with ``content``, read (gated)."""
        repo = self._repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not self._is_member(user, repo.namespace)):
            raise HubError(401 if user is None else 404, "Repository not found", "RepoNotFound")
        if content and repo.gated and not self._passes_gate(repo, user):
            msg = f"Access to {repo.repo_type} {repo.repo_id} is restricted. You must have access to it."
            raise HubError(401 if user is None else 403, msg, "GatedRepo")
        return repo

    def _passes_gate(self, repo: Repo, user: User | None) -> bool:
        return user is not None and (self._is_member(user, repo.namespace) or user.name in repo.granted)

    def _resolve(self, repo: Repo, revision: str) -> str:
        ref = ref_name(revision)
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
        patterns = lfs_patterns(self._read_blob(attrs.sha256)) if attrs else []
        return match_any(path, patterns)

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
        repo = Repo(repo_id, repo_type, private, "auto" if gated is True else gated, sdk, now())
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
        date = now()
        tree = {p: e.oid for p, e in sorted(files.items())}
        payload = json.dumps([parent, tree, title, description, author, date], sort_keys=True).encode()
        commit = Commit(hashlib.sha1(payload).hexdigest(), parent, title, description, author, date, files)
        repo.commits[commit.sha] = commit
        self._save_commit(repo, commit)
        return commit

    def _move_ref(self, repo: Repo, ref: str, commit: Commit) -> None:
        repo.refs[ref] = commit.sha
        if ref.startswith("refs/pr/"):
            discussion = find_discussion(repo, int(ref.rsplit("/", 1)[1]))
            discussion["events"].append(event("commit", commit.author, {"subject": commit.title, "oid": commit.sha}))
