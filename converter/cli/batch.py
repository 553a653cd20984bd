"""`converter batch`: its arguments and what the command prints. Ray is imported only when jobs run."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from converter.errors import UsageError
from converter.outcome import Outcome, Verdict


def add_parser(sub) -> None:
    b = sub.add_parser("batch", help="run many convert / merge / verify jobs on Ray (resumable, with a report)")
    b.add_argument("jobs", nargs="?", help="job list YAML (see docs/batch.md: the job list)")
    b.add_argument("--from-hub-search", metavar="TEXT",
                   help="build the job list from a Hub search instead: repos whose id contains TEXT")  # fmt: skip
    b.add_argument("--filter", action="append", default=[], metavar="TAG",
                   help="with --from-hub-search: only repos with this tag (repeatable), e.g. lora")  # fmt: skip
    b.add_argument("--limit", type=int, default=20, help="how many search results (default 20)")
    b.add_argument("--to", default="diffusers", choices=["peft", "diffusers", "kohya"],
                   help="target format of search-built convert jobs (default diffusers)")  # fmt: skip
    b.add_argument("--base", help="base model for search-built convert jobs (kohya names are looked up in it)")
    b.add_argument("--state", help="state file (default: JOBS.state.sqlite next to the job list)")
    b.add_argument("--report", help="Markdown report (default: JOBS.report.md next to the job list)")
    b.add_argument("--address", help="join this Ray cluster (ray://HOST:10001 or HOST:6379; default RAY_ADDRESS, "
                   "else start a local one)")  # fmt: skip
    b.add_argument("--num-cpus", type=int, help="CPUs of the local cluster (default: all of this machine)")
    b.add_argument("--cpus-per-job", type=float, default=1.0, help="CPUs each job reserves (default 1)")
    b.add_argument("--retries", type=int, default=3, help="retries per job for Hub faults and lost workers")
    b.add_argument("--job-timeout", type=float, help="seconds before a job is killed (default: none)")
    from converter.cli.on_jobs import add_jobs_options

    add_jobs_options(b, batch=True)
    b.add_argument(
        "--token-in-runtime-env",
        action="store_true",
        help="send HF_TOKEN to an existing cluster's workers in Ray's runtime_env (Ray logs it there)",
    )


def run_cli(args: argparse.Namespace, log: Callable[[str], None] = print) -> Outcome:
    from converter.batch import job_list as joblist
    from converter.io.optional import require

    require("ray", "converter batch")  # before a job list, a state file or a report is written

    searching = args.from_hub_search is not None
    if bool(args.jobs) == searching:
        raise UsageError("give a job list JOBS.yaml or --from-hub-search TEXT (one of them)")
    if searching:
        if args.limit < 1:
            raise UsageError(f"--limit {args.limit}: give a positive number")
        jobs = joblist.jobs_from_search(
            args.from_hub_search, args.limit, filters=args.filter, to=args.to, base=args.base
        )
        if not jobs:
            raise UsageError(f"the Hub search {args.from_hub_search!r} found no models")
        stem = Path(args.state or "batch").with_suffix("")
        jobs_file = stem.with_name(stem.name + ".jobs.yaml")
        joblist.write_jobs(jobs, jobs_file)
        log(f"{len(jobs)} jobs from the search, saved to {jobs_file} (re-run with that file to resume)")
    else:
        jobs_file = Path(args.jobs)
        jobs = joblist.load_jobs(jobs_file)
    state = Path(args.state) if args.state else jobs_file.with_suffix(".state.sqlite")
    report_path = Path(args.report) if args.report else jobs_file.with_suffix(".report.md")
    from converter.batch import report
    from converter.batch.run import run_batch
    from converter.batch.state import State

    _, skipped, elapsed = run_batch(
        jobs, state, address=args.address, num_cpus=args.num_cpus, cpus_per_job=args.cpus_per_job,
        retries=args.retries, job_timeout=args.job_timeout, token_in_runtime_env=args.token_in_runtime_env,
        on_jobs=args.on_jobs, log=log,
    )  # fmt: skip
    db = State(state)
    try:
        rows = db.rows([j.id for j in jobs])
    finally:
        db.close()
    report.write_markdown(report_path, report.markdown(rows, set(skipped), elapsed))
    log(report.terminal(rows, set(skipped)))
    log(f"report: {report_path}  state: {state}")
    return _outcome(rows, set(skipped), report_path, state)


def _outcome(rows: list, skipped: set[str], report_path: Path, state: Path) -> Outcome:
    """Failed when some job failed (exit 4: converter.outcome); proven when every job's own verdict is; else done
    with jobs that prove nothing (conversions found done already, --no-verify merges), which is no failure."""
    from converter.batch import report

    details = {"jobs": len(rows), **report.counts(rows, skipped), "report": str(report_path), "state": str(state)}
    done = {"out": str(report_path), "files": (str(report_path), str(state)), "details": details}
    failed = [r for r in rows if r.status != "done"]
    if failed:
        return Outcome("batch", Verdict.FAILED, f"{len(failed)} of {len(rows)} jobs failed: {failed[0].id}: "
                       f"{failed[0].error or failed[0].result}", **done)  # fmt: skip
    unproven = [r for r in rows if r.verdict != Verdict.PROVEN]
    if unproven:
        reason = f"{len(unproven)} of {len(rows)} jobs proved nothing ({unproven[0].id}: {unproven[0].verdict})"
        return Outcome("batch", Verdict.NOT_VERIFIED, reason, proof_asked=False, **done)
    return Outcome("batch", Verdict.PROVEN, **done)
