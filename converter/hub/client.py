"""Talking to the Hugging Face Hub: retries for transient failures and one-line errors for the rest.

huggingface_hub is imported lazily (only Hub sources and pushes need it) and reads HF_ENDPOINT, HF_TOKEN,
HF_HUB_DISABLE_XET at import time, so it must not be imported before a caller has set them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from converter.errors import ConverterError, HubError, HubReason

T = TypeVar("T")
RETRY_STATUS = (408, 429, 500, 502, 503, 504)


def attempts() -> int:
    return int(os.environ.get("CONVERTER_HUB_RETRIES", "5"))


def _retry_after(err: Exception, attempt: int) -> float | None:
    """Seconds to wait before retrying `err`, or None when it is not transient."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(err, OfflineModeIsEnabled):
        return None
    if isinstance(err, HfHubHTTPError):
        response = err.response
        status = getattr(response, "status_code", None)
        if status not in RETRY_STATUS:
            return None
        header = response.headers.get("Retry-After") if response is not None else None
        if header:
            try:
                return min(float(header), 60.0)
            except ValueError:
                pass
    elif not _is_connection_error(err):
        return None
    return min(0.5 * 2**attempt, 8.0)


def _is_connection_error(err: Exception) -> bool:
    names = {cls.__name__ for cls in type(err).__mro__}
    return bool(
        names
        & {
            "ConnectError",
            "ReadError",
            "RemoteProtocolError",
            "ReadTimeout",
            "ConnectTimeout",
            "WriteError",
            "NetworkError",
            "TransportError",
            "ConnectionError",
            "TimeoutException",
        }
    )


def _unwrapped(err: Exception) -> Exception:
    """huggingface_hub wraps an LFS upload's HTTP error in a RuntimeError ("Error while uploading ..."): the
    cause is what says whether to retry and what went wrong."""
    while type(err) is RuntimeError and isinstance(err.__cause__, Exception):
        err = err.__cause__
    return err


def call(what: str, fn: Callable[[], T], *, repo_id: str | None = None, revision: str | None = None) -> T:
    """Run a Hub call, retrying transient failures with backoff; other failures become a one-line HubError that
    names `what` and carries `repo_id` / `revision` (the repo and revision the call is about)."""
    tries = attempts()
    for attempt in range(tries):
        try:
            return fn()
        except ConverterError:
            raise
        except Exception as wrapped:  # noqa: BLE001 - classified below
            err = _unwrapped(wrapped)
            wait = _retry_after(err, attempt)
            if wait is None or attempt == tries - 1:
                raise explain(what, err, repo_id=repo_id, revision=revision) from None
            time.sleep(wait)
    raise AssertionError("unreachable")


def explain(what: str, err: Exception, *, repo_id: str | None = None, revision: str | None = None) -> HubError:
    """Turn a huggingface_hub exception into a HubError: one line that says what to do (never a token), and the
    repo, revision, HTTP status, server request id and reason as fields."""
    from huggingface_hub.errors import HfHubHTTPError

    message, reason = _explain(what, err)
    status = request_id = None
    if isinstance(err, HfHubHTTPError):
        status = getattr(err.response, "status_code", None)
        request_id = getattr(err, "request_id", None)
    return HubError(message, repo_id=repo_id, revision=revision, status=status, request_id=request_id, reason=reason)


_STATUS_REASONS: dict[int, HubReason] = {
    401: "unauthorized",
    403: "forbidden",
    408: "timeout",
    409: "conflict",
    429: "rate-limited",
}


def _explain(what: str, err: Exception) -> tuple[str, HubReason]:
    """The message and reason for `err`; raises `err` itself when it is not a Hub failure (a bug to report)."""
    from huggingface_hub import errors

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    if isinstance(err, errors.LocalTokenNotFoundError):
        return f"{what}: no Hugging Face token; pass --token, set HF_TOKEN or run `hf auth login`", "no-token"
    if isinstance(err, errors.OfflineModeIsEnabled):
        return f"{what}: HF_HUB_OFFLINE is set, so the Hub cannot be asked; unset it or use a local path", "offline"
    if isinstance(err, errors.GatedRepoError):
        return f"{what}: the repo is gated; request access on {endpoint} and use a token that has it", "gated"
    if isinstance(err, errors.RepositoryNotFoundError):
        return (
            f"{what}: repo not found (check the name; for a private repo pass --token or set HF_TOKEN)",
            "repo-not-found",
        )
    if isinstance(err, errors.RevisionNotFoundError):
        return f"{what}: revision not found (check the branch, tag or commit after @)", "revision-not-found"
    if isinstance(err, errors.EntryNotFoundError | errors.RemoteEntryNotFoundError):
        return f"{what}: file not found in the repo", "file-not-found"
    if isinstance(err, errors.LocalEntryNotFoundError):
        return f"{what}: not in the local cache and the Hub cannot be reached (HF_HUB_OFFLINE?)", "offline"
    if isinstance(err, errors.HfHubHTTPError):
        status = getattr(err.response, "status_code", "?")
        if status == 401:
            return f"{what}: the token was refused (401); log in again or pass a valid --token", "unauthorized"
        if status == 403:
            return f"{what}: not allowed (403); the token needs write access to this namespace", "forbidden"
        message = str(err).splitlines()[0][:300]
        reason = _STATUS_REASONS.get(status, "server" if isinstance(status, int) and status >= 500 else "http")
        return f"{what}: Hub error {status}: {message}", reason
    if isinstance(err, OSError) and getattr(err, "errno", None) == 28:
        return f"{what}: no space left on device (free some disk or set HF_HOME elsewhere)", "no-space"
    if isinstance(err, errors.HFValidationError):
        return f"{what}: {str(err).splitlines()[0]}", "invalid"
    if _is_connection_error(err):
        return f"{what}: cannot reach the Hub after {attempts()} tries ({type(err).__name__})", "unreachable"
    raise err


def whoami(token: str | None) -> str:
    """The user name behind the token: checked before any long job that ends in an upload."""
    return whoami_info(token)["name"]


def whoami_info(token: str | None) -> dict:
    """The Hub's whole answer about the token: the user's name, their orgs with their role in each, the token's
    kind and role."""
    from huggingface_hub import HfApi

    return call("whoami", lambda: HfApi(token=token).whoami())
