"""The Jobs API of the local Hub: run, inspect, list (by stage and labels), logs as server-sent events, cancel,
relabel, rerun, and the hardware list, with the Hub's rules on namespaces and on who can pay.

Served only by a server built with ``jobs=True``: a job runs any command it is given, as the server's user.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from converter.testing.hub.client import client_env
from converter.testing.hub.hardware import FLAVORS, HARDWARE
from converter.testing.hub.local_job import TERMINAL, JobSpec, LocalJob, Volume, remove_tree
from converter.testing.hub.model import REPO_TYPES, User
from converter.testing.hub.wire import HubError, Request, Response, json_response, paginate

if TYPE_CHECKING:
    from converter.testing.hub.server import HubServer

#: The Hub's default when a spec has no timeout: 30 minutes.
DEFAULT_TIMEOUT = 30 * 60
_LABEL_KEY = re.compile(r"[A-Za-z0-9_-]{1,100}")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9._-]{0,100}")
_JOBS_PAGE = 50
_STAGES = ("SCHEDULING", "RUNNING", *TERMINAL)
NO_CREDITS = (
    "Jobs are only available to PRO users and to organizations with credits: {namespace!r} can't pay for this job. "
    "Upgrade to PRO, or run it under an organization that has pre-paid credits."
)


class JobsMixin:
    """The server's jobs (part of HubServer): kept in memory only, killed and removed when the server stops."""

    root: Path
    jobs_enabled: bool
    _lock: threading.RLock
    _jobs: dict[str, LocalJob]

    def job(self, job_id: str) -> LocalJob:
        """A job by id: its ``stage``, ``pid``, ``returncode``, log ``lines``, ``volume_folder(mount_path)``."""
        with self._lock:
            return self._jobs[job_id]

    def jobs(self) -> list[LocalJob]:
        """Every job the server has run or is running, oldest first."""
        with self._lock:
            return list(self._jobs.values())

    def _add_job(self, job: LocalJob) -> None:
        with self._lock:
            atexit.unregister(self._stop_jobs)  # registered once: a server never stopped still kills its jobs on exit
            atexit.register(self._stop_jobs)
            self._jobs[job.id] = job
        job.start()

    def _stop_jobs(self) -> None:
        """Kill every job and remove every job folder (stopping them all first, then waiting for each)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.stop()
        for job in jobs:
            job.close()
        remove_tree(self.root / "_jobs")
        atexit.unregister(self._stop_jobs)


def _member_of(hub: HubServer, req: Request, *, write: bool) -> str:
    """The namespace of the route, which the token's user must be (or belong to, for an organisation)."""
    namespace = req.params["namespace"]
    if req.user is None:
        raise HubError(401, "You must be authenticated to use Jobs")
    if not hub._is_member(req.user, namespace):
        raise HubError(403, f"You don't have the rights to access jobs in the namespace {namespace!r}")
    if write and req.role != "write":
        raise HubError(403, "You have read access but not the required permissions for this operation")
    return namespace


def _check_can_pay(hub: HubServer, namespace: str) -> None:
    if not hub.can_pay(namespace):
        raise HubError(402, NO_CREDITS.format(namespace=namespace))


def _find(hub: HubServer, req: Request, *, write: bool = False) -> LocalJob:
    namespace = _member_of(hub, req, write=write)
    job = hub._jobs.get(req.params["job"])
    if job is None or job.namespace != namespace:
        raise HubError(404, f"Job {req.params['job']} not found")
    return job


def _strings(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HubError(400, f"{what} must be an object")
    return {str(k): str(v) for k, v in value.items()}


def _labels(value: Any) -> dict[str, str]:
    labels = _strings(value, "labels")
    for key, val in labels.items():
        if not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(val):
            raise HubError(
                400,
                f"Invalid label {key}={val}: keys and values are at most 100 letters, digits, dashes or underscores",
            )
    return labels


def _volume(hub: HubServer, user: User, raw: Any) -> Volume:
    """A repo volume checked like a download (visibility, gate, revision) and pinned to its commit's files."""
    if not isinstance(raw, dict) or not raw.get("source") or not raw.get("mountPath"):
        raise HubError(400, "A volume needs a source and a mountPath")
    kind, mount = raw.get("type", "model"), str(raw["mountPath"])
    if kind == "bucket":
        raise HubError(400, "Bucket volumes are not served by the local Hub")
    if kind not in REPO_TYPES:
        raise HubError(400, f"Invalid volume type {kind!r}")
    parts = mount.strip("/").split("/")
    if not mount.startswith("/") or parts == [""] or any(p in ("", ".", "..") for p in parts):
        raise HubError(400, f"Invalid mountPath {mount!r}: an absolute path below /")
    repo = hub._readable_repo(kind, str(raw["source"]), user, content=True)
    commit = repo.commits[hub._resolve(repo, str(raw.get("revision") or "main"))]
    prefix = str(raw.get("path") or "").strip("/")
    under = prefix + "/" if prefix else ""
    files = {p[len(under) :]: hub._blob_path(e.sha256) for p, e in commit.files.items() if p.startswith(under)}
    if prefix and not files:
        raise HubError(404, f"{kind} {repo.repo_id} has no folder {prefix!r} at {raw.get('revision') or 'main'}")
    echoed = {k: raw[k] for k in ("type", "source", "mountPath", "revision", "path") if k in raw}
    return Volume(mount, {"type": kind, **echoed, "readOnly": True}, files)


def _spec(hub: HubServer, req: Request, body: Any) -> JobSpec:
    if not isinstance(body, dict):
        raise HubError(400, "A job spec must be an object")
    command = body.get("command") or []
    arguments = body.get("arguments") or []
    if not isinstance(command, list) or not command or not isinstance(arguments, list):
        raise HubError(400, "A local job needs a command: a non-empty list of strings")
    image = {k: str(body[k]) for k in ("dockerImage", "spaceId") if body.get(k)}
    if not image:
        raise HubError(400, "A job needs a dockerImage or a spaceId")
    flavor = str(body.get("flavor") or "cpu-basic")
    if flavor not in FLAVORS:
        raise HubError(400, f"Invalid flavor {flavor!r}: one of {', '.join(sorted(FLAVORS))}")
    timeout = body.get("timeoutSeconds") or DEFAULT_TIMEOUT
    if not isinstance(timeout, int) or timeout <= 0:
        raise HubError(400, f"Invalid timeoutSeconds {timeout!r}")
    assert req.user is not None
    volumes = [_volume(hub, req.user, v) for v in body.get("volumes") or []]
    mounts = sorted(v.mount_path.rstrip("/") for v in volumes)
    for outer, inner in zip(mounts, mounts[1:], strict=False):
        if inner == outer or inner.startswith(outer + "/"):
            raise HubError(400, f"Volumes at {outer} and {inner} overlap (not simulated by the local Hub)")
    attempts = body.get("attempts")
    return JobSpec(
        image=image,
        command=[str(a) for a in command],
        arguments=[str(a) for a in arguments],
        environment=_strings(body.get("environment"), "environment"),
        secrets=_strings(body.get("secrets"), "secrets"),
        flavor=flavor,
        timeout=timeout,
        labels=_labels(body.get("labels")),
        volumes=volumes,
        attempts=attempts if isinstance(attempts, int) else None,
    )


def _launch(hub: HubServer, req: Request, namespace: str, spec: JobSpec) -> Response:
    assert req.user is not None
    job_id = os.urandom(12).hex()  # 24 hex digits, like the Hub's ids
    job = LocalJob(
        job_id,
        spec,
        namespace=namespace,
        owner_type="user" if namespace == req.user.name else "org",
        initiator=req.user.name,
        folder=hub.root / "_jobs" / job_id,
        base_env=client_env(hub),
    )
    hub._add_job(job)
    return json_response(job.to_json())


def run_job(hub: HubServer, req: Request) -> Response:
    namespace = _member_of(hub, req, write=True)
    _check_can_pay(hub, namespace)
    return _launch(hub, req, namespace, _spec(hub, req, req.json()))


def rerun_job(hub: HubServer, req: Request) -> Response:
    old = _find(hub, req, write=True)
    _check_can_pay(hub, old.namespace)
    return _launch(hub, req, old.namespace, dataclasses.replace(old.spec, labels=dict(old.spec.labels)))


def list_jobs(hub: HubServer, req: Request) -> Response:
    namespace = _member_of(hub, req, write=False)
    stages = {s.upper() for s in req.query.get("stage", [])}
    if stages - set(_STAGES):
        raise HubError(400, f"Invalid stage filter: one of {', '.join(_STAGES)}")
    wanted = [label.partition("=") for label in req.query.get("label", [])]
    jobs = [
        job.to_json()
        for job in reversed(hub._jobs.values())
        if job.namespace == namespace
        and (not stages or job.stage in stages)
        and all(key in job.spec.labels and (not eq or job.spec.labels[key] == val) for key, eq, val in wanted)
    ]
    return paginate(hub.url, req, jobs, _JOBS_PAGE)


def inspect_job(hub: HubServer, req: Request) -> Response:
    return json_response(_find(hub, req).to_json())


def job_logs(hub: HubServer, req: Request) -> Response:
    job = _find(hub, req)
    tail = req.q("tail")
    if tail is not None and not tail.isdigit():
        raise HubError(400, f"Invalid tail {tail!r}")
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    return Response(200, headers=headers, stream=job.log_stream(int(tail) if tail is not None else None))


def cancel_job(hub: HubServer, req: Request) -> Response:
    job = _find(hub, req, write=True)
    job.cancel()
    return json_response(job.to_json())


def update_labels(hub: HubServer, req: Request) -> Response:
    job = _find(hub, req, write=True)
    body = req.json()
    job.spec.labels = _labels(body.get("labels") if isinstance(body, dict) else None)
    return json_response(job.to_json())


def hardware(hub: HubServer, req: Request) -> Response:
    return json_response(HARDWARE)


_JOB = r"/api/jobs/(?P<namespace>[^/]+)/(?P<job>[^/]+)"
ROUTES = [
    (("GET",), r"/api/jobs/hardware", hardware),
    (("GET",), r"/api/jobs/(?P<namespace>[^/]+)", list_jobs),
    (("POST",), r"/api/jobs/(?P<namespace>[^/]+)", run_job),
    (("GET",), _JOB, inspect_job),
    (("GET",), _JOB + r"/logs", job_logs),
    (("POST",), _JOB + r"/cancel", cancel_job),
    (("PUT",), _JOB + r"/labels", update_labels),
    (("POST",), _JOB + r"/duplicate", rerun_job),
]
