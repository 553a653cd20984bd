"""The server: its state, its lifecycle, and the routing of each request to the area that serves it.

Each area (users, repos, files, commits and PRs, LFS, Jobs) is a module with its handlers and its ``ROUTES``; the state
and the rules shared by handlers are the mixins HubServer is made of. Handlers run under one lock, so a request sees
the repos as one consistent state; bodies that take time (downloads, log streams) are sent after it is released.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import unquote

from converter.testing.hub import commits, files, jobs, lfs, repos, users
from converter.testing.hub.faults import Fault, FaultsMixin, Seen
from converter.testing.hub.jobs import JobsMixin
from converter.testing.hub.link import Link
from converter.testing.hub.local_job import LocalJob
from converter.testing.hub.model import Repo, User
from converter.testing.hub.store import RepoStore
from converter.testing.hub.transport import Handler, HTTPServer
from converter.testing.hub.wire import HubError, Request, Response, Upload, json_response

log = logging.getLogger(__name__)

_HandlerFn = Callable[["HubServer", Request], Response]
_Route = tuple[tuple[str, ...], re.Pattern[str], _HandlerFn]


def _compile(routes: list[tuple[tuple[str, ...], str, _HandlerFn]]) -> list[_Route]:
    return [(methods, re.compile(pattern), handler) for methods, pattern, handler in routes]


_ROUTES = _compile(users.ROUTES + repos.ROUTES + files.ROUTES + commits.ROUTES + lfs.ROUTES)
_JOB_ROUTES = _compile(jobs.ROUTES)


class HubServer(RepoStore, FaultsMixin, JobsMixin):
    """A fake Hub on 127.0.0.1 (free port, threaded) whose repos live on disk under ``root``.

    State is reloaded from ``root`` on construction, so a "restarted Hub" keeps its repos. ``requests`` lists
    (method, raw path without query) of every request in arrival order, faulted ones included, for assertions like
    "the second run downloaded nothing"; ``seen`` has the same with status, Range and whether a token was sent.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        tree_page_size: int = 1000,
        down_rate: float | None = None,
        up_rate: float | None = None,
        jobs: bool = False,
    ) -> None:
        """`down_rate` / `up_rate`: bytes/s of the one link each way (server to client / client to server).
        `jobs`: serve the Jobs API, which runs the commands it is sent as subprocesses (off unless asked for)."""
        self.root = Path(root)
        self.down, self.up = Link(down_rate), Link(up_rate)
        self.root.mkdir(parents=True, exist_ok=True)
        self.tree_page_size = tree_page_size
        self.jobs_enabled = jobs
        self.requests: list[tuple[str, str]] = []
        self.seen: list[Seen] = []
        self._lock = threading.RLock()
        self._users: dict[str, User] = {}
        self._tokens: dict[str, tuple[str, str]] = {}  # token -> (user, role)
        self._org_can_pay: dict[str, bool] = {}
        self._repos: dict[tuple[str, str], Repo] = {}
        self._faults: list[Fault] = []
        self._pending_lfs: dict[str, int] = {}
        self._jobs: dict[str, LocalJob] = {}
        self._request_ids = itertools.count(1)
        self._httpd: HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._load()

    def start(self) -> HubServer:
        """Bind a free port on 127.0.0.1 and serve in a daemon thread."""
        if self._httpd is None:
            self._httpd = HTTPServer(("127.0.0.1", 0), Handler, self)
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port (open keep-alive connections die with their daemon threads); jobs are
        killed and their folders removed."""
        self._stop_jobs()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._httpd = self._thread = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The endpoint to give the client as ``HF_ENDPOINT`` (no trailing slash)."""
        if self._httpd is None:
            raise RuntimeError("HubServer is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def _dispatch(
        self,
        method: str,
        path: str,
        query: dict[str, list[str]],
        headers: Mapping[str, str],
        body: bytes,
        upload: Upload | None = None,
    ) -> Response:
        try:
            user, role = self._authenticate(headers.get("Authorization"))
            allowed: list[str] = []
            for methods, pattern, handler in _ROUTES + (_JOB_ROUTES if self.jobs_enabled else []):
                m = pattern.fullmatch(path)
                if m is None:
                    continue
                if method not in methods:
                    allowed += methods
                    continue
                params = {k: unquote(v) for k, v in m.groupdict().items() if v is not None}
                req = Request(method, path, query, headers, body, user, role, params, upload)
                with self._lock:
                    return handler(self, req)
            if allowed:
                raise HubError(405, f"Method {method} not allowed", headers={"Allow": ", ".join(allowed)})
            raise HubError(404, "Sorry, we can't find the page you are looking for.")
        except HubError as e:
            return e.response(head=method == "HEAD")
        except Exception as e:  # a bug in the fake must show up as a 500, as the real Hub would answer
            log.exception("fake hub: unhandled error on %s %s", method, path)
            return json_response({"error": f"Internal Error: {type(e).__name__}"}, 500)
