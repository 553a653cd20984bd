"""Repos as the client sees them: create, delete, info (with the summaries the Hub computes from a card, a config
and safetensors headers), refs, and the small account-level routes the client calls on the way.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from converter.testing.hub.model import SPACE_SDKS, Commit, Repo, object_id
from converter.testing.hub.wire import HubError, Request, Response, json_response

if TYPE_CHECKING:
    from converter.testing.hub.server import HubServer

#: A repo's API path: /api/{models,datasets,spaces}/{namespace}/{name}
REPO_API = r"/api/(?P<type>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)"
#: A repo's web path (downloads, LFS): /{,datasets/,spaces/}{namespace}/{name}
REPO_WEB = r"/(?P<prefix>datasets/|spaces/)?(?P<repo>[^/]+/[^/]+?)"

_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)


def agent_harnesses(hub: HubServer, req: Request) -> Response:
    # The client wants the registry shape (a dict); anything else is swallowed as "no registry".
    return json_response({"standardEnvVars": [], "harnesses": {}})


def validate_yaml(hub: HubServer, req: Request) -> Response:
    content = req.json().get("content", "")
    try:
        data = front_matter(content)
    except ValueError as e:
        return json_response({"errors": [{"message": f"Invalid YAML metadata: {e}"}], "warnings": []}, 400)
    warnings = [] if data else [{"message": "empty or missing yaml metadata in repo card"}]
    return json_response({"errors": [], "warnings": warnings})


def create_repo(hub: HubServer, req: Request) -> Response:
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
        return json_response(
            {"error": f"You already created this {repo_type} repo", "url": hub._repo_url(existing)}, 409
        )
    repo = hub._create(repo_id, repo_type, private=private, gated=False, sdk=sdk, author=req.user.name)
    return json_response({"url": hub._repo_url(repo), "name": repo_id, "id": object_id(repo_id)})


def delete_repo(hub: HubServer, req: Request) -> Response:
    body = req.json()
    namespace = body.get("organization") or (req.user.name if req.user else "")
    req.params.update(repo=f"{namespace}/{body.get('name')}", type=f"{body.get('type') or 'model'}s")
    repo = hub._require_repo(req, write=True)
    del hub._repos[(repo.repo_type, repo.repo_id)]
    shutil.rmtree(hub._repo_dir(repo), ignore_errors=True)
    return json_response({})


def repo_info(hub: HubServer, req: Request) -> Response:
    repo = hub._require_repo(req)
    commit = repo.commits[hub._resolve(repo, req.params.get("rev", "main"))]
    info = repo_info_json(hub, repo, commit, blobs=req.flag("blobs"))
    expand = req.query.get("expand[]") or req.query.get("expand")
    if expand:
        info = {k: v for k, v in info.items() if k in ("_id", "id", *expand)}
    return json_response(info)


def list_refs(hub: HubServer, req: Request) -> Response:
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
    return json_response(result)


def repo_info_json(hub: HubServer, repo: Repo, commit: Commit, blobs: bool) -> dict[str, Any]:
    siblings = []
    for path, entry in sorted(commit.files.items()):
        sibling: dict[str, Any] = {"rfilename": path}
        if blobs:
            sibling.update(size=entry.size, blobId=entry.oid)
            if entry.lfs:
                sibling["lfs"] = {"size": entry.size, "sha256": entry.sha256, "pointerSize": entry.pointer_size}
        siblings.append(sibling)
    card = card_data(hub, commit)
    info: dict[str, Any] = {
        "_id": object_id(repo.repo_id),
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
        "tags": derive_tags(card, commit),
        "siblings": siblings,
        "usedStorage": sum(e.size for e in commit.files.values()),
    }
    if card is not None:
        info["cardData"] = card
    if repo.repo_type == "model":
        info["modelId"] = repo.repo_id
        info["library_name"] = (card or {}).get("library_name")
        info["pipeline_tag"] = (card or {}).get("pipeline_tag")
        info["config"] = config_summary(hub, commit)
        info["safetensors"] = safetensors_summary(hub, commit)
        info["spaces"] = []
    elif repo.repo_type == "space":
        info["sdk"] = repo.sdk
    return info


def card_data(hub: HubServer, commit: Commit) -> dict[str, Any] | None:
    entry = commit.files.get("README.md")
    if entry is None:
        return None
    try:
        return front_matter(hub._read_blob(entry.sha256).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def config_summary(hub: HubServer, commit: Commit) -> dict[str, Any] | None:
    entry = commit.files.get("config.json")
    try:
        config = json.loads(hub._read_blob(entry.sha256)) if entry else None
    except ValueError:
        return None
    if not isinstance(config, dict):
        return None
    return {k: config[k] for k in ("architectures", "model_type") if k in config}


def safetensors_summary(hub: HubServer, commit: Commit) -> dict[str, Any] | None:
    """Parameter counts per dtype from the safetensors headers, like the Hub's ``safetensors`` field."""
    params: dict[str, int] = {}
    for path, entry in commit.files.items():
        if not path.endswith(".safetensors") or entry.size < 8:
            continue
        (n,) = struct.unpack("<Q", hub._read_blob(entry.sha256, 0, 8))
        if n > entry.size - 8:
            continue  # not a safetensors file after all: the Hub leaves it out of the summary
        try:
            header = json.loads(hub._read_blob(entry.sha256, 8, n))
            counts = {name: (t["dtype"], math.prod(t["shape"])) for name, t in header.items() if name != "__metadata__"}
        except (ValueError, AttributeError, KeyError, TypeError):
            continue
        for dtype, count in counts.values():
            params[dtype] = params.get(dtype, 0) + count
    return {"parameters": params, "total": sum(params.values())} if params else None


def front_matter(text: str) -> dict[str, Any] | None:
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


def derive_tags(card: Mapping[str, Any] | None, commit: Commit) -> list[str]:
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


ROUTES = [
    (("GET",), r"/api/agent-harnesses", agent_harnesses),
    (("POST",), r"/api/validate-yaml", validate_yaml),
    (("POST",), r"/api/repos/create", create_repo),
    (("DELETE", "POST"), r"/api/repos/delete", delete_repo),
    (("GET",), REPO_API, repo_info),
    (("GET",), REPO_API + r"/revision/(?P<rev>[^/]+)", repo_info),
    (("GET",), REPO_API + r"/refs", list_refs),
]
