"""Files of a revision: the tree listing, paths-info, and downloads (``resolve``) with Range, ETag and the commit
headers the client caches by. Bodies stream from the blob store after the hub lock is released.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from converter.testing.hub.model import Commit, FileEntry
from converter.testing.hub.repos import REPO_API, REPO_WEB
from converter.testing.hub.wire import HubError, Request, Response, json_response, paginate

if TYPE_CHECKING:
    from converter.testing.hub.server import HubServer


def list_tree(hub: HubServer, req: Request) -> Response:
    repo = hub._require_repo(req)
    commit = repo.commits[hub._resolve(repo, req.params["rev"])]
    items = tree_items(hub, commit, req.params.get("path", "").strip("/"), recursive=req.flag("recursive"))
    return paginate(hub.url, req, items, hub.tree_page_size)


def paths_info(hub: HubServer, req: Request) -> Response:
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
            items.append(file_item(path, commit.files[path]))
        elif any(p.startswith(path + "/") for p in commit.files):
            items.append(folder_item(path, commit))
    return json_response(items)


def resolve_file(hub: HubServer, req: Request) -> Response:
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
        span = parse_range(req.headers.get("Range"), entry.size)
    except HubError as e:
        e.headers.update(headers)
        raise
    start, end, status = (0, entry.size - 1, 200) if span is None else (*span, 206)
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
    headers["Content-Length"] = str(end - start + 1)
    if req.method == "HEAD":
        return Response(status, b"", headers)
    return Response(status, b"", headers, file=(hub._blob_path(entry.sha256), start, end - start + 1))


def tree_items(hub: HubServer, commit: Commit, path: str, recursive: bool) -> list[dict[str, Any]]:
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
    items = [folder_item(d, commit) for d in sorted(dirs)]
    return items + [file_item(p, commit.files[p]) for p in sorted(files)]


def file_item(path: str, entry: FileEntry) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "file", "oid": entry.oid, "size": entry.size, "path": path}
    if entry.lfs:
        item["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": entry.pointer_size}
    return item


def folder_item(path: str, commit: Commit) -> dict[str, Any]:
    listing = sorted((p, e.oid) for p, e in commit.files.items() if p.startswith(path + "/"))
    return {"type": "directory", "oid": hashlib.sha1(json.dumps(listing).encode()).hexdigest(), "size": 0, "path": path}


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
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


ROUTES = [
    (("GET",), REPO_API + r"/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", list_tree),
    (("POST",), REPO_API + r"/paths-info/(?P<rev>[^/]+)", paths_info),
    (("GET", "HEAD"), REPO_WEB + r"/resolve/(?P<rev>[^/]+)/(?P<path>.+)", resolve_file),
]
