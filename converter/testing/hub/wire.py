"""The shapes every handler speaks: a parsed request, a response, and an HTTP error as the Hub sends it.

The client picks its exception from the status and ``X-Error-Code``, and reads the message from the JSON body
(or from ``X-Error-Message`` on HEAD), so these are part of the protocol, not decoration.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from converter.testing.hub.model import User

_TYPE_FROM_SEGMENT = {"models": "model", "datasets": "dataset", "spaces": "space", "": "model"}


class HubError(Exception):
    """An HTTP error as the Hub sends it: status, ``X-Error-Code`` (how the client picks its exception), message."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})

    def response(self, head: bool) -> Response:
        headers = dict(self.headers)
        if self.code:
            headers["X-Error-Code"] = self.code
        if head:  # no body on HEAD: the client reads the message from this header
            headers["X-Error-Message"] = self.message
        return json_response({"error": self.message}, self.status, headers)


@dataclass
class Response:
    """What a handler answers. ``file`` and ``stream`` are sent after the hub lock is released: a blob range read
    from disk, or chunks produced while they happen (server-sent events), sent with chunked transfer encoding."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    file: tuple[Path, int, int] | None = None  # (path, start, length)
    stream: Iterator[bytes] | None = None


@dataclass(frozen=True)
class Upload:
    """A request body streamed to a file (LFS uploads): never held in memory."""

    path: Path
    sha256: str
    size: int


def json_response(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    body = json.dumps(obj).encode()
    return Response(status, body, {"Content-Type": "application/json; charset=utf-8", **(headers or {})})


@dataclass
class Request:
    """A request as handlers see it: authenticated user and token role, path parameters, query, body."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: Mapping[str, str]
    body: bytes
    user: User | None
    role: str | None
    params: dict[str, str]
    upload: Upload | None = None

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


def paginate(base_url: str, req: Request, items: list[Any], page_size: int) -> Response:
    """Cursor pagination with a ``Link: <...>; rel="next"`` header, which the client follows (a repeated query
    parameter, such as the ``label`` filters of a job listing, is carried to the next page whole)."""
    start = int(req.q("cursor") or 0)
    headers = {}
    if start + page_size < len(items):
        pairs = [(k, v) for k, values in req.query.items() if k != "cursor" for v in values]
        pairs.append(("cursor", str(start + page_size)))
        qs = "&".join(f"{quote(k)}={quote(v)}" for k, v in pairs)
        headers["Link"] = f'<{base_url}{req.path}?{qs}>; rel="next"'
    return json_response(items[start : start + page_size], headers=headers)
