"""Where a merge or push runs: the options that say so, what `--dry-run` prints (the plan from headers, then the
disk, memory and time it needs next to what this machine, or each Hugging Face Jobs flavor, has), and
`push --on-jobs`, the same push submitted as a Job and followed from here."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from converter.errors import DoesNotFit, UsageError
from converter.outcome import Outcome


def add_fit_options(p: argparse.ArgumentParser) -> None:
    """The estimate's settings (merge and push)."""
    p.add_argument("--max-disk", metavar="SIZE",
                   help="the most scratch disk this job may use, e.g. 20GB (default: what is free where it writes); "
                   "a job that needs more is refused before anything is downloaded")  # fmt: skip
    p.add_argument("--link-rate", metavar="SIZE",
                   help="your link to the Hub per second, each way, for the time estimate (default 50MB, an "
                   "assumption; CONVERTER_LINK_RATE)")  # fmt: skip
    p.add_argument("--base-mounted", metavar="DIR",
                   help="the pinned Hub --base (org/name@sha) is already in DIR, as a Hugging Face Jobs volume mounts "
                   "it: read there, recorded as the Hub id")  # fmt: skip


def add_jobs_options(p: argparse.ArgumentParser, *, batch: bool = False) -> None:
    """--on-jobs [FLAVOR] and how the job is made (push; batch takes --on-jobs and passes it to each merge)."""
    what = "each merge job of the batch" if batch else "this push"
    p.add_argument("--on-jobs", nargs="?", const="auto", metavar="FLAVOR",
                   help=f"run {what} as a Hugging Face Job (PRO or an organization with credits) on FLAVOR (default: "
                   "the cheapest CPU flavor that fits the estimate), following its log here")  # fmt: skip
    if batch:
        return
    p.add_argument(
        "--jobs-namespace",
        metavar="NS",
        help="run and bill the Job under this organization (default: your user; CONVERTER_JOBS_NAMESPACE)",
    )
    p.add_argument(
        "--jobs-image", metavar="IMAGE", help="the Job's image (default: uv's Python image; CONVERTER_JOBS_IMAGE)"
    )
    p.add_argument("--jobs-from", metavar="SPEC",
                   help="what `uvx --from` installs in the Job (default: converter==THIS_VERSION; a wheel URL or "
                   "git+https://... work too; '-': the image has converter; CONVERTER_JOBS_FROM)")  # fmt: skip


def mount(args: argparse.Namespace, recipe) -> None:
    """--base-mounted: fetches of the pinned base read the folder (converter.hub.sources.use_mounted)."""
    if getattr(args, "base_mounted", None):
        from converter.hub.sources import use_mounted

        use_mounted(recipe.base, Path(args.base_mounted))


def max_disk(args: argparse.Namespace) -> int | None:
    from converter.io.units import parse_size

    return parse_size(args.max_disk) if getattr(args, "max_disk", None) else None


def check_merge_fits(args: argparse.Namespace, recipe, verify: dict | None) -> None:
    """A merge of a Hub base (or one given --max-disk) that cannot fit is refused before the download."""
    from converter.hub.sources import parse_source

    if parse_source(recipe.base).local is not None and not getattr(args, "max_disk", None):
        return  # a local base: the merge checks its output's room itself, and reads nothing to find out
    from converter.jobs.fit import check_here

    where = Path(recipe.out).resolve().parent if recipe.out else None
    check_here(recipe, verify, args.token, where, verb="merge", max_disk=max_disk(args), link=_link(args))


def _link(args: argparse.Namespace, *, jobs: bool = False) -> float:
    from converter.jobs.fit import link_rate

    return link_rate(None if jobs else getattr(args, "link_rate", None), jobs=jobs)


def dry_run(args: argparse.Namespace, recipe, verify: dict | None, verb: str, log: Callable[[str], None]) -> dict:
    """The plan (from the base's headers: nothing downloaded), then what the job needs here and, for a push, on each
    Jobs flavor; the estimates as data (the outcome's details["fit"])."""
    from converter.engine.merging import merge
    from converter.io.scratch import temp_folder
    from converter.jobs import fit
    from converter.jobs.shape import base_headers, shape_of

    token = args.token
    where = None
    if verb == "merge" and recipe.out:
        where = Path(recipe.out).resolve().parent
    with temp_folder("dryrun", log=lambda _line: None) as tmp:
        headers = base_headers(recipe.base, token, tmp / "base")
        merge(recipe, dry_run=True, token=token, log=log, base=headers.fetched)
        shape = shape_of(recipe, verify, token, tmp, headers)
    here = fit.estimate(shape, fit.here(where, link=_link(args), max_disk=max_disk(args)), verb)
    estimates = [here]
    hardware = None
    if verb == "push":
        from converter.hub.hf_jobs import hardware as jobs_hardware

        hardware = jobs_hardware(token)
        estimates += fit.on_jobs(shape, hardware, _link(args, jobs=True))
    log("where it would run (what it needs, next to what each machine has):")
    log(fit.table(estimates))
    if not here.fits:
        try:
            fit.require_fit(shape, here.machine, hardware, verb)
        except DoesNotFit as e:  # its line is the way out
            log(f"would be refused: {e}")
    return {"shape": shape.to_dict(), "here": here.to_dict(), "jobs": [e.to_dict() for e in estimates[1:]],
            "hardware": hardware.source if hardware else None}  # fmt: skip


def run_push(args: argparse.Namespace, recipe, options, log: Callable[[str], None]) -> Outcome:
    """`push --on-jobs [FLAVOR]`: plan the Job (or print its spec with --dry-run), then submit or follow it."""
    from converter.jobs import remote

    if args.from_folder or args.base_mounted:
        given = "--from" if args.from_folder else "--base-mounted"
        raise UsageError(f"--on-jobs merges Hub sources in the Job; {given} is for a machine that has the files")
    token = args.token or _saved_token()
    runner = remote.Runner.default(args.jobs_image, args.jobs_from)
    flavor = None if args.on_jobs == "auto" else args.on_jobs
    planned = remote.plan(args.repo, recipe, options, token, flavor=flavor, namespace=args.jobs_namespace,
                          runner=runner, link=_link(args, jobs=True))  # fmt: skip
    if args.dry_run:
        log(planned.summary())
        if not args.json:
            log(json.dumps(planned.spec.to_dict(), indent=2))
        from converter.cli.outcomes import not_asked

        return not_asked("push", "a dry run: nothing was submitted", details={"job": planned.to_dict()})
    return remote.run(planned, token, log=log)


def _saved_token() -> str:
    """HF_TOKEN or the cached login: the Job gets it as its secret, so it must exist now."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise UsageError("--on-jobs needs a Hugging Face token: pass --token, set HF_TOKEN or run `hf auth login`")
    return token
