"""Commits and pull requests: history, preupload (LFS or not), the NDJSON commit with its parent check, and
discussions, where a PR is a discussion with a ``refs/pr/N``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from converter.testing.hub.model import (
    MAX_REGULAR_FILE_SIZE,
    FileEntry,
    Repo,
    clean_path,
    event,
    find_discussion,
    git_blob_sha1,
    lfs_pointer,
    match_any,
    now,
    ref_name,
    walk,
)
from converter.testing.hub.repos import REPO_API
from converter.testing.hub.wire import HubError, Request, Response, json_response, paginate

if TYPE_CHECKING:
    from converter.testing.hub.server import HubServer

_DISCUSSIONS_PAGE = 50
_COMMITS_PAGE = 100


def list_commits(hub: HubServer, req: Request) -> Response:
    repo = hub._require_repo(req)
    items = [
        {
            "id": c.sha,
            "title": c.title,
            "message": c.title + (f"\n\n{c.description}" if c.description else ""),
            "authors": [{"user": c.author, "avatar": f"/avatars/{c.author}.svg"}],
            "date": c.date,
        }
        for c in walk(repo, hub._resolve(repo, req.params["rev"]))
    ]
    return paginate(hub.url, req, items, _COMMITS_PAGE)


def check_push(hub: HubServer, req: Request, repo: Repo, revision: str, create_pr: bool) -> None:
    """Who may push: namespace writers; with create_pr, anyone who can read; on refs/pr/N, also the PR's author."""
    if req.user is None:
        raise HubError(401, "You must be authenticated to push")
    if create_pr:
        return
    pr_num = int(revision.rsplit("/", 1)[1]) if revision.startswith("refs/pr/") and revision in repo.refs else None
    if pr_num is not None and find_discussion(repo, pr_num)["author"] == req.user.name:
        return
    hub._check_write(req, repo.namespace)


def preupload(hub: HubServer, req: Request) -> Response:
    repo = hub._require_repo(req)
    revision = req.params["rev"]
    check_push(hub, req, repo, ref_name(revision), req.flag("create_pr"))
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
                "shouldIgnore": match_any(path, ignore),
                "oid": existing.etag if existing else None,
            }
        )
    return json_response({"files": out, "commitOid": repo.refs.get(ref_name(revision))})


def create_commit(hub: HubServer, req: Request) -> Response:
    repo = hub._require_repo(req)
    revision, create_pr = req.params["rev"], req.flag("create_pr")
    ref = ref_name(revision)
    check_push(hub, req, repo, ref, create_pr)
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
        apply_op(hub, files, op.get("key"), op.get("value") or {})
    author = req.user.name if req.user else repo.namespace
    commit = hub._commit(repo, head, files, header.get("summary") or "Update", header.get("description") or "", author)
    pr_url = None
    if create_pr:
        discussion = open_discussion(hub, repo, commit.title, commit.description, author, commit.sha)
        pr_url = f"{hub._repo_url(repo)}/discussions/{discussion['num']}"
    else:
        hub._move_ref(repo, ref, commit)
    hub._save_repo(repo)
    return json_response(
        {
            "success": True,
            "commitOid": commit.sha,
            "commitUrl": f"{hub._repo_url(repo)}/commit/{commit.sha}",
            "pullRequestUrl": pr_url,
            "hookOutput": "",
        }
    )


def apply_op(hub: HubServer, files: dict[str, FileEntry], key: str | None, value: Mapping[str, Any]) -> None:
    path = clean_path(str(value.get("path", "")))
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


def list_discussions(hub: HubServer, req: Request) -> Response:
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
    page = [discussion_summary(repo, d) for d in selected[start : start + _DISCUSSIONS_PAGE]]
    return json_response({"discussions": page, "count": len(selected), "start": start})


def get_discussion(hub: HubServer, req: Request) -> Response:
    repo = hub._require_repo(req)
    d = find_discussion(repo, int(req.params["num"]))
    details = discussion_summary(repo, d) | {"events": d["events"], "diff": None, "locked": False}
    if d["isPullRequest"]:
        details |= {"changes": {"base": "refs/heads/main"}, "filesWithConflicts": []}
    return json_response(details)


def create_discussion(hub: HubServer, req: Request) -> Response:
    repo = hub._require_repo(req)
    if req.user is None:
        raise HubError(401, "You must be authenticated to open a discussion")
    body = req.json()
    title = str(body.get("title", "")).strip()
    if not 3 <= len(title) <= 200:
        raise HubError(400, "Title must be between 3 and 200 characters")
    pr_head = repo.refs["refs/heads/main"] if body.get("pullRequest") else None
    d = open_discussion(hub, repo, title, str(body.get("description", "")), req.user.name, pr_head)
    if pr_head is not None:
        d["status"] = "draft"  # PRs opened without changes are drafts on the Hub
    hub._save_repo(repo)
    return json_response({"num": d["num"], "pullRequest": d["isPullRequest"]})


def open_discussion(hub: HubServer, repo: Repo, title: str, description: str, author: str, pr_head: str | None) -> dict:
    num = len(repo.discussions) + 1
    discussion = {
        "num": num,
        "title": title,
        "status": "open",
        "isPullRequest": pr_head is not None,
        "createdAt": now(),
        "author": author,
        "events": [event("comment", author, {"edited": False, "hidden": False, "latest": {"raw": description}})],
    }
    repo.discussions.append(discussion)
    if pr_head is not None:
        repo.refs[f"refs/pr/{num}"] = pr_head
        discussion["events"].append(event("commit", author, {"subject": repo.commits[pr_head].title, "oid": pr_head}))
    return discussion


def discussion_summary(repo: Repo, d: Mapping[str, Any]) -> dict[str, Any]:
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


ROUTES = [
    (("GET",), REPO_API + r"/commits/(?P<rev>[^/]+)", list_commits),
    (("POST",), REPO_API + r"/preupload/(?P<rev>[^/]+)", preupload),
    (("POST",), REPO_API + r"/commit/(?P<rev>[^/]+)", create_commit),
    (("GET",), REPO_API + r"/discussions", list_discussions),
    (("POST",), REPO_API + r"/discussions", create_discussion),
    (("GET",), REPO_API + r"/discussions/(?P<num>\d+)", get_discussion),
]
