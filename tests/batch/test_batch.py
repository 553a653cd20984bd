"""`converter batch` on a local Ray cluster (2 CPUs) against the local Hub: the real CLI as the driver in a
subprocess, joining the module's cluster; each job is the real `converter` CLI in a worker's subprocess.

One module-scoped cluster (Ray takes ~10 s and ~1 GB to start). The cluster's workers get the Hub settings and the
token from the environment the cluster was started in, like HF_TOKEN set on a real cluster's nodes.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from diffusion_helpers import TE_TARGETS, kohya_lora, kohya_modules, save, tiny_clip
from model_helpers import make_adapter, make_base

from converter.batch.job_list import Job, jobs_from_search, load_jobs
from converter.batch.run import STOP_ENV
from converter.cli import main
from converter.outcome import Outcome, Published, Verdict, last_outcome
from converter.testing.hub import HubServer, client_env, hub_env

BOB = "hf_fake_bob_batch_0123456789"  # recognisable: must appear in no argument, log, report or state file
ALICE = "hf_fake_alice_batch_0123456789"
GOOD = [f"alice/style-{i}" for i in range(8)]
KILLED = "merge-killed"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-hub")
    server = HubServer(root / "server").start()
    server.add_user("alice", ALICE)
    server.add_user("bob", BOB)
    clip = tiny_clip(24)
    clip.save_pretrained(root / "clip")
    modules = kohya_modules(clip, "lora_te", TE_TARGETS)
    for i, repo in enumerate(GOOD):
        save(kohya_lora(modules, rank=2, alpha=1.0, seed=i), root / repo / "style.safetensors")
        server.seed_folder(repo, root / repo)
    for repo in ("alice/flaky", "alice/slow"):
        save(kohya_lora(modules, rank=2, seed=50), root / repo / "style.safetensors")
        server.seed_folder(repo, root / repo)
    broken = save(kohya_lora(modules, rank=2, seed=99), root / "broken" / "style.safetensors")
    broken.write_bytes(broken.read_bytes()[:-100])  # truncated: the header promises more bytes than there are
    server.seed_folder("alice/broken-lora", broken.parent)
    base = make_base(root / "llama")
    server.seed_folder("alice/tiny-llama", base)
    server.seed_folder("alice/tiny-lora", make_adapter(base, root / "lora", r=4, lora_alpha=8))
    server.local = SimpleNamespace(clip=root / "clip")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(hub, tmp_path_factory):
    import ray

    root = tmp_path_factory.mktemp("ray")
    (root / "tmp").mkdir()
    sessions = Path(tempfile.mkdtemp(prefix="cvb-ray-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = hub_env(hub, BOB) | {"TMPDIR": str(root / "tmp"), "CONVERTER_HUB_RETRIES": "2", STOP_ENV: f"{KILLED}=staged"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the raylet and its workers keep the environment they started in
    try:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(sessions), logging_level=logging.WARNING)
        address = ray.get_runtime_context().gcs_address
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield SimpleNamespace(address=address, tmp=root / "tmp", logs=sessions)
    ray.shutdown()
    shutil.rmtree(sessions, ignore_errors=True)


def batch(hub, cluster, *args, wait: bool = True):
    cmd = [sys.executable, "-m", "converter", "batch", *map(str, args), "--address", cluster.address]
    kwargs = dict(env=client_env(hub, BOB), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return subprocess.Popen(cmd, **kwargs)
    proc = subprocess.run(cmd, timeout=900, **kwargs)
    return proc.returncode, proc.stdout, proc.stderr


def rows(state: Path) -> dict[str, dict]:
    db = sqlite3.connect(state)
    db.row_factory = sqlite3.Row
    try:
        return {r["id"]: dict(r) for r in db.execute("select * from jobs")}
    finally:
        db.close()


def assert_no_token(*texts: str, files: list[Path] = ()):
    for text in texts:
        assert BOB not in text
    for path in files:
        for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            assert BOB.encode() not in f.read_bytes(), f


def test_batch_opens_every_pr_fails_the_corrupt_one_alone_and_a_rerun_opens_none(hub, cluster, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(yaml.safe_dump({
        "defaults": {"to": "diffusers", "base": str(hub.local.clip), "component": "text_encoder"},
        "jobs": [{"convert": f"{r}/style.safetensors"} for r in [*GOOD, "alice/broken-lora"]],
    }))  # fmt: skip
    code, out, err = batch(hub, cluster, "--json", jobs)
    outcome = last_outcome(out)  # the human lines went to stderr
    assert code == outcome.exit_code == 4 and outcome.verdict is Verdict.FAILED, out + err  # some jobs failed
    assert (outcome.details["jobs"], outcome.details["done"], outcome.details["failed"]) == (9, 8, 1)
    state = rows(jobs.with_suffix(".state.sqlite"))
    for repo in GOOD:
        (pr,) = hub.repo(repo).discussions
        assert pr["isPullRequest"] and pr["author"] == "bob", pr
        assert "pytorch_lora_weights.safetensors" in hub.files(repo, revision="refs/pr/1")
        (row,) = [r for r in state.values() if r["target"] == f"{repo}/style.safetensors"]
        assert row["status"] == "done" and row["result"] == "PR opened" and row["verdict"] == "proven", row
        assert row["url"] == f"{hub.url}/{repo}/discussions/1"
        assert yaml.safe_load(row["sources"]) == {f"{repo}/style.safetensors": hub.head(repo)}  # source@sha
        assert row["peak_bytes"] > 10_000_000 and row["seconds"] > 0
    (broken,) = [r for r in state.values() if r["target"].startswith("alice/broken-lora")]
    assert broken["status"] == "failed" and hub.repo("alice/broken-lora").discussions == []
    assert "style.safetensors" in broken["error"] and "\n" not in broken["error"], broken["error"]
    assert "Traceback" not in broken["error"]
    report = jobs.with_suffix(".report.md").read_text()
    assert "9 jobs: 8 done, 1 failed, 0 skipped" in report and report.count(hub.head(GOOD[0])[:10]) == 1
    assert all(r["id"] in report and r["id"] in err for r in state.values())

    code, out2, err2 = batch(hub, cluster, "--json", jobs)  # re-run: the done jobs are skipped, the failed one retried
    again = last_outcome(out2)
    assert code == again.exit_code == 4 and (again.details["skipped"], again.details["failed"]) == (8, 1), out2 + err2
    assert all(len(hub.repo(r).discussions) == 1 for r in GOOD)
    again = rows(jobs.with_suffix(".state.sqlite"))
    assert again[broken["id"]]["attempts"] == 2 and again[broken["id"]]["status"] == "failed"
    assert all(again[i]["attempts"] == 1 for i in state if i != broken["id"])
    assert "9 jobs: 0 done, 1 failed, 8 skipped" in jobs.with_suffix(".report.md").read_text()
    assert_no_token(out, err, out2, err2, files=[tmp_path, cluster.logs, cluster.tmp])


def _stopped_child(timeout: float = 600) -> int:
    """The pid of the job's child that stopped itself at the test point (its parent is the Ray worker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                if not proc.name.isdigit() or b"CONVERTER_TEST_STOP=staged" not in (proc / "environ").read_bytes():
                    continue
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                    return int(proc.name)
            except OSError:
                continue
        time.sleep(0.5)
    raise AssertionError("the job never reached the stop point")


def test_a_killed_worker_is_retried_and_leaves_no_half_made_repo(hub, cluster, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(yaml.safe_dump({"jobs": [
        {"merge": "bob/merged", "id": KILLED, "base": "alice/tiny-llama", "adapter": "alice/tiny-lora"},
    ]}))  # fmt: skip
    driver = batch(hub, cluster, jobs, wait=False)
    try:
        child = _stopped_child()
        worker = int((Path("/proc") / str(child) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        title = (Path("/proc") / str(worker) / "cmdline").read_bytes()
        assert title.startswith(f"ray::converter-batch:{KILLED}".encode())  # the Ray worker running the task
        # merged and staged, nothing committed: shards may be on their way up (a pipelined push creates the repo
        # for them), but the repo holds no model until the one commit at the end
        assert not hub.exists("bob/merged") or "model.safetensors" not in hub.files("bob/merged")
        owned = [p.name for p in cluster.tmp.iterdir() if f".{child}-" in p.name or f".{worker}-" in p.name]
        assert any(f".{worker}-" in p for p in owned) and any(f"push.{child}-" in p for p in owned), owned
        os.kill(worker, signal.SIGKILL)  # the Ray worker dies mid-job (as under the OOM killer)
        for _ in range(100):  # its child dies with it instead of running on unowned
            if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the job's process outlived its worker")
        out, err = driver.communicate(timeout=900)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, out + err
    (row,) = rows(jobs.with_suffix(".state.sqlite")).values()
    assert row["status"] == "done" and row["result"] == "pushed" and row["verdict"] == "proven", row
    files = hub.files("bob/merged")
    assert {"model.safetensors", "config.json", "README.md", "converter_recipe.yaml"} <= set(files), files
    uploads = [c for c in hub.history("bob/merged") if "converter" in c.title]
    assert len(uploads) == 1 and row["url"].endswith(uploads[0].sha)
    assert not [p for p in owned if (cluster.tmp / p).exists()]  # the killed attempt's folders: swept by the retry
    assert_no_token(out, err, files=[tmp_path])

    jobs.write_text(yaml.safe_dump({"jobs": [  # the same list plus a verification of what it pushed
        {"merge": "bob/merged", "id": KILLED, "base": "alice/tiny-llama", "adapter": "alice/tiny-lora"},
        {"verify": "bob/merged"},
    ]}))  # fmt: skip
    code, out, err = batch(hub, cluster, jobs)
    assert code == 0 and "1 job(s) already done (skipped); 1 to run" in out, out + err
    verify = [r for r in rows(jobs.with_suffix(".state.sqlite")).values() if r["kind"] == "verify"]
    assert [(r["status"], r["result"], r["verdict"]) for r in verify] == [("done", "verified", "proven")], verify
    assert yaml.safe_load(verify[0]["sources"]) == {"bob/merged": hub.head("bob/merged")}


def test_hub_faults_beyond_the_clis_retries_are_retried_by_ray_and_a_slow_job_times_out(hub, cluster, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(yaml.safe_dump({
        "defaults": {"to": "diffusers", "base": str(hub.local.clip), "component": "text_encoder"},
        "jobs": [{"convert": "alice/flaky/style.safetensors"},
                 {"convert": "alice/slow/style.safetensors", "timeout": 1}],
    }))  # fmt: skip
    # 503 on resolving the adapter's commit: more than one attempt's 2 tries (CONVERTER_HUB_RETRIES) can absorb,
    # even if the driver's size look-up takes one of them
    fault = hub.inject("GET", r"^/api/models/alice/flaky/revision/", status=503, times=4)
    code, out, err = batch(hub, cluster, jobs)
    assert code == 4, out + err
    assert fault.hits == 4
    state = {r["target"].split("/")[1]: r for r in rows(jobs.with_suffix(".state.sqlite")).values()}
    assert state["flaky"]["status"] == "done" and len(hub.repo("alice/flaky").discussions) == 1, state["flaky"]
    assert state["slow"]["status"] == "failed" and state["slow"]["result"] == "timed out", state["slow"]
    assert "timed out after 1 s" in state["slow"]["error"] and hub.repo("alice/slow").discussions == []
    running = [p for p in Path("/proc").glob("[0-9]*/cmdline") if b"alice/slow" in _read(p)]
    assert running == []  # the timed-out job's process group was killed


def test_a_jobs_row_is_read_from_its_outcome_not_its_prose():
    """What the runner records comes from the child's `--json` outcome: the link, whether anything changed, the
    verdict, and whether a failure was the Hub's (HubError.transient, which Ray retries); no outcome: its stderr."""
    from converter.batch.run import _read_outcome
    from converter.errors import HubError

    merge, convert = Job("merge", "me/out", {"base": "a/b", "adapter": "c/d"}), Job("convert", "a/b/x.safetensors")
    url = "https://hub/me/out"

    def read(outcome: Outcome, job: Job = merge, stderr: str = "") -> dict:
        return _read_outcome(job, outcome.exit_code, "a human line\n" + outcome.to_json() + "\n", stderr, None)

    pushed = Outcome("push", Verdict.PROVEN, published=(Published("me/out", url, "abc"),))
    assert read(pushed) == {"status": "done", "verdict": "proven", "result": "pushed", "url": f"{url}/commit/abc"}
    same = Outcome("push", Verdict.PROVEN, published=(Published("me/out", url, "abc", changed=False),))
    assert read(same)["result"] == "unchanged" and read(same)["url"] == url
    pr = Published("a/b", "https://hub/a/b", "def", "https://hub/a/b/discussions/3", pr_updated=True)
    updated = read(Outcome("convert", Verdict.PROVEN, published=(pr,)), convert)
    assert (updated["result"], updated["url"]) == ("PR updated", pr.pr_url)
    had = Outcome("convert", Verdict.NOT_VERIFIED, "has it", proof_asked=False, details={"existing": "x.safetensors"})
    assert read(had, convert) == {"status": "done", "verdict": "not verified", "result": "already converted"}
    down = read(Outcome.failure("push", HubError("the Hub said 503", repo_id="me/out", status=503, reason="server")))
    assert down["status"] == "failed" and down["transient"] and down["error"] == "the Hub said 503"
    gone = read(Outcome.failure("push", HubError("me/out: not found", repo_id="me/out", reason="repo-not-found")))
    assert gone["result"] == "error" and not gone["transient"]
    unproven = read(Outcome("push", Verdict.NOT_VERIFIED, "no referee"))
    assert (unproven["status"], unproven["result"], unproven["error"]) == ("failed", "not verified", "no referee")
    died = _read_outcome(merge, 1, "", "Traceback ...\nMemoryError\n", None)
    assert died == {"status": "failed", "result": "crashed", "error": "MemoryError"}


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_job_list_mistakes_are_one_line_errors(tmp_path, capsys):
    cases = {
        "jobs: [": "not valid YAML",
        "jobs: []": "give a list of jobs",
        "jobs: [{convert: a/b, colour: red}]": "job 1: unknown option(s) colour for a convert job",
        "jobs: [{merge: me/out, base: a/b}]": "job 1: a merge job needs base: and adapter:",
        "jobs: [{convert: a/b}, {convert: a/b}]": "job 2 is the same job as job 1",
        "jobs: [{convert: a/b, verify: c/d}]": "exactly one of convert:, merge:, verify:",
        "jobs: [{convert: a/b, memory: lots}]": "memory: 'lots' is not a size",
    }
    for text, message in cases.items():
        (tmp_path / "jobs.yaml").write_text(text)
        assert main(["batch", str(tmp_path / "jobs.yaml")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "jobs.yaml" in err, err
    assert main(["batch"]) == 2 and "give a job list" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.sqlite"))  # nothing written for a list that does not load


def test_joining_a_cluster_without_ray_client_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("ray")
    if __import__("importlib").util.find_spec("grpc") is not None:
        pytest.skip("ray[client] is installed here; this checks the message of a minimal install")
    (tmp_path / "jobs.yaml").write_text("jobs: [{convert: a/b}]")
    assert main(["batch", str(tmp_path / "jobs.yaml"), "--address", "ray://127.0.0.1:10001"]) == 2
    err = capsys.readouterr().err
    assert "cannot join the Ray cluster at ray://127.0.0.1:10001" in err and "ray[client]" in err, err
    assert err.count("\n") == 1 and not list(tmp_path.glob("*.sqlite"))  # no state file from a batch that never ran


def test_job_ids_are_stable_and_arguments_carry_no_token(tmp_path):
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump({"defaults": {"to": "peft"}, "jobs": [
        {"convert": "a/b/x.safetensors"},
        {"merge": "me/out", "base": "a/base", "adapters": ["a/l1", "a/l2"], "weights": [0.7, 0.3], "create_pr": True},
    ]}))  # fmt: skip
    first, second = load_jobs(tmp_path / "jobs.yaml")
    again = load_jobs(tmp_path / "jobs.yaml")
    assert [first.id, second.id] == [j.id for j in again] and first.id != second.id
    assert first.argv({"a/b/x.safetensors": "a/b@abc/x.safetensors"}) == [
        "convert", "--adapter", "a/b@abc/x.safetensors", "--to", "peft", "--push-pr"]  # fmt: skip
    assert second.argv() == ["push", "--repo", "me/out", "--base", "a/base", "--adapter", "a/l1", "--adapter", "a/l2",
                             "--weight", "0.7", "--weight", "0.3", "--create-pr"]  # fmt: skip
    assert not any("token" in a or a.startswith("hf_") for a in first.argv() + second.argv())


def test_hub_search_gives_one_convert_job_per_model():
    """The search call is HfApi.list_models (the local Hub serves no search; this stands in for the client)."""
    calls = []

    class Api:
        def list_models(self, **kwargs):
            calls.append(kwargs)
            return [SimpleNamespace(id="a/flux-lora"), SimpleNamespace(id="b/other-lora")]

    jobs = jobs_from_search("flux", 2, filters=["lora"], to="diffusers", base="org/flux", api=Api())
    assert calls == [{"search": "flux", "limit": 2, "sort": "downloads", "filter": ["lora"]}]
    assert [(j.kind, j.target, j.options) for j in jobs] == [
        ("convert", "a/flux-lora", {"to": "diffusers", "base": "org/flux"}),
        ("convert", "b/other-lora", {"to": "diffusers", "base": "org/flux"}),
    ]
    assert isinstance(jobs[0], Job)


def test_memory_reserved_per_job_follows_the_base_size(tmp_path):
    from converter.batch.run import CONVERT_BYTES, PROCESS_BYTES, estimate_memory

    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"\0" * 3000)
    merge = Job("merge", "me/out", {"base": str(base), "adapter": "a/b"})
    assert estimate_memory(merge) == PROCESS_BYTES + 2 * 3000  # one float32 copy of a 16-bit base
    assert estimate_memory(Job("merge", "me/out", {"base": str(base), "adapter": "a/b"}, memory=5 << 30)) == 5 << 30
    assert estimate_memory(Job("convert", str(base / "model.safetensors"))) == CONVERT_BYTES + 4 * 3000
