"""The batch's memory between runs: one SQLite row per job id (status, commits read, link, verdict, error).

Why SQLite: writes are atomic (a driver killed mid-batch leaves a readable file), and the file can be inspected
with any SQLite tool. Only the driver writes it. Nothing secret goes in: job arguments hold no token, and error
lines come from the CLI, which never prints one.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from converter.batch.job_list import Job
from converter.errors import OutputError

#: pending: never finished; running: submitted (a driver that died leaves this, the next run retries it);
#: done: finished, skipped on re-runs; failed: retried on re-runs.
STATUSES = ("pending", "running", "done", "failed")

_SCHEMA = """
create table if not exists jobs (
    id text primary key,
    kind text not null,
    target text not null,
    spec text not null,
    status text not null default 'pending',
    result text,
    sources text,
    url text,
    verdict text,
    seconds real,
    peak_bytes integer,
    error text,
    attempts integer not null default 0,
    updated real
)
"""


@dataclass
class Row:
    id: str
    kind: str
    target: str
    status: str
    result: str | None
    sources: dict[str, str]
    url: str | None
    verdict: str | None
    seconds: float | None
    peak_bytes: int | None
    error: str | None
    attempts: int


class State:
    """Open (or create) the state file; `add` registers jobs without touching ones already known."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None)
            self.db.execute(_SCHEMA)
        except sqlite3.Error as e:
            raise OutputError(
                f"{self.path}: cannot use this state file ({e}); give another --state", path=self.path
            ) from None

    def close(self) -> None:
        self.db.close()

    def add(self, jobs: list[Job]) -> None:
        with self.db:
            self.db.executemany(
                "insert or ignore into jobs (id, kind, target, spec, updated) values (?, ?, ?, ?, ?)",
                [(j.id, j.kind, j.target, json.dumps(j.options, sort_keys=True), time.time()) for j in jobs],
            )

    def status(self, job_id: str) -> str | None:
        row = self.db.execute("select status from jobs where id = ?", (job_id,)).fetchone()
        return row[0] if row else None

    def start(self, job_id: str) -> None:
        self.db.execute(
            "update jobs set status = 'running', attempts = attempts + 1, updated = ? where id = ?",
            (time.time(), job_id),
        )

    def finish(self, job_id: str, outcome: dict) -> None:
        """Record a job's outcome (the dict `run.run_job` returns, or the driver's account of a lost task)."""
        self.db.execute(
            "update jobs set status = ?, result = ?, sources = ?, url = ?, verdict = ?, seconds = ?, peak_bytes = ?,"
            " error = ?, updated = ? where id = ?",
            (
                outcome["status"],
                outcome.get("result"),
                json.dumps(outcome.get("sources") or {}),
                outcome.get("url"),
                outcome.get("verdict"),
                outcome.get("seconds"),
                outcome.get("peak_bytes"),
                outcome.get("error"),
                time.time(),
                job_id,
            ),
        )

    def rows(self, ids: list[str]) -> list[Row]:
        """The rows for `ids`, in that order."""
        found = {}
        for r in self.db.execute(
            "select id, kind, target, status, result, sources, url, verdict, seconds, peak_bytes, error, attempts"
            " from jobs"
        ):
            found[r[0]] = Row(*r[:5], json.loads(r[5] or "{}"), *r[6:])
        return [found[i] for i in ids if i in found]
