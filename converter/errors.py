"""Errors the user can act on. The CLI prints their message on one line; each class carries its `verdict`
(converter.outcome), from which the outcome of the failed verb and its `exit_code` follow.

Callers of the Python API catch the narrow classes and read what went wrong from their fields (file, tensor,
repo id, revision, HTTP status, ...) instead of parsing messages, like huggingface_hub's errors; every class is a
`ConverterError`, so catching that still catches everything.
"""

from __future__ import annotations

from typing import Literal

from converter.outcome import Verdict
from converter.outcome import exit_code as _exit_code


class ConverterError(Exception):
    """Bad input or usage: the message names the file/tensor and says what to do."""

    verdict = Verdict.REFUSED
    exit_code = _exit_code(verdict)


class UsageError(ConverterError):
    """Options that cannot go together, a required one missing, or a value of the wrong form."""


class MissingExtraError(UsageError):
    """An optional dependency is not installed: `package`, which `pip install 'converter[extra]'` brings."""

    def __init__(self, message: str, *, package: str, extra: str):
        super().__init__(message)
        self.package = package
        self.extra = extra


class BadInputError(ConverterError):
    """An input file is unusable. `file` is its path, `tensor` the tensor concerned (None when not one tensor)."""

    def __init__(self, message: str, *, file: object = None, tensor: str | None = None):
        super().__init__(message)
        self.file = None if file is None else str(file)
        self.tensor = tensor


class AdapterFormatError(BadInputError):
    """An adapter file or folder that cannot be read as any adapter format, or is inconsistent in itself."""


class RecipeError(BadInputError):
    """A recipe (or batch job list) that is not valid YAML, has unknown keys or values of the wrong type."""


class KeymapError(BadInputError):
    """A keymap file that does not follow the schema."""


class CheckpointError(BadInputError):
    """A base model or training checkpoint that cannot be read, or that the adapters do not fit."""


class CheckpointNotFound(CheckpointError):
    """A folder that holds no model or training checkpoint layout converter knows."""


class NoModelWeights(CheckpointError):
    """A training checkpoint with only optimizer / training state, no model weights."""


class OutputError(ConverterError):
    """Where the output goes cannot be used (exists without --force, not writable, no space): `path`."""

    def __init__(self, message: str, *, path: object = None):
        super().__init__(message)
        self.path = None if path is None else str(path)


HubReason = Literal[
    "no-token",  # no token where one is needed
    "unauthorized",  # the token was refused (401)
    "forbidden",  # the token may not do this (403)
    "gated",  # a gated repo the token has no access to
    "repo-not-found",
    "revision-not-found",
    "file-not-found",
    "invalid",  # a repo id or argument the Hub client refuses
    "conflict",  # the Hub said 409
    "timeout",  # the Hub said 408 (after the retries)
    "rate-limited",  # the Hub said 429 (after the retries)
    "server",  # a 5xx (after the retries)
    "http",  # another HTTP status
    "offline",  # HF_HUB_OFFLINE is set
    "unreachable",  # no connection (after the retries), or not cached while offline
    "no-space",  # the download did not fit on the disk
    "other",  # anything else: the repo holds the wrong kind of files, a download broke off, ...
]


class HubError(ConverterError):
    """A Hub source or target that cannot be used. `repo_id` (and `revision` when one was asked for), the HTTP
    `status` and the server's `request_id` when the Hub answered, and `reason`, one of `HubReason`."""

    def __init__(
        self,
        message: str,
        *,
        repo_id: str | None = None,
        revision: str | None = None,
        status: int | None = None,
        request_id: str | None = None,
        reason: HubReason = "other",
    ):
        super().__init__(message)
        self.repo_id = repo_id
        self.revision = revision
        self.status = status
        self.request_id = request_id
        self.reason = reason

    @property
    def transient(self) -> bool:
        """The Hub failed for reasons outside the job (rate limit, time-out, server error, no connection): worth a
        retry later."""
        return self.reason in ("rate-limited", "timeout", "server", "unreachable")


class PushError(HubError):
    """A push target that cannot take the upload: not the token's namespace, a repo converter did not make
    without --overwrite, an open pull request in the way."""


class VerificationFailed(ConverterError):
    """The result is not what it should be: `report` says where, typed (a merge's VerificationReport, a GGUF file's
    FileProof; None for a check that has no report, such as a converted adapter read back). Each report
    summarises itself for the outcome (`as_proofs()`)."""

    verdict = Verdict.FAILED
    exit_code = _exit_code(verdict)

    def __init__(self, message: str, *, report: object = None):
        super().__init__(message)
        self.report = report


class NotVerified(ConverterError):
    """No proof could judge the merge (`report.notes` say why): the output is kept, marked not verified, and not
    pushed; `--no-verify` says the user takes it unproven."""

    verdict = Verdict.NOT_VERIFIED
    exit_code = _exit_code(verdict)

    def __init__(self, message: str, *, report: object = None):
        super().__init__(message)
        self.report = report


class DoesNotFit(ConverterError):
    """A job this machine cannot hold, found from the headers before anything is downloaded: `where` (the folder
    whose disk was counted), the scratch `disk` it needs and the `free` bytes there, the `memory` it needs and the
    `available` memory; `flavor` is the Hugging Face Jobs flavor that fits it (None: none does), with its estimated
    `seconds` and `usd`."""

    def __init__(
        self,
        message: str,
        *,
        where: object = None,
        disk: int = 0,
        free: int = 0,
        memory: int = 0,
        available: int = 0,
        flavor: str | None = None,
        seconds: float | None = None,
        usd: float | None = None,
    ):
        super().__init__(message)
        self.where = None if where is None else str(where)
        self.disk, self.free, self.memory, self.available = disk, free, memory, available
        self.flavor, self.seconds, self.usd = flavor, seconds, usd


class JobsUnavailable(ConverterError):
    """Hugging Face Jobs cannot run under `namespace` for this token: a free account (Jobs need PRO, or an
    organization with credits), or a namespace the user is not a member of."""

    def __init__(self, message: str, *, namespace: str | None = None):
        super().__init__(message)
        self.namespace = namespace


class RemoteJobError(ConverterError):
    """A Hugging Face Job that ended without the outcome of the converter command it ran (it timed out, could not
    start, was canceled by someone else): `job_id`, its `url`, its last `stage` and the Hub's `status` message."""

    def __init__(
        self, message: str, *, job_id: str | None = None, url: str | None = None, stage: str | None = None,
        status: str | None = None,
    ):  # fmt: skip
        super().__init__(message)
        self.job_id, self.url, self.stage, self.status = job_id, url, stage, status


class JobInterrupted(RemoteJobError):
    """Ctrl-C while following a Hugging Face Job: `canceled` says whether the job was canceled on request or left
    running (then the message says how to follow it)."""

    verdict = Verdict.INTERRUPTED
    exit_code = _exit_code(verdict)

    def __init__(self, message: str, *, job_id: str, url: str, canceled: bool):
        super().__init__(message, job_id=job_id, url=url, stage="CANCELED" if canceled else "RUNNING")
        self.canceled = canceled
