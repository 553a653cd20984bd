"""The local Hub's Jobs API (converter.testing.hub, jobs=True) driven by the REAL huggingface_hub client.

Each job is a tiny `python -c` run with this interpreter; client code runs in a subprocess (huggingface_hub reads its
endpoint when imported). The server is in this process, so a test can look at a job's process and folders directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from converter.testing.hub import HubServer, run_client

ALICE, BOB, FRANK, DAVE = "hf_alice_jobs_token", "hf_bob_jobs_token", "hf_frank_jobs_token", "hf_dave_jobs_token"
PY = sys.executable

PRELUDE = f"""
import json, os, sys
from huggingface_hub import HfApi, Volume
api = HfApi()
PY, BOB = {PY!r}, {BOB!r}

def result(obj):
    print("RESULT " + json.dumps(obj, default=str))

def error(fn):
    try:
        fn()
    except Exception as e:
        return [type(e).__name__, getattr(getattr(e, "response", None), "status_code", None), str(e)]
    return None

def finished(job_id, **kw):
    return api.wait_for_job(job_id, poll_interval=0.05, timeout=60, **kw)
"""


def client(hub: HubServer, code: str, token: str | None = ALICE) -> Any:
    """Run ``code`` (after PRELUDE) in a fresh interpreter; returns what it passed to ``result``."""
    proc = run_client(hub, PRELUDE + textwrap.dedent(code), token=token, timeout=90)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, hub.redact(proc.stdout + proc.stderr)
    return json.loads(lines[-1][len("RESULT ") :])


def gone(pid: int, within: float = 5.0) -> bool:
    """Whether the process has ended (a zombie waiting for its reaper counts as ended)."""
    deadline = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> HubServer:
    with HubServer(tmp_path_factory.mktemp("hub"), jobs=True) as server:
        server.add_user("alice", ALICE, orgs=["acme", "poorco"])
        server.add_user("bob", BOB)
        server.add_user("frank", FRANK, orgs=["acme"], can_pay=False)  # a free account
        server.add_user("dave", DAVE)
        server.add_token("alice", "hf_alice_jobs_read", role="read")
        server.set_can_pay("poorco", False)  # an organisation without credits
        yield server


def test_a_job_streams_its_lines_as_printed_and_completes(hub, tmp_path):
    go = tmp_path / "go"
    job_code = (
        "import os, sys, time\n"
        "print('one', flush=True)\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "print('two'); print('three', file=sys.stderr)\n"
        "print('root=' + os.environ['LOCAL_HUB_JOB_ROOT'] + ' cwd=' + os.getcwd())"
    )
    got = client(
        hub,
        f"""
        job = api.run_job(image="python:3.12", command=[PY, "-c", {job_code!r}])
        logs = iter(api.fetch_job_logs(job_id=job.id, follow=True))
        first = next(logs)  # printed while the job still waits: streamed, not held back until it ends
        running = api.inspect_job(job_id=job.id).status.stage
        open({str(go)!r}, "w").close()
        rest = list(logs)
        info = api.inspect_job(job_id=job.id)
        result({{"created": job.status.stage, "first": first, "running": running, "rest": rest,
                "stage": info.status.stage, "message": info.status.message, "url": job.url, "id": job.id,
                "owner": [info.owner.name, info.owner.type], "started": str(info.started_at),
                "finished": str(info.finished_at), "again": list(api.fetch_job_logs(job_id=job.id)),
                "tail": list(api.fetch_job_logs(job_id=job.id, tail=1)), "image": info.docker_image,
                "flavor": info.flavor, "name": info.labels["name"]}})
        """,
    )
    job = hub.job(got["id"])
    assert got["created"] in ("SCHEDULING", "RUNNING") and got["first"] == "one" and got["running"] == "RUNNING"
    assert got["rest"][:2] == ["two", "three"] and got["rest"][2] == f"root={job.root} cwd={job.folder / 'work'}"
    assert got["stage"] == "COMPLETED" and got["message"] is None and job.returncode == 0
    assert got["again"] == ["one", *got["rest"]] and got["tail"] == got["rest"][-1:]  # the banner is left out
    assert job.lines[0][1].startswith("===== Job started at ")
    assert got["url"] == f"{hub.url}/jobs/alice/{got['id']}" and got["owner"] == ["alice", "user"]
    assert got["started"] != "None" and got["finished"] != "None"
    assert got["image"] == "python:3.12" and got["flavor"] == "cpu-basic" and got["name"].startswith("python-3-12-")


def test_a_failing_job_is_an_error_with_its_exit_code(hub):
    got = client(
        hub,
        """
        failed = api.run_job(image="python:3.12", command=[PY, "-c", "print('bad'); raise SystemExit(3)"])
        missing = api.run_job(image="python:3.12", command=["no-such-program-here", "x"])
        a, b = finished(failed.id), finished(missing.id)
        result([[a.status.stage, a.status.message], [b.status.stage, b.status.message],
                list(api.fetch_job_logs(job_id=failed.id)), list(api.fetch_job_logs(job_id=missing.id))])
        """,
    )
    assert got[0] == ["ERROR", "Job failed with exit code: 3"] and got[2] == ["bad"]
    assert got[1] == ["ERROR", "Job failed with exit code: 127"] and "no-such-program-here" in got[3][0]


def test_cancel_kills_the_job_and_what_it_started(hub):
    job_code = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(os.getpid(), child.pid, flush=True)\n"
        "time.sleep(60)"
    )
    got = client(
        hub,
        f"""
        job = api.run_job(image="python:3.12", command=[PY, "-c", {job_code!r}])
        pids = next(iter(api.fetch_job_logs(job_id=job.id, follow=True)))
        api.cancel_job(job_id=job.id)
        info = finished(job.id)
        result([job.id, pids, info.status.stage])
        """,
    )
    job_id, pids, stage = got
    pid, child = map(int, pids.split())
    assert stage == "CANCELED" and hub.job(job_id).stage == "CANCELED" and hub.job(job_id).pid == pid
    assert gone(pid) and gone(child)


def test_a_job_past_its_timeout_is_stopped_as_an_error(hub):
    started = time.monotonic()
    got = client(
        hub,
        """
        job = api.run_job(image="python:3.12", command=[PY, "-c", "import time; time.sleep(60)"], timeout=1)
        info = finished(job.id)
        result([job.id, info.status.stage, info.status.message])
        """,
    )
    assert got[1:] == ["ERROR", "Job timed out after 1 seconds"]
    assert gone(hub.job(got[0]).pid) and time.monotonic() - started < 20


def test_secrets_reach_the_process_but_are_never_shown_back(hub, caplog):
    caplog.set_level(logging.DEBUG, logger="converter.testing.hub")
    secret = "hf_very_secret_value_42"
    job_code = (
        "import hashlib, os; print(hashlib.sha256(os.environ['MY_SECRET'].encode()).hexdigest(), os.environ['VISIBLE'])"
    )
    got = client(
        hub,
        f"""
        from huggingface_hub.utils import get_session
        job = api.run_job(image="python:3.12", command=[PY, "-c", {job_code!r}],
                          env={{"VISIBLE": "yes"}}, secrets={{"MY_SECRET": {secret!r}}}, labels={{"t": "secrets"}})
        info = finished(job.id)
        headers = api._build_hf_headers()
        raw = [get_session().get(f"{{api.endpoint}}/api/jobs/alice/{{job.id}}", headers=headers).text,
               get_session().get(f"{{api.endpoint}}/api/jobs/alice", headers=headers).text]
        listed = [j for j in api.list_jobs(labels={{"t": "secrets"}})]
        result({{"logs": list(api.fetch_job_logs(job_id=job.id)), "raw": raw, "secrets": info.secrets,
                "env": info.environment, "listed": [[j.secrets, j.environment] for j in listed]}})
        """,
    )
    assert got["logs"] == [f"{hashlib.sha256(secret.encode()).hexdigest()} yes"]  # the job saw the secret
    assert all(secret not in text for text in got["raw"])
    assert got["secrets"] == {} and got["env"] == {"VISIBLE": "yes"} and got["listed"] == [[{}, {"VISIBLE": "yes"}]]
    assert secret not in caplog.text
    assert all(secret.encode() not in p.read_bytes() for p in hub.root.rglob("*") if p.is_file())


def test_a_repo_volume_is_read_only_and_pinned(hub):
    hub.create_repo("alice/volume-model")
    pinned = hub.commit_files("alice/volume-model", {"config.json": b'{"v": 1}', "sub/notes.txt": b"notes v1\n"})
    hub.commit_files("alice/volume-model", {"config.json": b'{"v": 2}'}, "a later commit")
    hub.create_repo("bob/hidden", private=True)
    job_code = (
        "import os, sys\n"
        "print(open(sys.argv[1]).read())\n"
        "print(sorted(os.listdir(sys.argv[2])))\n"
        "print(os.path.isfile(os.environ['LOCAL_HUB_JOB_ROOT'] + '/base/config.json'))\n"
        "try:\n"
        "    open(os.path.join(os.path.dirname(sys.argv[1]), 'new.txt'), 'w')\n"
        "    print('writable')\n"
        "except PermissionError:\n"
        "    print('read-only')"
    )
    got = client(
        hub,
        f"""
        volumes = [Volume(type="model", source="alice/volume-model", mount_path="/base", revision={pinned!r}),
                   Volume(type="model", source="alice/volume-model", mount_path="/notes", path="sub")]
        job = api.run_job(image="python:3.12", command=[PY, "-c", {job_code!r}, "/base/config.json", "/notes"],
                          volumes=volumes)
        info = finished(job.id)
        hidden = error(lambda: api.run_job(image="python:3.12", command=[PY, "-V"],
                                           volumes=[Volume(type="model", source="bob/hidden", mount_path="/x")]))
        result({{"id": job.id, "stage": info.status.stage, "logs": list(api.fetch_job_logs(job_id=job.id)),
                "volumes": [[v.source, v.mount_path, v.revision, v.read_only, v.path] for v in info.volumes],
                "command": info.command, "hidden": hidden}})
        """,
    )
    job = hub.job(got["id"])
    base, notes = job.volume_folder("/base"), job.volume_folder("/notes")
    assert got["stage"] == "COMPLETED", got["logs"]
    assert got["logs"][:3] == ['{"v": 1}', "['notes.txt']", "True"]  # the pinned revision, the subfolder alone
    assert got["logs"][3] == ("writable" if os.geteuid() == 0 else "read-only")  # root ignores permissions
    assert got["command"][-2:] == ["/base/config.json", "/notes"]  # shown as sent, run rewritten
    assert got["volumes"] == [
        ["alice/volume-model", "/base", pinned, True, None],
        ["alice/volume-model", "/notes", None, True, "sub"],
    ]
    assert (base / "config.json").read_bytes() == b'{"v": 1}' and (base / "sub" / "notes.txt").is_file()
    assert (notes / "notes.txt").read_bytes() == b"notes v1\n"
    assert (base / "config.json").stat().st_mode & 0o777 == 0o444 and base.stat().st_mode & 0o777 == 0o555
    assert got["hidden"][:2] == ["RepositoryNotFoundError", 404]


def test_labels_are_kept_and_filter_the_listing(hub):
    got = client(
        hub,
        """
        def run(**labels):
            return api.run_job(image="python:3.12", command=[PY, "-c", "pass"], labels=labels).id
        a, b, c = run(kind="merge", target="one"), run(kind="merge", target="two"), run(kind="convert")
        for job_id in (a, b, c):
            finished(job_id)
        ids = lambda **f: sorted(j.id for j in api.list_jobs(**f))
        relabeled = api.update_job_labels(job_id=c, labels={"kind": "merge", "target": "three"}).labels
        rerun = api.rerun_job(job_id=a)
        result({"ids": [a, b, c], "merge": ids(labels={"kind": "merge"}),
                "two": ids(labels={"kind": "merge", "target": "two"}), "all": ids(),
                "completed": ids(status="COMPLETED"), "relabeled": relabeled, "rerun": [rerun.id, rerun.labels],
                "bad": error(lambda: run(target="a/b"))})
        """,
        token=DAVE,
    )
    a, b, c = got["ids"]
    rerun = got["rerun"][0]
    assert got["merge"] == sorted([a, b, c, rerun]) and got["two"] == [b]  # c relabeled, a rerun, before listing
    assert got["relabeled"] == {"kind": "merge", "target": "three"}
    assert rerun not in got["ids"] and got["rerun"][1]["target"] == "one"
    assert set(got["all"]) == {a, b, c, rerun} and {a, b, c} <= set(got["completed"])
    assert got["bad"][:2] == ["BadRequestError", 400]


def test_the_hardware_list_has_the_flavors_and_their_prices(hub):
    got = client(
        hub,
        """
        result([[h.name, h.cpu, h.ram, h.unit_cost_micro_usd, h.unit_cost_usd, h.unit_label,
                 h.accelerator.model if h.accelerator else None] for h in api.list_jobs_hardware(token=False)])
        """,
        token=None,
    )
    flavors = {row[0]: row for row in got}
    assert flavors["cpu-basic"][1:] == ["2 vCPU", "16 GB", 167, 0.000167, "minute", None]
    assert [round(flavors[f][4] * 60, 2) for f in ("cpu-basic", "cpu-upgrade", "cpu-xl")] == [0.01, 0.03, 1.0]
    assert flavors["cpu-xl"][1:3] == ["16 vCPU", "124 GB"] and flavors["t4-small"][6] == "T4"


def test_jobs_run_in_the_tokens_namespace_or_its_orgs_only(hub):
    got = client(
        hub,
        """
        run = lambda **kw: api.run_job(image="python:3.12", command=[PY, "-c", "pass"], **kw)
        org_job = run(namespace="acme")
        result({"org": [org_job.owner.name, org_job.owner.type, finished(org_job.id, namespace="acme").status.stage],
                "other": error(lambda: run(namespace="bob")),
                "anonymous": error(lambda: run(namespace="alice", token=False)),
                "read_only": error(lambda: run(token="hf_alice_jobs_read")),
                "bobs_view": error(lambda: api.inspect_job(job_id=org_job.id, namespace="acme", token=BOB)),
                "not_found": error(lambda: api.inspect_job(job_id="0" * 24))})
        """,
    )
    assert got["org"] == ["acme", "org", "COMPLETED"]
    assert got["other"][:2] == ["HfHubHTTPError", 403] and got["anonymous"][1] == 401
    assert got["read_only"][:2] == ["HfHubHTTPError", 403] and got["bobs_view"][1] == 403
    assert got["not_found"][:2] == ["JobNotFoundError", 404]


def test_a_free_account_is_refused_and_an_org_with_credits_is_not(hub):
    got = client(
        hub,
        """
        run = lambda **kw: api.run_job(image="python:3.12", command=[PY, "-c", "pass"], **kw)
        who = api.whoami()
        result({"who": [who["canPay"], who["isPro"]], "own": error(run),
                "org": finished(run(namespace="acme").id, namespace="acme").status.stage})
        """,
        token=FRANK,
    )
    assert got["who"] == [False, False] and got["org"] == "COMPLETED"
    assert got["own"][:2] == ["HfHubHTTPError", 402] and "PRO" in got["own"][2] and "credits" in got["own"][2]
    poor = client(
        hub, 'result(error(lambda: api.run_job(image="x", command=[PY, "-V"], namespace="poorco")))', token=ALICE
    )
    assert poor[1] == 402


def test_run_uv_job_sends_its_uv_command_which_runs_as_given(hub, tmp_path):
    fake = tmp_path / "bin" / "uv"
    fake.parent.mkdir()
    fake.write_text(f"#!{PY}\nimport sys\nprint('uv', *sys.argv[1:])\n")
    fake.chmod(0o755)
    got = client(
        hub,
        f"""
        from huggingface_hub._jobs_api import DEFAULT_UV_IMAGE
        job = api.run_uv_job("https://example.com/merge.py", script_args=["--fast"], dependencies=["converter"],
                             env={{"PATH": {str(fake.parent)!r} + os.pathsep + os.environ["PATH"]}})
        info = finished(job.id)
        result([info.status.stage, info.docker_image == DEFAULT_UV_IMAGE, info.command,
                list(api.fetch_job_logs(job_id=job.id))])
        """,
    )
    command = ["uv", "run", "--with", "converter", "https://example.com/merge.py", "--fast"]
    assert got == ["COMPLETED", True, command, [" ".join(command)]]


def test_stopping_the_server_kills_its_jobs_and_removes_their_folders(tmp_path):
    with HubServer(tmp_path / "plain") as plain:  # Jobs are served only when asked for
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{plain.url}/api/jobs/hardware", timeout=10)
        assert refused.value.code == 404
    server = HubServer(tmp_path / "hub", jobs=True).start()
    try:
        server.add_user("alice", ALICE)
        server.create_repo("alice/m")
        job_id = client(
            server,
            """
            job = api.run_job(image="x", command=[PY, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                              volumes=[Volume(type="model", source="alice/m", mount_path="/base")])
            next(iter(api.fetch_job_logs(job_id=job.id, follow=True)))
            result(job.id)
            """,
        )
        job = server.job(job_id)
        assert job.stage == "RUNNING" and job.volume_folder("/base").is_dir()
    finally:
        server.stop()
    assert job.stage == "CANCELED" and job.message == "The local Hub stopped" and gone(job.pid)
    assert not (tmp_path / "hub" / "_jobs").exists()
