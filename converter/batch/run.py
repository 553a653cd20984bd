"""The Ray side of a batch: one task per job (declared CPUs and memory, retries for Hub faults and dead workers,
a per-job timeout), and the driver loop that records each result as it arrives.

Why a subprocess per job: the task runs the same `converter` command a person would, so every check, error
message and PR rule applies unchanged; a job that crashes or is killed (OOM, timeout) takes only its own process
with it, and its peak memory is measured for that job alone (`wait4`). The command runs with `--json`, and what
happened is read from the outcome it prints (converter.outcome), never from its other lines.

Tokens: a local cluster started here inherits this process's environment (HF_TOKEN included), so the token is in
no argument, file or log. Ray writes a task's `runtime_env` into its own logs, so the token goes there only when
asked (`token_in_runtime_env`); otherwise the workers of an existing cluster need HF_TOKEN set on their nodes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from converter.batch.job_list import Job, is_hub_id
from converter.batch.state import State
from converter.errors import ConverterError, HubError, UsageError
from converter.hub import client as hub
from converter.io.optional import require
from converter.io.progress import Progress
from converter.io.scratch import temp_folder
from converter.outcome import Outcome, Verdict, last_outcome

#: A `converter` process before its data. Measured peaks on tiny models: convert (torch imported) ~250 MB, merge +
#: verify (transformers + peft too) ~440 MB; the reserve leaves room for real tokenizers and generation buffers.
CONVERT_BYTES = 512 << 20
PROCESS_BYTES = 1 << 30
#: Test hook: `<job id>=<point>` makes that job's first attempt stop its child at scratch point <point> (SIGSTOP),
#: so a test can kill the worker at a known moment.
STOP_ENV = "CONVERTER_BATCH_TEST_STOP"
#: Settings the driver forwards to the workers of an existing cluster (never HF_TOKEN unless asked, see above).
FORWARDED = (
    "HF_ENDPOINT", "HF_HUB_DISABLE_XET", "CONVERTER_HUB_RETRIES",
    "CONVERTER_JOBS_IMAGE", "CONVERTER_JOBS_FROM", "CONVERTER_JOBS_NAMESPACE", "CONVERTER_JOBS_LINK_RATE",
)  # fmt: skip


class HubFault(Exception):
    """The Hub failed for reasons outside the job (5xx, 429, connection); Ray retries the task."""


# --- inside a Ray worker -------------------------------------------------------------------------------------------


def run_job(job: Job, timeout: float | None, on_jobs: str | None = None) -> dict[str, Any]:
    """Run one job in a child `converter` process and return its outcome (status, link, verdict, time, peak).
    `on_jobs` (a flavor, or "auto"): a merge job runs as its own Hugging Face Job, which the child submits (or
    follows, when the same job is running already) and waits for; its outcome is the Job's."""
    started = time.monotonic()
    try:
        sources = resolve_sources(job)
    except ConverterError as e:
        message = _redact(str(e))
        if isinstance(e, HubError) and e.transient:
            raise HubFault(message) from None
        return _outcome("failed", started, error=message)
    pinned = {s: pin(s, sha) for s, sha in sources.items() if sha}

    with temp_folder("batch", log=lambda _m: None) as scratch:
        argv = job.argv(pinned) + on_jobs_args(job, on_jobs)
        if job.kind == "verify" and is_hub_id(job.target):
            argv[1] = _download(job.target, sources[job.target], scratch / "model")
        code, out, err, peak = _run_child(argv, job, scratch, timeout)
    outcome = _read_outcome(job, code, out, err, timeout)
    if outcome["status"] == "failed" and outcome.get("transient"):
        raise HubFault(outcome["error"])
    return _outcome(outcome.pop("status"), started, sources=sources, peak_bytes=peak, **outcome)


def on_jobs_args(job: Job, on_jobs: str | None) -> list[str]:
    """`--on-jobs [FLAVOR]` for a merge job sent to Hugging Face Jobs; conversions and verifications run here."""
    if not on_jobs or job.kind != "merge":
        return []
    return ["--on-jobs"] + ([] if on_jobs == "auto" else [on_jobs])


def resolve_sources(job: Job) -> dict[str, str | None]:
    """The commit each Hub source is at now (local sources: None); the job then runs on exactly these commits."""
    from huggingface_hub import HfApi

    api = HfApi()
    shas: dict[str, str | None] = {}
    for source in job.sources():
        if not is_hub_id(source):
            shas[source] = None
            continue
        repo, revision, _ = split_source(source)
        shas[source] = hub.call(
            source,
            lambda r=repo, v=revision: api.model_info(r, revision=v or "main").sha,
            repo_id=repo,
            revision=revision,
        )
    return shas


def split_source(source: str) -> tuple[str, str | None, str | None]:
    """`org/name[@rev][/path]` → (repo, revision, path)."""
    org, rest = source.split("/", 1)
    name, _, path = rest.partition("/")
    name, _, revision = name.partition("@")
    return f"{org}/{name}", revision or None, path or None


def pin(source: str, sha: str) -> str:
    repo, _, path = split_source(source)
    return f"{repo}@{sha}" + (f"/{path}" if path else "")


def _download(repo_id: str, sha: str | None, folder: Path) -> str:
    from huggingface_hub import snapshot_download

    return hub.call(repo_id, lambda: snapshot_download(repo_id, revision=sha, local_dir=folder), repo_id=repo_id)


def _die_with_parent() -> None:
    """In the child: if the Ray worker dies (killed, OOM), the job dies with it instead of running on unowned."""
    with contextlib.suppress(OSError):  # not Linux: the per-job timeout still bounds it
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _run_child(argv: list[str], job: Job, scratch: Path, timeout: float | None) -> tuple[int | None, str, str, int]:
    env = dict(os.environ)
    env.pop("CONVERTER_TEST_STOP", None)
    hook = os.environ.get(STOP_ENV, "")
    if hook.partition("=")[0] == job.id:
        marker = Path(os.environ.get("TMPDIR", "/tmp")) / f"converter-batch-stopped-{job.id}"
        if not marker.exists():
            marker.touch()
            env["CONVERTER_TEST_STOP"] = hook.partition("=")[2]
    out_path, err_path = scratch / "stdout.txt", scratch / "stderr.txt"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        child = subprocess.Popen(
            [sys.executable, "-m", "converter", "--json", *argv],
            stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=scratch,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        deadline = None if timeout is None else time.monotonic() + timeout
        code, peak = None, 0
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                code, peak = os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024
                break
            if deadline is not None and time.monotonic() > deadline:
                os.killpg(child.pid, signal.SIGKILL)
                _, status, usage = os.wait4(child.pid, 0)
                peak = usage.ru_maxrss * 1024
                break
            time.sleep(0.1)
        child.returncode = code if code is not None else -9
    return code, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"), peak


def _read_outcome(job: Job, code: int | None, out: str, err: str, timeout: float | None) -> dict[str, Any]:
    """What happened, from the outcome the child printed (`--json`); where it printed none (killed, timed out,
    dead before its handler), from how it ended."""
    if code is None:
        return {"status": "failed", "result": "timed out",
                "error": f"timed out after {timeout:g} s (raise the job's timeout:, or --job-timeout)"}  # fmt: skip
    if code < 0:
        return {"status": "failed", "result": "crashed",
                "error": f"the converter process was killed by signal {-code} (out of memory?)"}  # fmt: skip
    try:
        outcome = last_outcome(_redact(out))
    except ValueError as e:  # it died before printing its outcome: its stderr's last line is all there is
        error = (_redact(err).strip().splitlines() or [str(e)])[-1]
        return {"status": "failed", "result": "crashed", "error": error}
    return _job_result(job, outcome)


_FAILURES = {
    Verdict.FAILED: "verification failed",
    Verdict.NOT_VERIFIED: "not verified",  # a proof was asked for and could not judge (exit 5)
    Verdict.REFUSED: "error",
    Verdict.CRASHED: "crashed",
    Verdict.INTERRUPTED: "crashed",
}


def _job_result(job: Job, outcome: Outcome) -> dict[str, Any]:
    """A job's row from its outcome: the verdict, the pull request / commit link, whether anything changed, and
    for a failure its reason and whether the Hub's fault may pass (errors.HubError.transient)."""
    verdict = outcome.verdict.value
    if outcome.exit_code != 0:
        transient = outcome.error is not None and outcome.error.transient
        return {"status": "failed", "result": _FAILURES[outcome.verdict], "verdict": verdict,
                "error": outcome.reason, "transient": transient}  # fmt: skip
    done = {"status": "done", "verdict": verdict}
    pub = outcome.publication
    if pub is not None and pub.pr_url:
        return {**done, "result": "PR updated" if pub.pr_updated else "PR opened", "url": pub.pr_url}
    if pub is not None and not pub.changed:
        return {**done, "result": "unchanged", "url": pub.url}
    if pub is not None:
        return {**done, "result": "pushed", "url": f"{pub.url}/commit/{pub.commit}"}
    if outcome.details.get("existing"):
        return {**done, "result": "already converted"}
    return {**done, "result": "verified" if job.kind == "verify" else "done"}


def _outcome(status: str, started: float, **fields: Any) -> dict[str, Any]:
    fields.pop("transient", None)
    return {"status": status, "seconds": round(time.monotonic() - started, 2), **fields}


def _redact(text: str) -> str:
    token = os.environ.get("HF_TOKEN")
    return text.replace(token, "hf_***") if token else text


# --- the driver ----------------------------------------------------------------------------------------------------


def estimate_memory(job: Job, on_jobs: str | None = None) -> int:
    """Bytes to reserve for a job so Ray packs jobs without running out: the process itself, plus for merges and
    verifications one copy of the base in float32 (verification holds one model at a time; merging streams one
    tensor at a time, far less), plus for conversions a few float32 copies of the adapter. A merge on Hugging Face
    Jobs only waits here: the process alone."""
    if job.memory:
        return job.memory
    if on_jobs_args(job, on_jobs):
        return CONVERT_BYTES
    if job.kind == "convert":
        return CONVERT_BYTES + 4 * _weight_bytes(job.target)
    model = job.options["base"] if job.kind == "merge" else job.target
    return PROCESS_BYTES + 2 * _weight_bytes(model)  # 16-bit on disk → float32: ×2 (upper bound)


def _weight_bytes(source: str) -> int:
    """Bytes of the safetensors weights of a source (Hub: from the file listing; local: the files), 0 if unknown."""
    try:
        if not is_hub_id(source):
            path = Path(source)
            files = [path] if path.is_file() else list(path.rglob("*.safetensors"))
            return sum(f.stat().st_size for f in files)
        from huggingface_hub import HfApi

        repo, revision, path = split_source(source)
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
        if path:
            return sizes.get(path, 0)
        return sum(v for k, v in sizes.items() if k.endswith(".safetensors"))
    except Exception:  # noqa: BLE001 - an estimate only; the job itself reports what is wrong with the source
        return 0


def run_batch(
    jobs: list[Job],
    state_path: str | Path,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    cpus_per_job: float = 1.0,
    retries: int = 3,
    job_timeout: float | None = None,
    token_in_runtime_env: bool = False,
    on_jobs: str | None = None,
    log: Callable[[str], None] = print,
) -> tuple[list[str], list[str], float]:
    """Run every job not already done; record each outcome in the state file as it arrives.

    Returns (ids run now, ids skipped as done, seconds from the first submission to the last result)."""
    created = not Path(state_path).exists()
    state = State(state_path)
    try:
        state.add(jobs)
        todo = [j for j in jobs if state.status(j.id) != "done"]
        skipped = [j.id for j in jobs if state.status(j.id) == "done"]
        if skipped:
            log(f"{len(skipped)} job(s) already done (skipped); {len(todo)} to run")
        if not todo:
            return [], skipped, 0.0
        try:
            elapsed = _run_on_ray(todo, state, address, num_cpus, cpus_per_job, retries, job_timeout,
                                  token_in_runtime_env, log, on_jobs)  # fmt: skip
        except ConverterError:
            if created and all(state.status(j.id) == "pending" for j in jobs):  # Ray never started: leave nothing
                state.close()
                Path(state_path).unlink(missing_ok=True)
            raise
        return [j.id for j in todo], skipped, elapsed
    finally:
        state.close()


def _run_on_ray(todo, state, address, num_cpus, cpus_per_job, retries, job_timeout, token_in_runtime_env, log,
                on_jobs=None):  # fmt: skip
    import logging

    ray = require("ray", "converter batch")

    address = address or os.environ.get("RAY_ADDRESS") or None
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
    try:
        if address:
            env = {k: os.environ[k] for k in FORWARDED if k in os.environ}
            if token_in_runtime_env and os.environ.get("HF_TOKEN"):
                env["HF_TOKEN"] = os.environ["HF_TOKEN"]
            ray.init(address=address, runtime_env={"env_vars": env} if env else None, **quiet)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as e:  # Ray's own message says what is missing
        where = f"join the Ray cluster at {address}" if address else "start a local Ray cluster"
        raise UsageError(f"cannot {where}: {str(e).strip().splitlines()[0]}") from None
    try:
        # the most memory one node offers: a task asking for more could never be placed
        capacity = max((n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")), default=0)
        task = ray.remote(run_job)
        refs = {}
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:  # one Hub listing per job: look them up side by side
            memories = list(pool.map(lambda j: estimate_memory(j, on_jobs), todo))
        for job, memory in zip(todo, memories, strict=True):
            if capacity:
                memory = min(memory, int(capacity))  # too big for any node: verification offloads instead
            ref = task.options(
                num_cpus=cpus_per_job,
                memory=memory,
                max_retries=retries,
                retry_exceptions=[HubFault],
                name=f"converter-batch:{job.id}",
            ).remote(job, job.timeout or job_timeout, on_jobs)
            refs[ref] = job
            state.start(job.id)
        counts = {"done": 0, "failed": 0}
        with Progress(len(todo), "converter batch", log, unit="job", every=0) as bar:
            pending = list(refs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                job = refs[ready[0]]
                outcome = _collect(ray, ready[0], retries)
                state.finish(job.id, outcome)
                counts[outcome["status"]] += 1
                bar.update(1, **counts)
                if outcome["status"] == "failed":
                    bar.write(f"failed: {job.id}: {outcome.get('error')}")
        return time.monotonic() - started
    finally:
        ray.shutdown()


def _collect(ray, ref, retries: int) -> dict[str, Any]:
    """A task's outcome, or the driver's account of why there is none (retries used up)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, HubFault) else None
        message = str(cause) if cause else str(e).strip().splitlines()[-1]
        return {"status": "failed", "result": "Hub fault" if cause else "crashed",
                "error": f"{message} (after {retries + 1} tries)"}  # fmt: skip
    except ray.exceptions.RayError as e:
        error = f"the worker died {retries + 1} times ({type(e).__name__}: killed or out of memory)"
        return {"status": "failed", "result": "worker lost", "error": error}
