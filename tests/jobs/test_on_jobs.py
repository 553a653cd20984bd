"""`converter push --on-jobs` (and batch's) against the local Hub's Jobs API, through the real huggingface_hub client.

The local Hub runs a job's command as a subprocess of this test process, so a stand-in `uvx` first on this process's
PATH is what the job runs: it checks the command it was given and runs this checkout's `converter` (with a gate, or a
sabotage, where a test asks for one). The job reads its base from the volume the local Hub materialised (read-only),
and its token only from its HF_TOKEN secret.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from model_helpers import make_adapter, make_base

from converter.outcome import Outcome, Verdict, last_outcome
from converter.testing.hub import HubServer, client_env

ALICE = "hf_jobs_alice_secret_0123456789"
FRANK = "hf_jobs_frank_secret_0123456789"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hub")
    server = HubServer(root / "server", jobs=True).start()
    server.add_user("alice", ALICE)
    server.add_user("frank", FRANK, can_pay=False)
    tiny = make_base(root / "tiny", "llama", dtype=torch.bfloat16)
    base = root / "base"
    AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).save_pretrained(base, max_shard_size="40KB")
    server.seed_folder("alice/sharded", base)
    server.seed_folder("alice/lora", make_adapter(base, root / "lora", r=4, lora_alpha=8))
    server.shards = sorted(base.glob("*.safetensors"))
    yield server
    server.stop()


def stand_in_uvx(tmp_path: Path, monkeypatch, prelude: str = "") -> Path:
    """A `uvx` that runs `converter ARGS` from this checkout (after `prelude`), first on the jobs' PATH; each call's
    arguments are appended to the returned file."""
    folder = tmp_path / "bin"
    folder.mkdir()
    calls = tmp_path / "uvx-calls.jsonl"
    script = folder / "uvx"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        f"with open({str(calls)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'args': args, 'env': sorted(os.environ)}) + '\\n')\n"
        "assert args[0] == '--from' and args[2] == 'converter', args\n"
        f"{prelude}\n"
        "from converter.cli import main\n"
        "sys.exit(main(args[3:]))\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return calls


def gate(path: Path) -> str:
    """A prelude that holds the job until `path` exists."""
    return f"import time\nwhile not os.path.exists({str(path)!r}): time.sleep(0.05)"


SABOTAGE = """
from converter.engine import merging
real = merging.plan_merge
def one_module_left_unmerged(*args, **kwargs):
    plan, warnings, quantized = real(*args, **kwargs)
    next(o for o in plan.outputs if o.name == "model.layers.1.self_attn.v_proj.weight").patches.clear()
    return plan, warnings, quantized
merging.plan_merge = one_module_left_unmerged
"""


def command(repo: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "converter", "--json", "push", "--repo", repo, "--base", "alice/sharded",
            "--adapter", "alice/lora", "--max-shard-size", "40KB", "--on-jobs", *extra]  # fmt: skip


def env(hub: HubServer, tmp_path: Path, token: str = ALICE) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return client_env(hub, token, tmp_path / "home") | {"TMPDIR": str(tmp_path / "tmp"), "CONVERTER_HUB_RETRIES": "2"}


def submit(hub: HubServer, tmp_path: Path, repo: str, *extra: str, token: str = ALICE) -> tuple[int, Outcome, str]:
    proc = subprocess.run(command(repo, *extra), env=env(hub, tmp_path, token), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    return proc.returncode, last_outcome(proc.stdout), proc.stderr


def start(hub: HubServer, tmp_path: Path, repo: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(command(repo, *extra), env=env(hub, tmp_path), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def until(condition, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def jobs_for(hub: HubServer, repo: str) -> list:
    return [j for j in hub.jobs() if j.spec.labels.get("target") == repo.replace("/", "--")]


def followers(hub: HubServer, job_id: str) -> int:
    return sum(1 for s in hub.seen if s.method == "GET" and s.path.endswith(f"/{job_id}/logs"))


def test_a_push_on_jobs_publishes_and_its_outcome_comes_back(hub, tmp_path, monkeypatch):
    """Verified in the job, from the mounted base (nothing of it downloaded), recorded as org/name@sha; the token
    travels as the job's secret only: not in the spec, its command, env or labels, the job's log or the output."""
    calls = stand_in_uvx(tmp_path, monkeypatch)
    hub.reset_log()
    code, outcome, err = submit(hub, tmp_path, "alice/on-jobs")
    assert code == 0 and outcome.verdict is Verdict.PROVEN, hub.redact(err)
    published = outcome.publication
    assert published.repo_id == "alice/on-jobs" and published.commit == hub.head("alice/on-jobs")
    assert outcome.proofs.tensors.passed and outcome.proofs.behaviour.passed
    (job,) = jobs_for(hub, "alice/on-jobs")
    assert outcome.details["job"]["id"] == job.id and outcome.details["job"]["followed"] is False
    assert job.stage == "COMPLETED" and job.spec.flavor == "cpu-basic" and job.spec.timeout >= 900
    sha = hub.head("alice/sharded")
    volume = job.spec.volumes[0].spec
    assert volume == {"type": "model", "source": "alice/sharded", "mountPath": "/base", "revision": sha,
                      "readOnly": True}  # fmt: skip
    # converter from PyPI at this version, by uvx, the pinned sources, the base read from the mount
    from converter import __version__

    (call,) = [json.loads(line) for line in calls.read_text().splitlines()]
    assert call["args"][:3] == ["--from", f"converter=={__version__}", "converter"]
    args = call["args"][3:]
    assert args[args.index("--base") + 1] == f"alice/sharded@{sha}"
    assert args[args.index("--base-mounted") + 1] == str(job.volume_folder("/base"))
    assert args[args.index("--adapter") + 1] == f"alice/lora@{hub.head('alice/lora')}"
    labels = job.spec.labels
    assert labels["base"] == sha and labels["adapter-1"] == hub.head("alice/lora")
    assert labels["target"] == "alice--on-jobs" and len(labels["options"]) == 16
    # the base was mounted, not downloaded: its weight files were read by Range for their headers only
    for shard in hub.shards:
        reads = [s for s in hub.seen if s.method == "GET" and s.path.endswith(f"/alice/sharded/resolve/{sha}/"
                                                                               f"{shard.name}")]  # fmt: skip
        assert all(s.range for s in reads), shard.name
    provenance = json.loads(hub.read_file("alice/on-jobs", "converter_provenance.json"))
    assert (provenance["base"]["repo_id"], provenance["base"]["revision"]) == ("alice/sharded", sha)
    recorded = {f["name"]: f["sha256"] for f in provenance["base"]["files"]}
    assert recorded == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in hub.shards}
    assert f"base: alice/sharded@{sha}" in hub.read_file("alice/on-jobs", "converter_recipe.yaml").decode()
    # the token: the secret of the job only
    assert job.spec.secrets == {"HF_TOKEN": ALICE} and "HF_TOKEN" in call["env"]
    shown = json.dumps(job.to_json()) + "\n".join(text for _, text in job.lines) + outcome.to_json() + err
    assert ALICE not in shown and ALICE not in json.dumps(job.spec.environment)


def test_the_dry_run_prints_the_spec_with_the_secrets_name_only_and_submits_nothing(hub, tmp_path, monkeypatch):
    stand_in_uvx(tmp_path, monkeypatch)
    hub.reset_log()
    code, outcome, err = submit(hub, tmp_path, "alice/dry", "cpu-upgrade", "--dry-run", "--no-verify")
    assert code == 0 and outcome.verdict is Verdict.NOT_VERIFIED and not outcome.proof_asked, err
    spec = outcome.details["job"]["spec"]
    assert spec["secrets"] == ["HF_TOKEN"] and spec["flavor"] == "cpu-upgrade" and spec["namespace"] == "alice"
    assert spec["command"][:4] == ["uvx", "--from", spec["command"][2], "converter"]
    assert "--no-verify" in spec["command"] and ALICE not in json.dumps(spec)
    assert spec["volumes"] == [{"type": "model", "source": "alice/sharded", "mount_path": "/base",
                                "revision": hub.head("alice/sharded")}]  # fmt: skip
    estimate = outcome.details["job"]["estimate"]
    assert estimate["fits"] and estimate["machine"]["name"] == "cpu-upgrade" and estimate["usd"] > 0
    assert ALICE not in outcome.to_json() + err
    assert not [s for s in hub.seen if s.method == "POST" and s.path.startswith("/api/jobs/")]
    assert not jobs_for(hub, "alice/dry")


def test_a_free_account_is_refused_before_submitting(hub, tmp_path, monkeypatch):
    stand_in_uvx(tmp_path, monkeypatch)
    hub.reset_log()
    code, outcome, err = submit(hub, tmp_path, "frank/merged", "--no-verify", token=FRANK)
    assert code == 2 and outcome.error.type == "JobsUnavailable" and outcome.error.fields["namespace"] == "frank"
    assert "PRO" in outcome.reason and "Traceback" not in err
    assert not [s for s in hub.seen if s.method == "POST" and s.path.startswith("/api/jobs/")]


def test_a_sabotaged_merge_on_jobs_fails_there_and_publishes_nothing(hub, tmp_path, monkeypatch):
    """One module left unmerged in the job: its per-shard proof stops the push there (exit 3), and the submitting
    side reads that outcome and exits 3 too; nothing is committed, no repo is left."""
    stand_in_uvx(tmp_path, monkeypatch, prelude=SABOTAGE)
    code, outcome, err = submit(hub, tmp_path, "alice/sabotaged", "--weight", "0.9")
    assert code == 3 and outcome.verdict is Verdict.FAILED, hub.redact(err)
    assert outcome.error.type == "VerificationFailed" and not outcome.published
    assert "model.layers.1.self_attn.v_proj.weight" in outcome.reason  # the tensor the job's proof named
    assert not hub.exists("alice/sabotaged")
    (job,) = jobs_for(hub, "alice/sabotaged")
    assert job.stage == "ERROR" and job.returncode == 3 and outcome.details["job"]["stage"] == "ERROR"


def test_the_same_job_submitted_twice_follows_the_first(hub, tmp_path, monkeypatch):
    go = tmp_path / "go"
    stand_in_uvx(tmp_path, monkeypatch, prelude=gate(go))
    first = start(hub, tmp_path, "alice/twice", "--no-verify")
    job = until(lambda: next(iter(jobs_for(hub, "alice/twice")), None), "the first job")
    until(lambda: job.stage == "RUNNING" and followers(hub, job.id) >= 1, "the first submitter to follow")
    second = start(hub, tmp_path, "alice/twice", "--no-verify")
    until(lambda: followers(hub, job.id) >= 2, "the second submitter to follow")
    go.touch()
    outcomes = []
    for proc in (first, second):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, hub.redact(err)
        outcomes.append(last_outcome(out))
    assert [o.details["job"]["id"] for o in outcomes] == [job.id, job.id]
    assert [o.details["job"]["followed"] for o in outcomes] == [False, True]
    assert len(jobs_for(hub, "alice/twice")) == 1 and len(hub.history("alice/twice")) == 2
    assert outcomes[1].publication.commit == hub.head("alice/twice")


def test_ctrl_c_asks_whether_to_cancel_the_job(hub, tmp_path, monkeypatch):
    """Answered no: the job goes on (and a second submission follows it); answered yes: it is canceled. Both exit
    130; nothing is published."""
    stand_in_uvx(tmp_path, monkeypatch, prelude=gate(tmp_path / "never"))
    outcomes = []
    for answer in ("n\n", "y\n"):
        proc = start(hub, tmp_path, "alice/interrupted", "--no-verify")
        job = until(lambda: next(iter(jobs_for(hub, "alice/interrupted")), None), "the job")
        n = len(outcomes) + 1  # the second run follows the same job
        until(lambda j=job, n=n: j.stage == "RUNNING" and followers(hub, j.id) >= n, "following")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(answer, timeout=60)
        assert proc.returncode == 130, hub.redact(err)
        outcomes.append(last_outcome(out))
        if answer.startswith("n"):
            time.sleep(0.5)
            assert job.stage == "RUNNING"
    assert [o.verdict for o in outcomes] == [Verdict.INTERRUPTED, Verdict.INTERRUPTED]
    assert [o.error.fields["canceled"] for o in outcomes] == [False, True]
    assert outcomes[0].error.fields["job_id"] == outcomes[1].error.fields["job_id"] == job.id
    assert until(lambda: job.finished, "the cancel") and job.stage == "CANCELED"
    assert len(jobs_for(hub, "alice/interrupted")) == 1 and not hub.exists("alice/interrupted")


def test_a_push_that_cannot_fit_here_is_refused_naming_the_flavor(hub, tmp_path):
    """Refused before any weight is downloaded: exit 2, the flavor that fits, its time and cost."""
    hub.reset_log()
    args = ["--json", "push", "--repo", "alice/too-big", "--base", "alice/sharded", "--adapter", "alice/lora",
            "--max-disk", "20KB"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "converter", *args], env=env(hub, tmp_path), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    outcome = last_outcome(proc.stdout)
    assert proc.returncode == 2 and outcome.error.type == "DoesNotFit", proc.stderr
    fields = outcome.error.fields
    assert fields["flavor"] == "cpu-basic" and fields["disk"] > fields["free"] == 20_000 and fields["usd"] > 0
    assert outcome.reason.endswith("add --on-jobs cpu-basic") and "Traceback" not in proc.stderr
    for shard in hub.shards:  # its headers were read (two ranged reads each), its data never
        reads = [s for s in hub.seen if s.method == "GET" and s.path.endswith(f"/{shard.name}")]
        assert len(reads) <= 2 and all(s.range for s in reads), (shard.name, reads)
    assert not [s for s in hub.seen if "/api/repos/create" in s.path] and not hub.exists("alice/too-big")


def test_batch_on_jobs_sends_each_merge_as_its_own_job(hub, tmp_path, monkeypatch):
    """The Ray task of a merge item, with --on-jobs, submits that item as a Job and returns the Job's outcome:
    one Job per item (each its own flavor, labels and mounted base)."""
    stand_in_uvx(tmp_path, monkeypatch)
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        "defaults:\n  base: alice/sharded\n  verify: false\n  max_shard_size: 40KB\n"
        "jobs:\n  - merge: alice/batch-one\n    adapters: [alice/lora]\n"
        "  - merge: alice/batch-two\n    adapters: [alice/lora]\n    weights: [0.5]\n"
    )
    code = f"""
import json
from converter.batch.job_list import load_jobs
from converter.batch.run import run_job
print(json.dumps([run_job(job, None, "auto") for job in load_jobs({str(jobs)!r})]))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=env(hub, tmp_path), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, hub.redact(proc.stderr)
    rows = json.loads(proc.stdout.splitlines()[-1])
    assert [r["status"] for r in rows] == ["done", "done"] and [r["result"] for r in rows] == ["pushed", "pushed"]
    for repo, row in zip(("alice/batch-one", "alice/batch-two"), rows, strict=True):
        (job,) = jobs_for(hub, repo)
        assert job.stage == "COMPLETED" and row["url"].endswith(hub.head(repo))


SPACE = """
import json
from pathlib import Path
from converter.app.merge_job import JobRequest, run_job
from converter.errors import ConverterError
from converter.jobs.fit import Machine
small = Machine("a small Space", disk=1000, memory=10**10, cores=2, link=1e6)
out, lines = {{}}, []
for repo, on_jobs in {runs!r}:
    request = JobRequest(base="alice/sharded", adapters="alice/lora 0.8", repo_id=repo, on_jobs=on_jobs)
    try:
        r = run_job(request, {token!r}, workroot=Path({work!r}), machine=small, log=lines.append)
        out[repo] = dict(url=r.url, commit=r.commit, verdict=(r.report or {{}}).get("verdict"), card=r.card)
    except ConverterError as e:
        out[repo] = dict(error=type(e).__name__, flavor=getattr(e, "flavor", None))
print(json.dumps(dict(out, lines=lines)))
"""


def space(hub: HubServer, tmp_path: Path, runs: list[tuple[str, bool]]) -> dict:
    code = SPACE.format(runs=runs, token=ALICE, work=str(tmp_path / "work"))
    proc = subprocess.run([sys.executable, "-c", code], env=env(hub, tmp_path), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, hub.redact(proc.stderr)
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_space_offers_jobs_for_a_model_too_big_for_it(hub, tmp_path, monkeypatch):
    """On a Space too small for the model: refused up front naming the flavor; with 'Run on Hugging Face Jobs' the
    same merge runs as the user's Job, its log in the page, its verification and card read back from the repo. A
    sabotaged merge sent that way publishes nothing."""
    stand_in_uvx(tmp_path, monkeypatch)
    out = space(hub, tmp_path, [("alice/space-refused", False), ("alice/space-jobs", True)])
    assert out["alice/space-refused"] == {"error": "DoesNotFit", "flavor": "cpu-basic"}
    done = out["alice/space-jobs"]
    assert done["commit"] == hub.head("alice/space-jobs") and done["verdict"] == "pass", out
    assert "alice/space-jobs" in done["card"] and not hub.exists("alice/space-refused")
    (job,) = jobs_for(hub, "alice/space-jobs")
    assert "--verify" in job.spec.command and any("submitted: " in line for line in out["lines"])
    assert any(line.startswith("merging 1 adapter(s)") for line in out["lines"])  # the Job's own log, streamed
    assert ALICE not in json.dumps(out) and ALICE not in json.dumps(job.to_json())

    sabotaged = tmp_path / "sabotaged"
    sabotaged.mkdir()
    stand_in_uvx(sabotaged, monkeypatch, prelude=SABOTAGE)
    out = space(hub, sabotaged, [("alice/space-sabotaged", True)])
    assert out["alice/space-sabotaged"]["error"] == "VerificationFailed"
    assert not hub.exists("alice/space-sabotaged")


def test_a_push_dry_run_shows_the_needs_here_and_on_jobs_from_headers(hub, tmp_path):
    """`push --dry-run`: the plan and the estimates (here and on each flavor) as the outcome's details; nothing of
    the base's weights downloaded, no repo made."""
    hub.reset_log()
    args = ["--json", "push", "--repo", "alice/planned", "--base", "alice/sharded", "--adapter", "alice/lora",
            "--dry-run", "--link-rate", "10MB"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "converter", *args], env=env(hub, tmp_path), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    outcome = last_outcome(proc.stdout)
    assert proc.returncode == 0 and not outcome.proof_asked, proc.stderr
    fit = outcome.details["fit"]
    here, jobs = fit["here"], fit["jobs"]
    assert here["fits"] and here["streamed"] and here["machine"]["name"] == "this machine"
    assert here["machine"]["link"] == 10e6 and here["download"] > sum(p.stat().st_size for p in hub.shards)
    assert [j["machine"]["name"] for j in jobs] == ["cpu-basic", "cpu-upgrade", "cpu-xl"]
    assert fit["hardware"] == "the Hub's hardware list" and fit["shape"]["weights"] > 0
    for shard in hub.shards:  # headers only
        reads = [s for s in hub.seen if s.method == "GET" and s.path.endswith(f"/{shard.name}")]
        assert len(reads) <= 2 and all(s.range for s in reads), (shard.name, reads)
    assert not hub.exists("alice/planned")
