"""The job list: a YAML file, or a Hub search, turned into `Job`s with stable ids and the CLI arguments each runs.

Why stable ids: the state file keys on them, so a re-run of the same list skips what is done. The id comes from
what the job does (kind, sources, target), not from its position in the file, so reordering or appending jobs keeps
the work already done.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from converter.errors import ConverterError, RecipeError
from converter.hub import client as hub
from converter.io.units import parse_size

KINDS = ("convert", "merge", "verify")
#: Options a job may carry, per kind (anything else is a typo and refused).
_OPTIONS = {
    "convert": {"to", "base", "component", "rank", "allow_pickle"},
    "merge": {
        "base",
        "adapter",
        "adapters",
        "weights",
        "dtype",
        "create_pr",
        "overwrite",
        "private",
        "verify",
        "max_shard_size",
    },
    "verify": {"base"},
}
_COMMON = {"id", "timeout", "memory"}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[^/\s]+)?(/.+)?$")


@dataclass
class Job:
    """One unit of work: `kind` is convert / merge / verify, `target` the adapter (convert), the repo to push
    (merge) or the model to check (verify)."""

    kind: str
    target: str
    options: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    timeout: float | None = None
    memory: int | None = None

    def __post_init__(self) -> None:
        if not self.id:
            canonical = json.dumps([self.kind, self.target, self.options], sort_keys=True)
            name = re.sub(r"[^\w.-]+", "-", self.target).strip("-")[:60]
            self.id = f"{self.kind}-{name}-{hashlib.sha256(canonical.encode()).hexdigest()[:8]}"

    def sources(self) -> list[str]:
        """Every Hub or local source the job reads (their commits go into the report)."""
        if self.kind == "convert":
            return [self.target]
        if self.kind == "merge":
            return [self.options["base"], *self.adapters()]
        return [self.target]

    def adapters(self) -> list[str]:
        one = self.options.get("adapter")
        return [one] if one else list(self.options.get("adapters") or [])

    def argv(self, pinned: dict[str, str] | None = None) -> list[str]:
        """The `converter ...` arguments; `pinned` maps a source to the same source at a resolved commit. A token
        is never an argument: the child reads HF_TOKEN from its environment."""
        pin = (pinned or {}).get
        o = self.options
        if self.kind == "convert":
            args = ["convert", "--adapter", pin(self.target, self.target), "--to", o.get("to", "diffusers"),
                    "--push-pr"]  # fmt: skip
            for key in ("base", "component", "rank"):
                if o.get(key) is not None:
                    args += [f"--{key}", str(o[key])]
            return args + (["--allow-pickle"] if o.get("allow_pickle") else [])
        if self.kind == "merge":
            args = ["push", "--repo", self.target, "--base", pin(o["base"], o["base"])]
            for a in self.adapters():
                args += ["--adapter", pin(a, a)]
            for w in o.get("weights") or []:
                args += ["--weight", str(w)]
            for key in ("dtype", "max_shard_size"):
                if o.get(key):
                    args += [f"--{key.replace('_', '-')}", str(o[key])]
            for flag in ("create_pr", "overwrite", "private"):
                if o.get(flag):
                    args.append(f"--{flag.replace('_', '-')}")
            return args + ([] if o.get("verify", True) else ["--no-verify"])
        return ["verify", self.target] + (["--base", o["base"]] if o.get("base") else [])


def is_hub_id(source: str) -> bool:
    """`org/name[@rev][/file]` that is not an existing local path."""
    return bool(_HUB_ID.match(source)) and not Path(source).exists()


def load_jobs(path: str | Path) -> list[Job]:
    """Read a job list (docs/batch.md, "The job list"); every problem is a one-line error naming the job."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise RecipeError(f"{path}: cannot read the job list ({e.strerror})", file=path) from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({str(e).splitlines()[0]})", file=path) from None
    if isinstance(data, list):
        data = {"jobs": data}
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list) or not data["jobs"]:
        raise RecipeError(
            f"{path}: give a list of jobs under `jobs:` (each `convert:`, `merge:` or `verify:`)", file=path
        )
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise RecipeError(f"{path}: `defaults:` must be a mapping of options", file=path)
    jobs = [parse_job(entry, defaults, f"{path}: job {n}") for n, entry in enumerate(data["jobs"], 1)]
    seen: dict[str, int] = {}
    for n, job in enumerate(jobs, 1):
        if job.id in seen:
            raise RecipeError(
                f"{path}: job {n} is the same job as job {seen[job.id]} (id {job.id}); remove one", file=path
            )
        seen[job.id] = n
    return jobs


def parse_job(entry: Any, defaults: dict[str, Any], where: str) -> Job:
    if not isinstance(entry, dict):
        raise RecipeError(f"{where}: give a mapping such as `convert: org/lora`")
    kinds = [k for k in KINDS if k in entry]
    if len(kinds) != 1:
        raise RecipeError(f"{where}: give exactly one of convert:, merge:, verify: (got {sorted(entry)})")
    kind = kinds[0]
    allowed = _OPTIONS[kind] | _COMMON
    options = {k: v for k, v in defaults.items() if k in allowed}
    options.update({k: v for k, v in entry.items() if k != kind})
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise RecipeError(f"{where}: unknown option(s) {', '.join(unknown)} for a {kind} job")
    target = entry[kind]
    if not isinstance(target, str) or not target:
        raise RecipeError(f"{where}: `{kind}:` needs a repo id or path")
    job_id = str(options.pop("id", "") or "")
    timeout = options.pop("timeout", None)
    memory = options.pop("memory", None)
    if kind == "merge":
        if not options.get("base") or not (options.get("adapter") or options.get("adapters")):
            raise RecipeError(f"{where}: a merge job needs base: and adapter: (or adapters: [...])")
        if not _HUB_ID.match(target) or "@" in target:
            raise RecipeError(f"{where}: merge: names the repo to push to, namespace/name")
    if kind == "convert" and not is_hub_id(target):
        raise RecipeError(f"{where}: convert: needs the adapter as a Hub id org/name[/file] (its PR goes there)")
    try:
        memory_bytes = parse_size(str(memory)) if memory is not None else None
    except (ValueError, ConverterError):
        raise RecipeError(f"{where}: memory: {memory!r} is not a size such as 8GB") from None
    return Job(kind, target, options, id=job_id, timeout=float(timeout) if timeout else None, memory=memory_bytes)


def jobs_from_search(
    query: str,
    limit: int,
    *,
    filters: list[str] | None = None,
    to: str = "diffusers",
    base: str | None = None,
    api: Any = None,
) -> list[Job]:
    """A convert job per model the Hub's search returns, most downloaded first: `HfApi.list_models` with
    `search` (text contained in the repo id) and `filter` (tags, e.g. `lora`, `base_model:org/name`)."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    options: dict[str, Any] = {"to": to} | ({"base": base} if base else {})

    kwargs: dict[str, Any] = {"search": query or None, "limit": limit, "sort": "downloads"}
    if filters:
        kwargs["filter"] = list(filters)
    models = hub.call(f"search {query!r}", lambda: list(api.list_models(**kwargs)))
    return [Job("convert", m.id, dict(options)) for m in models]


def write_jobs(jobs: list[Job], path: str | Path) -> None:
    """Save a job list (e.g. one built from a search) so the same batch can be resumed from the file."""
    entries = []
    for job in jobs:
        entry: dict[str, Any] = {job.kind: job.target, **job.options}
        if job.timeout:
            entry["timeout"] = job.timeout
        entries.append(entry)
    Path(path).write_text(yaml.safe_dump({"jobs": entries}, sort_keys=False))
