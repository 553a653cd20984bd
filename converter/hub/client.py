"""Talking to the Hugging Face Hub: retries for transient failures and one-line errors for the rest.

huggingface_hub is imported lazily (only Hub sources and pushes need it) and reads HF_ENDPOINT, HF_TOKEN,
HF_HUB_DISABLE_XET at import time, so it must not be imported before a caller has set them.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import TypeVar

from converter.errors import ConverterError, HubError

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


def call(what: str, fn: Callable[[], T]) -> T:
    """Run a Hub call, retrying transient failures with backoff; other failures become a one-line error."""
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
                raise explain(what, err) from None
            time.sleep(wait)
    raise AssertionError("unreachable")


def explain(what: str, err: Exception) -> ConverterError:
    """Turn a huggingface_hub exception into one line that says what to do. Never includes a token."""
    m = re.match(r"([\w.-]+/[\w.-]+)(?:@([^/\s]+))?", what)
    error = _explain(what, err)
    return HubError(str(error), repo_id=m[1] if m else None, revision=m[2] if m else None)


def _explain(what: str, err: Exception) -> ConverterError:
    from huggingface_hub import errors

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    if isinstance(err, errors.LocalTokenNotFoundError):
        return ConverterError(f"{what}: no Hugging Face token; pass --token, set HF_TOKEN or run `hf auth login`")
    if isinstance(err, errors.OfflineModeIsEnabled):
        return ConverterError(
            f"{what}: HF_HUB_OFFLINE is set, so the Hub cannot be asked; unset it or use a local path"
        )
    if isinstance(err, errors.GatedRepoError):
        return ConverterError(f"{what}: the repo is gated; request access on {endpoint} and use a token that has it")
    if isinstance(err, errors.RepositoryNotFoundError):
        return ConverterError(
            f"{what}: repo not found (check the name; for a private repo pass --token or set HF_TOKEN)"
        )
    if isinstance(err, errors.RevisionNotFoundError):
        return ConverterError(f"{what}: revision not found (check the branch, tag or commit after @)")
    if isinstance(err, errors.EntryNotFoundError | errors.RemoteEntryNotFoundError):
        return ConverterError(f"{what}: file not found in the repo")
    if isinstance(err, errors.LocalEntryNotFoundError):
        return ConverterError(f"{what}: not in the local cache and the Hub cannot be reached (HF_HUB_OFFLINE?)")
    if isinstance(err, errors.HfHubHTTPError):
        status = getattr(err.response, "status_code", "?")
        if status == 401:
            return ConverterError(f"{what}: the token was refused (401); log in again or pass a valid --token")
        if status == 403:
            return ConverterError(f"{what}: not allowed (403); the token needs write access to this namespace")
        message = str(err).splitlines()[0][:300]
        return ConverterError(f"{what}: Hub error {status}: {message}")
    if isinstance(err, OSError) and getattr(err, "errno", None) == 28:
        return ConverterError(f"{what}: no space left on device (free some disk or set HF_HOME elsewhere)")
    if isinstance(err, errors.HFValidationError):
        return ConverterError(f"{what}: {str(err).splitlines()[0]}")
    if _is_connection_error(err):
        return ConverterError(f"{what}: cannot reach the Hub after {attempts()} tries ({type(err).__name__})")
    raise err


def whoami(token: str | None) -> str:
    """The user name behind the token: checked before any long job that ends in an upload."""
    from huggingface_hub import HfApi

    return call("whoami", lambda: HfApi(token=token).whoami())["name"]
