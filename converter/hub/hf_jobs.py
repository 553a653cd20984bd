"""Hugging Face Jobs as converter uses them: the flavors and their prices, who may pay, one job submitted, found
again by its labels, followed, canceled.

Why a module of its own: this is the Hub's service and its rules, nothing of converter's job (that is
converter.jobs.remote). Every call goes through `hub.call` (retries, one-line errors), and the token is only ever
passed on as the job's secret: nothing returned here holds it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from converter.errors import ConverterError, HubError, JobsUnavailable
from converter.hub import client as hub
from converter.io.units import parse_size

#: Stages of a job that has not ended: a second submission of the same job follows it instead.
LIVE = ("SCHEDULING", "RUNNING")


@dataclass(frozen=True)
class Flavor:
    """A Jobs machine: vCPUs, memory and ephemeral disk in bytes (`disk` None: the Hub does not say), price."""

    name: str
    cpus: int
    memory: int
    disk: int | None
    usd_per_hour: float
    gpu: bool = False


#: The CPU flavors as the Hub's pricing page gave them in 2026, used when the hardware list cannot be read (no
#: network, an older Hub). The Hub's own list, read at run time, wins.
FALLBACK_FLAVORS = (
    Flavor("cpu-basic", 2, 16 * 10**9, 20 * 10**9, 0.01),
    Flavor("cpu-upgrade", 8, 32 * 10**9, None, 0.03),
    Flavor("cpu-xl", 16, 124 * 10**9, 10**12, 1.00),
)


@dataclass(frozen=True)
class Hardware:
    """The flavors on offer and where the list came from ("the Hub's hardware list" or "a built-in table")."""

    flavors: tuple[Flavor, ...]
    source: str

    def get(self, name: str) -> Flavor | None:
        return next((f for f in self.flavors if f.name == name), None)

    @property
    def cpu(self) -> list[Flavor]:
        """The flavors without a GPU, cheapest first: converter merges and proves on CPUs."""
        return sorted((f for f in self.flavors if not f.gpu), key=lambda f: (f.usd_per_hour, f.memory))


def hardware(token: str | None) -> Hardware:
    """The Hub's hardware list (`list_jobs_hardware`), or the built-in table when it cannot be read."""
    from huggingface_hub import HfApi

    try:
        listed = hub.call("the Jobs hardware list", lambda: HfApi(token=token).list_jobs_hardware())
    except ConverterError:
        return Hardware(FALLBACK_FLAVORS, "a built-in table (the Hub's hardware list could not be read)")
    known = {f.name: f for f in FALLBACK_FLAVORS}
    flavors = tuple(_flavor(entry, known.get(entry.name)) for entry in listed)
    return Hardware(flavors, "the Hub's hardware list")


def _flavor(entry, fallback: Flavor | None) -> Flavor:
    """A JobHardwareInfo as a Flavor; a field the Hub leaves out (storage, often) comes from the built-in table."""
    per_hour = {"second": 3600, "minute": 60, "hour": 1}.get(str(entry.unit_label).lower(), 60)
    disk = _size(entry.ephemeral_storage)
    return Flavor(
        name=entry.name,
        cpus=int(_number(entry.cpu) or (fallback.cpus if fallback else 1)),
        memory=_size(entry.ram) or (fallback.memory if fallback else 0),
        disk=disk if disk is not None else (fallback.disk if fallback else None),
        usd_per_hour=float(entry.unit_cost_usd) * per_hour,
        gpu=entry.accelerator is not None,
    )


def _number(text: str | None) -> float | None:
    m = re.search(r"[0-9.]+", text or "")
    return float(m[0]) if m else None


def _size(text: str | None) -> int | None:
    """'16 GB' -> bytes; None for 'N/A' or anything unreadable."""
    try:
        return parse_size(str(text).replace(" ", "")) if text and _number(text) is not None else None
    except ConverterError:
        return None


def check_can_pay(who: dict, namespace: str) -> None:
    """Jobs run for PRO users and organizations with credits: refuse, before submitting, a namespace that cannot
    pay (`who`: whoami's answer for the token). An organization whose credits whoami does not show is left to the
    Hub, whose refusal (402) says the same."""
    user = who.get("name")
    if namespace == user:
        if who.get("canPay") or who.get("isPro"):
            return
        raise JobsUnavailable(
            f"{user} cannot run Hugging Face Jobs: they need a PRO account or an organization with credits (upgrade "
            "to PRO, or run it under an organization: --jobs-namespace ORG)",
            namespace=namespace,
        )
    org = next((o for o in who.get("orgs") or [] if o.get("name") == namespace), None)
    if org is None:
        raise JobsUnavailable(
            f"{user} is not a member of {namespace!r}, so cannot run Hugging Face Jobs there (--jobs-namespace: "
            "your own name or one of your organizations)",
            namespace=namespace,
        )
    if org.get("canPay") is False:
        raise JobsUnavailable(
            f"the organization {namespace} has no credits for Hugging Face Jobs (add credits, or run it under "
            "another namespace: --jobs-namespace)",
            namespace=namespace,
        )


@dataclass(frozen=True)
class JobSpec:
    """What is sent to run one job. `secrets` holds the names of the secrets only: their values go to `submit`
    apart, so a spec can be printed (`--dry-run`) and logged."""

    image: str
    command: tuple[str, ...]
    flavor: str
    timeout: int  # seconds
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()
    volumes: tuple[dict, ...] = ()  # {"type", "source", "mount_path", "revision"}
    name: str | None = None

    def to_dict(self) -> dict:
        return {
            "image": self.image, "command": list(self.command), "flavor": self.flavor, "timeout": self.timeout,
            "namespace": self.namespace, "name": self.name, "labels": dict(self.labels), "env": dict(self.env),
            "secrets": list(self.secrets), "volumes": [dict(v) for v in self.volumes],
        }  # fmt: skip


@dataclass(frozen=True)
class Job:
    """A submitted job as the Hub reports it."""

    id: str
    url: str
    stage: str
    message: str | None = None
    flavor: str | None = None


def _job(info) -> Job:
    stage = getattr(info.status.stage, "value", info.status.stage)
    flavor = getattr(info.flavor, "value", info.flavor)
    return Job(info.id, info.url, str(stage), info.status.message, flavor)


def find_live(labels: dict[str, str], namespace: str, token: str | None) -> Job | None:
    """The newest job of `namespace` with all of `labels` that is still scheduling or running, or None."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    found = hub.call(
        "listing your Jobs",
        lambda: next(iter(api.list_jobs(status=list(LIVE), labels=labels, namespace=namespace)), None),
    )
    return _job(found) if found is not None else None


def submit(spec: JobSpec, secrets: dict[str, str], token: str | None) -> Job:
    """Run `spec` with `secrets` (values for the names in spec.secrets); a namespace that cannot pay is
    JobsUnavailable, as check_can_pay says before."""
    from huggingface_hub import HfApi, Volume

    if set(secrets) != set(spec.secrets):
        raise ValueError("the secrets given are not the ones the spec names")
    api = HfApi(token=token)
    volumes = [Volume(**v) for v in spec.volumes] or None
    try:
        info = hub.call(
            f"submitting the Job to {spec.namespace}",
            lambda: api.run_job(
                image=spec.image, command=list(spec.command), env=dict(spec.env) or None, secrets=secrets or None,
                flavor=spec.flavor, timeout=spec.timeout, name=spec.name, labels=dict(spec.labels) or None,
                volumes=volumes, namespace=spec.namespace,
            ),
        )  # fmt: skip
    except HubError as e:
        if e.status == 402:
            raise JobsUnavailable(
                f"{spec.namespace} cannot pay for Hugging Face Jobs: they need a PRO account or an organization with "
                "credits",
                namespace=spec.namespace,
            ) from None
        raise
    return _job(info)


def status(job_id: str, namespace: str, token: str | None) -> Job:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    return _job(hub.call(f"Job {job_id}", lambda: api.inspect_job(job_id=job_id, namespace=namespace)))


def follow(job_id: str, namespace: str, token: str | None) -> Iterator[str]:
    """The job's log lines as they are printed, until it ends (the client's SSE stream); a broken stream is a
    one-line HubError."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        yield from api.fetch_job_logs(job_id=job_id, namespace=namespace, follow=True)
    except ConverterError:
        raise
    except Exception as e:  # noqa: BLE001 - classified by hub.explain (a bug is raised as it is)
        raise hub.explain(f"the log of Job {job_id}", e) from None


def cancel(job_id: str, namespace: str, token: str | None) -> None:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    hub.call(f"canceling Job {job_id}", lambda: api.cancel_job(job_id=job_id, namespace=namespace))
