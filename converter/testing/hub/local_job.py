"""One Job of the local Hub: its command run as a subprocess in a process group of its own, its repo volumes
materialised as read-only folders, its output kept as log lines for the SSE stream, and its stage as the Hub reports
it (SCHEDULING, RUNNING, then COMPLETED, ERROR or CANCELED).

A subprocess has no container: there is no /base to mount a repo on. So each volume becomes a folder under the job's
root (``LOCAL_HUB_JOB_ROOT`` in the job's environment; mount path ``/base`` is ``$LOCAL_HUB_JOB_ROOT/base``), and a
command argument that is a mount path or starts with one is rewritten to point there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from converter.testing.hub.model import now, object_id

TERMINAL = ("COMPLETED", "CANCELED", "ERROR", "DELETED")
#: What the Hub's log stream sends first; the client leaves it out of the lines it yields.
STARTED_BANNER = "===== Job started at {} ====="
#: Seconds between SIGTERM and SIGKILL when a job is canceled, times out or the server stops (a container's grace).
KILL_GRACE = 2.0
#: Seconds of silence after which the log stream sends an SSE comment, as the Hub does, so idle readers stay alive.
KEEP_ALIVE = 30.0


@dataclass
class Volume:
    """A repo volume: where it is mounted, what it says (echoed back as sent) and the files it holds (path in the
    volume -> blob on the server's disk), pinned when the job was submitted."""

    mount_path: str
    spec: dict[str, Any]
    files: dict[str, Path]


@dataclass
class JobSpec:
    """A job as submitted: the public part of the spec (shown back) and its secrets (never shown back)."""

    image: dict[str, str]  # {"dockerImage": ...} or {"spaceId": ...}
    command: list[str]
    arguments: list[str]
    environment: dict[str, str]
    secrets: dict[str, str]
    flavor: str
    timeout: int
    labels: dict[str, str]
    volumes: list[Volume] = field(default_factory=list)
    attempts: int | None = None


class LocalJob:
    """A running (or finished) job. ``stage``, ``message``, ``pid``, ``returncode`` and ``root`` may be read by
    tests; ``volume_folder(mount_path)`` is where a volume's files are."""

    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        *,
        namespace: str,
        owner_type: str,
        initiator: str,
        folder: Path,
        base_env: Mapping[str, str],
    ) -> None:
        self.id = job_id
        self.spec = spec
        self.namespace = namespace
        self.owner_type = owner_type
        self.initiator = initiator
        self.folder = folder
        self.root = folder / "root"
        self.created_at = now()
        self.started_at: str | None = None
        self.finished_at: str | None = None
        self.stage = "SCHEDULING"
        self.message: str | None = None
        self.pid: int | None = None
        self.returncode: int | None = None
        self.lines: list[tuple[str, str]] = []  # (timestamp, text)
        self._base_env = dict(base_env)
        self._cond = threading.Condition()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ending: str | None = None  # why it is being stopped: "cancel", "timeout", "stop"
        self._killer: threading.Timer | None = None
        self._thread = threading.Thread(target=self._supervise, name=f"local-job-{job_id}", daemon=True)

    # -- what callers see ---------------------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.stage in TERMINAL

    def volume_folder(self, mount_path: str) -> Path:
        """The folder standing in for ``mount_path`` inside the job."""
        return self.root / mount_path.strip("/")

    def to_json(self) -> dict[str, Any]:
        """The job as the Hub shows it (``JobInfo``): never its secrets."""
        spec = self.spec
        info: dict[str, Any] = {
            "id": self.id,
            "createdAt": self.created_at,
            **spec.image,
            "command": spec.command,
            "arguments": spec.arguments,
            "environment": spec.environment,
            "secrets": {},
            "flavor": spec.flavor,
            "labels": spec.labels,
            "status": {"stage": self.stage, "message": self.message},
            "owner": {"id": object_id(self.namespace), "name": self.namespace, "type": self.owner_type},
            "initiator": {"type": "user", "id": object_id(self.initiator), "name": self.initiator},
            "timeoutSeconds": spec.timeout,
        }
        if spec.volumes:
            info["volumes"] = [v.spec for v in spec.volumes]
        if spec.attempts is not None:
            info["retry"] = spec.attempts - 1
        if self.started_at:
            info["startedAt"] = self.started_at
        if self.finished_at:
            info["finishedAt"] = self.finished_at
        return info

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job has reached a terminal stage; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self.finished, timeout)

    def log_stream(self, tail: int | None = None) -> Iterator[bytes]:
        """Server-sent events of the log: the lines so far (the last ``tail`` of them), then each new line as it is
        printed, until the job has finished and every line is sent."""
        with self._cond:
            sent = max(0, len(self.lines) - tail) if tail is not None else 0
        while True:
            with self._cond:
                self._cond.wait_for(self._news_after(sent), KEEP_ALIVE)
                batch = self.lines[sent:]
                sent += len(batch)
                done = self.finished and sent == len(self.lines)
            if not batch and not done:
                yield b": keep-alive\n\n"
            for timestamp, text in batch:
                yield b"data: " + json.dumps({"data": text, "timestamp": timestamp}).encode() + b"\n\n"
            if done:
                return

    def _news_after(self, sent: int) -> Callable[[], bool]:
        return lambda: sent < len(self.lines) or self.finished

    # -- control ------------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Stop the job as the user asked: its process group gets SIGTERM, then SIGKILL; the stage is CANCELED."""
        self._end("cancel")

    def stop(self) -> None:
        """Stop the job because the server stops: as a cancel, with a message saying so (returns at once)."""
        self._end("stop")

    def close(self) -> None:
        """Wait for a stopped job's end, then remove its folder."""
        if self._thread.is_alive():
            self._thread.join(timeout=KILL_GRACE + 5)
        remove_tree(self.folder)

    def _end(self, reason: str) -> None:
        with self._cond:
            if self.finished or self._ending is not None:
                return
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                return  # it has exited on its own: its exit code decides
            self._ending = reason
            if proc is not None:
                self._signal(signal.SIGTERM)
                self._killer = threading.Timer(KILL_GRACE, self._signal, (signal.SIGKILL,))
                self._killer.daemon = True
                self._killer.start()
            self._cond.notify_all()

    def _signal(self, sig: int) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    # -- the supervisor thread ----------------------------------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._materialise()
        except OSError as e:
            self._finish("ERROR", f"Could not mount the job's volumes: {e.strerror or e}")
            return
        if not self._spawn():
            return
        assert self._proc is not None and self._proc.stdout is not None
        reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True)
        reader.start()
        try:
            rc = self._proc.wait(timeout=self.spec.timeout)
        except subprocess.TimeoutExpired:
            self._end("timeout")
            rc = self._proc.wait()
        if self._killer is not None:
            self._killer.cancel()
        self._signal(signal.SIGKILL)  # what the job left behind in its group dies with it, as with a container
        reader.join(timeout=5)
        self.returncode = rc
        if self._ending in ("cancel", "stop"):
            message = "The local Hub stopped" if self._ending == "stop" else None
            self._finish("CANCELED", message)
        elif self._ending == "timeout":
            self._finish("ERROR", f"Job timed out after {self.spec.timeout} seconds")
        elif rc == 0:
            self._finish("COMPLETED", None)
        else:
            self._finish("ERROR", f"Job failed with exit code: {rc if rc > 0 else 128 - rc}")

    def _spawn(self) -> bool:
        spec = self.spec
        work = self.folder / "work"
        work.mkdir(parents=True, exist_ok=True)
        env = self._base_env | {"HF_HOME": str(self.folder / "hf-home")} | spec.environment | spec.secrets
        env["LOCAL_HUB_JOB_ROOT"] = str(self.root)
        argv = [self._rewrite(arg) for arg in spec.command + spec.arguments]
        with self._cond:
            if self._ending is not None:
                self._finish_locked("CANCELED", "The local Hub stopped" if self._ending == "stop" else None)
                return False
            try:
                self._proc = subprocess.Popen(
                    argv,
                    cwd=work,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: cancel kills all it started
                )
            except OSError as e:
                self.lines.append((now(), f"{argv[0] if argv else ''}: {e.strerror or e}"))
                self._finish_locked("ERROR", "Job failed with exit code: 127")
                return False
            self.pid = self._proc.pid
            self.stage = "RUNNING"
            self.started_at = now()
            self.lines.append((self.started_at, STARTED_BANNER.format(self.started_at)))
            self._cond.notify_all()
        return True

    def _rewrite(self, arg: str) -> str:
        """A mount path, or a path under one, as the folder standing in for it."""
        for volume in sorted(self.spec.volumes, key=lambda v: -len(v.mount_path)):
            mount = volume.mount_path.rstrip("/")
            if arg == mount or arg.startswith(mount + "/"):
                return str(self.root) + arg
        return arg

    def _read(self, stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            with self._cond:
                self.lines.append((now(), text))
                self._cond.notify_all()
        stream.close()

    def _materialise(self) -> None:
        """Each volume's files, copied from the blob store and made read-only (files and folders)."""
        for volume in self.spec.volumes:
            target = self.volume_folder(volume.mount_path)
            target.mkdir(parents=True, exist_ok=True)
            for rel, blob in sorted(volume.files.items()):
                dest = target / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(blob, dest)
                dest.chmod(0o444)
            for folder, _, _ in os.walk(target, topdown=False):
                Path(folder).chmod(0o555)

    def _finish(self, stage: str, message: str | None) -> None:
        with self._cond:
            self._finish_locked(stage, message)

    def _finish_locked(self, stage: str, message: str | None) -> None:
        self.stage, self.message = stage, message
        self.finished_at = now()
        self._cond.notify_all()


def remove_tree(folder: Path) -> None:
    """Remove a job's folder, read-only volumes included."""
    if not folder.exists():
        return
    for path, _, _ in os.walk(folder):
        os.chmod(path, stat.S_IRWXU)
    shutil.rmtree(folder, ignore_errors=True)
