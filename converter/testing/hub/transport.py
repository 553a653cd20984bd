"""HTTP plumbing: the threaded server, request bodies (LFS uploads streamed to disk), faults on the way in, and
responses on the way out (blob ranges and event streams sent after the hub lock, through the bandwidth links).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from converter.testing.hub.faults import Seen, retry_after
from converter.testing.hub.link import Link
from converter.testing.hub.wire import HubError, Response, Upload

if TYPE_CHECKING:
    from converter.testing.hub.server import HubServer

log = logging.getLogger(__name__)

_STREAM_CHUNK = 256 * 1024  # file bodies move in chunks of this size (through the bandwidth links)


class HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], hub: HubServer) -> None:
        super().__init__(address, handler)
        self.hub = hub

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hanging up (e.g. after a dropped-connection fault) are expected; keep stderr clean.
        log.debug("fake hub: connection error from %s", client_address, exc_info=True)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "converter-fake-hub/1.0"
    timeout = 60  # idle keep-alive connections close after this

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def log_message(self, format: str, *args: Any) -> None:
        # Only the request line / status, never headers: tokens travel in Authorization.
        log.debug("fake hub: %s", format % args)

    def _read_body(self) -> bytes:
        up: Link = self.server.hub.up  # type: ignore[attr-defined]
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                up.take(size)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        up.take(length)
        return self.rfile.read(length)

    def _receive_upload(self, hub: HubServer) -> Upload:
        """An LFS upload body, streamed to a file under the hub's root and hashed on the way (through the link)."""
        length = int(self.headers.get("Content-Length") or 0)
        folder = hub.root / "uploads"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{threading.get_ident()}-{time.monotonic_ns()}"
        h, left = hashlib.sha256(), length
        with open(path, "wb") as f:
            while left:
                n = min(left, _STREAM_CHUNK)
                hub.up.take(n)
                chunk = self.rfile.read(n)
                if not chunk:
                    break
                h.update(chunk)
                f.write(chunk)
                left -= len(chunk)
        return Upload(path, h.hexdigest(), length - left)

    def _handle(self) -> None:
        hub: HubServer = self.server.hub  # type: ignore[attr-defined]
        split = urlsplit(self.path)
        method = self.command
        upload = None
        if (
            method == "PUT"
            and split.path.startswith("/_lfs/")
            and "chunked" not in self.headers.get("Transfer-Encoding", "")
        ):
            upload, body = self._receive_upload(hub), b""
        else:
            body = self._read_body()
        try:
            hub.requests.append((method, split.path))
            fault = hub._take_fault(method, split.path)
            if fault is not None and fault.delay:
                time.sleep(fault.delay)
            if fault is not None and fault.status is not None:
                headers = {} if fault.retry_after is None else {"Retry-After": retry_after(fault.retry_after)}
                response = HubError(fault.status, f"Injected fault: HTTP {fault.status}", headers=headers).response(
                    head=method == "HEAD"
                )
            else:
                query = parse_qs(split.query, keep_blank_values=True)
                response = hub._dispatch(method, split.path, query, self.headers, body, upload)
        finally:
            if upload is not None:
                upload.path.unlink(missing_ok=True)
        response.headers["X-Request-Id"] = f"fake-{next(hub._request_ids)}"
        auth = "Authorization" in self.headers
        record = Seen(method, split.path, split.query, response.status, self.headers.get("Range"), auth, bool(fault))
        hub.seen.append(record)
        if fault is not None and fault.drop_connection:
            self._write(response, method, drop=True)
        else:
            self._write(response, method)

    def _write(self, response: Response, method: str, drop: bool = False) -> None:
        if response.stream is not None:
            self._send_stream(response, drop)
            return
        body = b"" if method == "HEAD" else response.body
        size = response.file[2] if response.file and method != "HEAD" else len(body)
        if drop and not size:
            self._hang_up()  # nothing to cut in half: drop before any byte
            return
        self.send_response(response.status)
        response.headers.setdefault("Content-Length", str(len(response.body)))
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.end_headers()
        limit = max(1, size // 2) if drop else size
        if response.file and method != "HEAD":
            self._send_file(*response.file, limit)
        else:
            self.server.hub.down.take(limit)  # type: ignore[attr-defined]
            self.wfile.write(body[:limit])
        if drop:
            self._hang_up()

    def _send_file(self, path: Path, start: int, length: int, limit: int) -> None:
        """A blob range, in chunks through the down link (never read whole; the hub lock is not held)."""
        down: Link = self.server.hub.down  # type: ignore[attr-defined]
        with open(path, "rb") as f:
            f.seek(start)
            left = min(length, limit)
            while left:
                chunk = f.read(min(left, _STREAM_CHUNK))
                if not chunk:
                    return
                down.take(len(chunk))
                self.wfile.write(chunk)
                left -= len(chunk)

    def _send_stream(self, response: Response, drop: bool) -> None:
        """Chunks as they are produced (chunked transfer encoding: the length is not known ahead); a dropped
        connection dies right after the headers, a client hanging up ends the stream."""
        assert response.stream is not None
        self.send_response(response.status)
        response.headers["Transfer-Encoding"] = "chunked"
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.end_headers()
        if drop:
            self._hang_up()
            return
        down: Link = self.server.hub.down  # type: ignore[attr-defined]
        try:
            for chunk in response.stream:
                down.take(len(chunk))
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            self.close_connection = True

    def _hang_up(self) -> None:
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
