"""Interrupted runs leave nothing behind: a real child process is killed (SIGKILL) at a known point, then the next
run removes what it left and the folders look exactly as before (plus the result).

The child stops itself at the point named by CONVERTER_TEST_STOP (`converter.io.scratch.stop_here`), so the kill
lands mid-write every time, not by luck of timing.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from model_helpers import make_adapter, make_base

from converter.errors import ConverterError
from converter.io import scratch
from converter.testing.hub import HubServer, client_env

ALICE = "hf_alice_interrupted_token_0123456789"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base = make_base(root / "base", "llama", dtype=torch.float32)
    return base, make_adapter(base, root / "lora", r=4, lora_alpha=8)


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    """A temp dir of our own for the children and for in-process runs, so its listing is the test's to check."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def listing(folder: Path) -> set[str]:
    """Every path under `folder`, with file sizes: 'exactly as before' down to the byte counts."""
    return {f"{p.relative_to(folder)}:{p.stat().st_size if p.is_file() else 'dir'}" for p in sorted(folder.rglob("*"))}


def start(args: list, tmp: Path, stop: str, env: dict | None = None) -> subprocess.Popen:
    env = {**(env or os.environ), "TMPDIR": str(tmp), scratch.STOP_ENV: stop}
    log = open(tmp.parent / f"child-{time.monotonic_ns()}.log", "w+")  # noqa: SIM115 - read in stopped()
    proc = subprocess.Popen([sys.executable, "-m", "converter", *map(str, args)], stdout=log, stderr=log, env=env)
    proc.log = log
    return proc


def stopped(proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Wait until the child stops itself at its hook (it must not exit first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
        if pid:
            if os.WIFSTOPPED(status):
                return
            proc.log.seek(0)
            pytest.fail(f"child exited (status {status}) before its stop point:\n{proc.log.read()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("child never reached its stop point")


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()  # reaped: a zombie would still look like a running owner


def owned(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if scratch.owner_of(p)]


def test_kill_during_multishard_write_leaves_nothing_after_the_next_run(models, tmp_path, tmpdir_env, cli):
    base, lora = models
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("the user's own file\n")
    before = listing(work)
    out = work / "merged"
    args = ["merge", "--base", base, "--adapter", lora, "--out", out, "--max-shard-size", "100KB", "--no-verify"]
    proc = start(args, tmpdir_env, "shard")
    stopped(proc)
    left = owned(work)
    assert len(left) == 1 and list(left[0].rglob("*.safetensors")), "the kill must land mid-write"
    kill(proc)
    assert not out.exists()

    code, stdout, err = cli(*args[:-1])
    assert code == 0, err
    assert "left by an interrupted run" in stdout, stdout
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert listing(work) == before | {"merged:dir"} | {f"merged/{e}" for e in listing(out)}
    assert listing(tmpdir_env) == set()  # the killed run's (empty) dequantization folder went too


def test_kill_during_dequantization(tmp_path, tmpdir_env, cli):
    from test_qlora import quantize_with_transformers

    full = make_base(tmp_path / "full", "llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    lora = make_adapter(full, tmp_path / "lora", r=4, lora_alpha=8)
    base = quantize_with_transformers(full, tmp_path / "base-bnb-4bit")
    work = tmp_path / "work"
    work.mkdir()
    out = work / "m"
    args = ["merge", "--base", base, "--adapter", lora, "--out", out, "--no-verify"]
    proc = start(args, tmpdir_env, "shard")
    stopped(proc)
    (dequantizing,) = owned(tmpdir_env)
    assert dequantizing.name.startswith("converter-dequantized.")
    assert (dequantizing / "model.safetensors").stat().st_size > 0
    kill(proc)
    assert not out.exists() and not any(work.iterdir())

    code, stdout, err = cli(*args[:-1])
    assert code == 0, err
    assert "left by an interrupted run" in stdout
    assert listing(tmpdir_env) == set() and [p.name for p in work.iterdir()] == ["m"]


def test_kill_during_convert(models, tmp_path, tmpdir_env, cli):
    _, lora = models
    work = tmp_path / "work"
    work.mkdir()
    out = work / "lora_kohya.safetensors"
    args = ["convert", "--adapter", lora, "--to", "kohya", "--out", out, "--component", "text_encoder"]
    proc = start(args, tmpdir_env, "staged")
    stopped(proc)
    (staged,) = owned(work)
    assert staged.stat().st_size > 0
    kill(proc)
    assert [p.name for p in work.iterdir()] == [staged.name]  # nothing at the target

    code, stdout, err = cli(*args)
    assert code == 0, err
    assert "left by an interrupted run" in stdout
    assert [p.name for p in work.iterdir()] == [out.name] and listing(tmpdir_env) == set()


def test_kill_during_push_staging_creates_no_repo(models, tmp_path, tmpdir_env):
    base, lora = models
    server = HubServer(tmp_path / "hub").start()
    try:
        server.add_user("alice", ALICE)
        env = client_env(server, ALICE, tmp_path / "home")
        args = ["push", "--repo", "alice/merged", "--base", base, "--adapter", lora, "--no-verify"]
        proc = start(args, tmpdir_env, "staged", env)
        stopped(proc)
        (staging,) = [p for p in owned(tmpdir_env) if p.name.startswith("converter-push.")]
        assert any(staging.rglob("*.safetensors"))  # the merge is staged, the commit not made
        kill(proc)
        # shards may have gone up already (a pipelined push creates the repo for them): no commit holds them
        assert not server.exists("alice/merged") or "model.safetensors" not in server.files("alice/merged")

        done = subprocess.run(
            [sys.executable, "-m", "converter", *map(str, args)],
            env={**env, "TMPDIR": str(tmpdir_env)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert "left by an interrupted run" in done.stdout
        assert server.exists("alice/merged") and "model.safetensors" in server.files("alice/merged")
        assert listing(tmpdir_env) == set()
    finally:
        server.stop()


def test_second_run_on_the_same_out_is_refused_while_the_first_runs(models, tmp_path, tmpdir_env, cli):
    base, lora = models
    out = tmp_path / "work" / "merged"
    args = ["merge", "--base", base, "--adapter", lora, "--out", out, "--max-shard-size", "100KB", "--no-verify"]
    proc = start(args, tmpdir_env, "shard")
    stopped(proc)
    try:
        code, stdout, err = cli(*args[:-1])
        assert code == 2 and f"pid {proc.pid}" in err and "is writing it" in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert "interrupted run" not in stdout  # the live run's folder was not touched
    finally:
        proc.send_signal(signal.SIGCONT)
    # SIGCONT does not clear the stop hook: the child stops at each later shard; let it run to the end.
    while proc.poll() is None:
        pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
        if pid and os.WIFSTOPPED(status):
            os.kill(proc.pid, signal.SIGCONT)
        elif pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.02)
    assert proc.returncode == 0
    assert [p.name for p in out.parent.iterdir()] == ["merged"] and (out / "model.safetensors.index.json").is_file()


def test_only_dead_owners_folders_go_and_a_reused_pid_is_seen(tmp_path, tmpdir_env):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    mine = jobs / scratch.owned_name("job")
    mine.mkdir()
    foreign = jobs / mine.name.replace(f"@{scratch.me().host}", "@some-other-host")
    foreign.mkdir()
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = jobs / mine.name.replace(f".{os.getpid()}-", f".{proc.stdout.strip()}-")
    (gone / "hf-cache").mkdir(parents=True)
    (gone / "hf-cache" / "blob").write_bytes(b"x" * 1000)
    reused = jobs / mine.name.replace(f"-{scratch.me().start}-", f"-{scratch.me().start + 1}-")  # pid reused
    reused.mkdir()
    lines: list[str] = []
    assert scratch.sweep(jobs, lines.append) == 1000
    assert sorted(p.name for p in jobs.iterdir()) == sorted([mine.name, foreign.name])
    assert lines == [f"removed 1.00 KB left by 2 interrupted runs in {jobs}"]
    # A server's own jobs' folder at its start: another host's leftovers are its previous container's.
    assert scratch.startup_cleanup(jobs, lines.append) == 0 and [p.name for p in jobs.iterdir()] == [mine.name]


def test_the_space_removes_dead_jobs_folders_on_start(tmp_path):
    """app.py's start: job folders (their HF caches inside) no running process owns go; a live one stays."""
    jobs = tmp_path / "jobs"
    live = jobs / scratch.owned_name("job")
    (live / "hf-cache").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = jobs / live.name.replace(f".{os.getpid()}-", f".{done.stdout.strip()}-")
    (dead / "hf-cache" / "models--org--base").mkdir(parents=True)
    (dead / "hf-cache" / "models--org--base" / "blob").write_bytes(b"x" * 5000)
    started = (
        "import app\n"
        "class Stub:\n"
        "    def queue(self, **_): return self\n"
        "    def launch(self): print('launched')\n"
        "app.build = Stub\n"
        "app.main()\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CONVERTER_APP_WORKDIR": str(jobs), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", started], cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "launched" in proc.stdout, proc.stderr
    assert f"removed 5.00 KB left by an interrupted run in {jobs.resolve()}" in proc.stderr
    assert [p.name for p in jobs.iterdir()] == [live.name]


def test_full_disk_mid_write_is_a_one_line_error_and_leaves_nothing(models, tmp_path):
    """A 1-shard-too-small tmpfs in a private mount namespace: the weights fit (the up-front check passes), the
    rest of the output does not."""
    if not shutil.which("unshare"):
        pytest.skip("unshare (util-linux) is not installed: no way to mount a small tmpfs")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"user/mount namespaces not allowed here: {probe.stderr.decode().strip()}")
    base, lora = models
    weights = (base / "model.safetensors").stat().st_size
    size = (weights // 4096 + 4) * 4096  # the shards' pages, not the card, config, recipe and provenance too
    mnt = tmp_path / "small"
    mnt.mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    merge = [sys.executable, "-m", "converter", "merge", "--base", base, "--adapter", lora, "--out", mnt / "out",
             "--max-shard-size", "200KB", "--no-verify"]  # fmt: skip
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {mnt} || exit 99\n"
        f"{' '.join(map(str, merge))} 2>{tmp_path / 'err'}\n"
        f"echo rc=$?\n"
        f"ls -A {mnt}\n"
    )
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp)})  # fmt: skip
    if done.returncode == 99:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    err = (tmp_path / "err").read_text()
    lines = done.stdout.strip().splitlines()
    assert "rc=2" in lines, done.stdout + err
    assert lines[-1] == "rc=2", f"left on the full disk: {lines[lines.index('rc=2') + 1 :]}"
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: no space left on {mnt}: needs at least ")
    assert " free (" in err and "Traceback" not in err
    assert listing(tmp) == set()


def test_a_full_temp_disk_is_a_one_line_error_and_the_scratch_folder_goes(tmp_path):
    message = rf"^no space left on {tmp_path}: [0-9.]+ [KMGT]?B free \(temp folder for verify; set TMPDIR"
    with pytest.raises(ConverterError, match=message), scratch.temp_folder("verify", tmp_path, print) as folder:
        (folder / "offloaded.dat").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_two_runs_reaching_the_staging_step_together_let_the_older_folder_win(tmp_path, monkeypatch):
    """Both runs passed the early busy check at the same moment: each then sees the other's staging folder, and
    only the one whose folder was made first goes on (the names order by creation time)."""
    from converter.engine import writer

    out = tmp_path / "merged"
    monkeypatch.setattr(writer, "check_output_target", lambda out, force: None)  # both got past it
    other = tmp_path / scratch.owned_name("out", f".{out.name}.")  # a live owner (this process), made first
    other.mkdir()
    with pytest.raises(ConverterError, match="is writing it right now"), writer.atomic_folder(out, False, log=print):
        pytest.fail("the younger run must not get a folder to fill")
    assert [p.name for p in tmp_path.iterdir()] == [other.name] and not out.exists()
    other.rename(tmp_path / other.name.replace(scratch.owner_of(other).made, "f" * 20))  # now the younger one
    with writer.atomic_folder(out, False, log=print) as payload:
        (payload / "model.safetensors").write_bytes(b"x")
    assert (out / "model.safetensors").read_bytes() == b"x"
