"""LFS uploads: the batch API answers where to PUT each object (or nothing when the blob is already stored), the
PUT lands in the blob store after its sha256 and size are checked, and verify confirms it.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import TYPE_CHECKING

from converter.testing.hub.repos import REPO_WEB
from converter.testing.hub.wire import HubError, Request, Response, json_response

if TYPE_CHECKING:
    from converter.testing.hub.server import HubServer


def lfs_batch(hub: HubServer, req: Request) -> Response:
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
    return json_response(
        {"transfer": "basic", "objects": objects}, headers={"Content-Type": "application/vnd.git-lfs+json"}
    )


def lfs_put(hub: HubServer, req: Request) -> Response:
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
    return Response(200)


def lfs_verify(hub: HubServer, req: Request) -> Response:
    if req.user is None:
        raise HubError(401, "You must be authenticated to verify LFS objects")
    body = req.json()
    if body.get("oid") != req.params["oid"] or not hub._has_blob(req.params["oid"], body.get("size")):
        raise HubError(404, "Object not found")
    return json_response({})


ROUTES = [
    (("PUT",), r"/_lfs/(?P<oid>[0-9a-f]{64})", lfs_put),
    (("POST",), r"/_lfs/(?P<oid>[0-9a-f]{64})/verify", lfs_verify),
    (("POST",), REPO_WEB + r"\.git/info/lfs/objects/batch", lfs_batch),
]
