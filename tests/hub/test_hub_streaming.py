"""The pipelined push: base shards stream in while the merge reads them, output shards go up as they are finished,
one commit at the end; faults mid-download and mid-upload leave no repo; the scratch disk stays bounded and the
user's HF cache is left as it was. The real huggingface_hub client against the local Hub server, in subprocesses.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_helpers import make_adapter, make_base, read_tensors, run_cli

from converter.engine.recipe import AdapterSpec, Recipe
from converter.jobs.shape import pipelined_shard_size
from converter.jobs.streaming import SHARDS_ON_DISK, WINDOW_SHARDS
from converter.testing.hub import HubServer, Link, client_env
from converter.verification.streamed import EXECUTION

ALICE = "hf_fake_alice_0123456789"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hub")
    server = HubServer(root / "server").start()
    server.add_user("alice", ALICE)
    local = root / "local"
    tiny = make_base(local / "tiny", "llama", dtype=torch.bfloat16)
    base = local / "base"
    AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).save_pretrained(base, max_shard_size="40KB")
    shards = sorted(base.glob("*.safetensors"))
    assert len(shards) >= 6, "the test needs a base in many shards"
    lora = make_adapter(base, local / "lora", r=4, lora_alpha=8)
    server.seed_folder("alice/sharded", base)
    server.seed_folder("alice/lora", lora)
    reference = local / "reference"
    assert run_cli("merge", "--base", base, "--adapter", lora, "--out", reference, "--no-verify") == 0
    server.local = {"base": base, "lora": lora, "reference": reference, "shards": shards}
    yield server
    server.stop()


def push(hub: HubServer, tmp_path: Path, repo: str, *extra: str, home: Path | None = None, code: str | None = None):
    """`converter push` of the sharded base + LoRA (or `code`, Python run against the hub) in a subprocess whose
    temp folder is `tmp_path/tmp`; returns (exit code, stdout, stderr)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = client_env(hub, ALICE, home or tmp_path / "hf-home") | {
        "CONVERTER_HUB_RETRIES": "3",
        "TMPDIR": str(tmp_path / "tmp"),
    }
    args = ["--repo", repo, "--base", "alice/sharded", "--adapter", "alice/lora", "--max-shard-size", "40KB", *extra]
    command = ["-c", code] if code else ["-m", "converter", "push", *args]
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def pushed_tensors(hub: HubServer, repo: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    out = {}
    for name in hub.files(repo):
        if name.endswith(".safetensors"):
            out.update(load(hub.read_file(repo, name)))
    return out


def same_as_reference(hub: HubServer, repo: str) -> bool:
    ours, ref = pushed_tensors(hub, repo), read_tensors(hub.local["reference"])
    assert ours.keys() == ref.keys(), (sorted(ours), sorted(ref))
    assert [k for k in ours if not torch.equal(ours[k], ref[k])] == []
    return True


def cached_weights(home: Path) -> list[Path]:
    """The base's weight files in the HF cache under `home` (the adapter is cached as usual)."""
    return sorted((home / "hub").glob("models--alice--sharded/snapshots/*/*.safetensors"))


def test_streamed_push_one_commit_bounded_scratch_cache_untouched(hub, tmp_path):
    home = tmp_path / "hf-home"
    code, out, err = push(hub, tmp_path, "alice/streamed", "--no-verify", home=home)
    assert code == 0, err
    assert f"pushed: {hub.url}/alice/streamed/commit/" in out
    assert len(hub.history("alice/streamed")) == 2  # the Hub's initial commit and ours
    assert same_as_reference(hub, "alice/streamed")
    files = hub.files("alice/streamed")
    shards = [n for n in files if n.endswith(".safetensors")]
    assert len(shards) >= 6 and "model.safetensors.index.json" in files
    # Uploaded as the merge went: every shard through its own LFS batch (a shard whose bytes the Hub already has,
    # here one holding only untouched tensors, needs no PUT), then the one commit.
    batches = [i for i, s in enumerate(hub.seen) if s.path.endswith("/objects/batch")]
    commits = [i for i, s in enumerate(hub.seen) if "/commit/" in s.path]
    assert len(batches) == len(shards) and len(commits) == 1 and max(batches) < commits[0]
    # Provenance: the base's sha256 are its LFS ids, the real files' hashes.
    provenance = json.loads(hub.read_file("alice/streamed", "converter_provenance.json"))
    recorded = {f["name"]: f["sha256"] for f in provenance["base"]["files"]}
    assert recorded == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in hub.local["shards"]}
    # Bounded scratch: never more than a few shards of each side on disk at once (measured on disk).
    peak = float(re.search(r"scratch disk peak: ([\d.]+) MiB", out)[1]) * 2**20
    base_shard = max(p.stat().st_size for p in hub.local["shards"])
    out_shard = max(len(hub.read_file("alice/streamed", n)) for n in shards)
    weights = sum(p.stat().st_size for p in hub.local["shards"])
    assert 0 < peak <= 3 * base_shard + 4 * out_shard + 64 * 1024 < 2 * weights
    # The job's temp folders are gone, and the base's shards were never written into the HF cache.
    assert not any((tmp_path / "tmp").iterdir())
    assert not cached_weights(home)


def test_cached_base_is_read_from_the_cache_and_kept(hub, tmp_path):
    home = tmp_path / "hf-home"
    env = client_env(hub, ALICE, home)
    subprocess.run(
        [sys.executable, "-c", "from huggingface_hub import snapshot_download; snapshot_download('alice/sharded')"],
        env=env,
        check=True,
        timeout=120,
    )
    before = {p: p.stat().st_mtime_ns for p in cached_weights(home)}
    assert len(before) == len(hub.local["shards"])
    hub.reset_log()
    code, out, err = push(hub, tmp_path, "alice/from-cache", "--no-verify", home=home)
    assert code == 0, err
    assert not [s for s in hub.seen if s.method == "GET" and "/resolve/" in s.path and "sharded" in s.path]
    assert {p: p.stat().st_mtime_ns for p in cached_weights(home)} == before
    assert same_as_reference(hub, "alice/from-cache")


def test_dropped_connections_mid_transfer_are_resumed(hub, tmp_path):
    second = hub.local["shards"][1].name
    # after=2: its two header reads pass; the download itself is cut half-way, twice.
    hub.inject("GET", rf"/alice/sharded/resolve/.*/{second}", drop_connection=True, times=2, after=2)
    hub.inject("PUT", r"^/_lfs/", drop_connection=True)
    hub.reset_log()
    code, out, err = push(hub, tmp_path, "alice/resumed", "--no-verify")
    hub.clear_faults()
    assert code == 0, err
    assert same_as_reference(hub, "alice/resumed") and len(hub.history("alice/resumed")) == 2
    # The dropped download was resumed where it stopped (a Range from past the header), not restarted.
    starts = [int(s.range.split("=")[1].split("-")[0]) for s in hub.seen if s.path.endswith(second)][2:]
    faults = [s.fault for s in hub.seen if s.path.endswith(second)][2:]
    assert faults == [True, True, False] and starts[0] < starts[1] < starts[2]


@pytest.mark.parametrize(
    "method, where, status",
    [
        ("GET", "resolve/[^/]+/model-00004", 500),
        ("PUT", "^/_lfs/", 400),  # a 5xx here is retried by huggingface_hub itself for ~25 s per try
        ("POST", "/preupload/", 400),  # here too: a 500 took 72 s of retries, which test nothing more
        ("POST", "/commit/", 500),
    ],
)
def test_faults_mid_job_leave_no_repo(hub, tmp_path, method, where, status):
    # A download: the 4th shard's header reads pass, its data fails for good (after shards were uploaded).
    hub.inject(method, where, status=status, times=100, after=2 if method == "GET" else 0)
    hub.reset_log()
    # A weight of its own: shards no earlier test uploaded (the Hub skips blobs it has, and so the faults)
    weight = str(0.3 + 0.1 * len(method + where))
    code, out, err = push(hub, tmp_path, "alice/doomed", "--no-verify", "--weight", weight)
    hub.clear_faults()
    assert code == 2 and f"Hub error {status}" in err and "Traceback" not in err, err
    # The job was under way (the repo existed, shards were on their way up), and it was removed again.
    paths = [s.path for s in hub.seen]
    assert "/api/repos/create" in paths and "/api/repos/delete" in paths and not hub.exists("alice/doomed")
    assert not any((tmp_path / "tmp").iterdir())


def test_failed_shard_check_commits_nothing(hub, tmp_path):
    """A per-shard check runs on every shard before its upload; one that fails stops the job, no repo is left."""
    code = """
from converter.errors import VerificationFailed
from converter.jobs.pipeline import push
from converter.jobs.options import PushOptions
from converter.engine.recipe import AdapterSpec, Recipe

SABOTAGE = True
seen = []
def check(shard):
    seen.append(shard.name)
    assert shard.path.is_file() and shard.size == shard.path.stat().st_size
    if SABOTAGE and len(seen) == 3:
        raise VerificationFailed(f"{shard.name}: sabotaged")
recipe = Recipe(base="alice/sharded", adapters=[AdapterSpec(source="alice/lora")], max_shard_size="40KB")
try:
    push("alice/checked", PushOptions(verify=None), recipe=recipe, check_shard=check)
except VerificationFailed as e:
    print("failed:", e, seen)
"""
    rc, out, err = push(hub, tmp_path, "", code=code)
    assert rc == 0, err
    assert "failed: model-00003-of-" in out and not hub.exists("alice/checked")
    rc, out, err = push(hub, tmp_path, "", code=code.replace("SABOTAGE = True", "SABOTAGE = False"))
    assert rc == 0, err
    assert same_as_reference(hub, "alice/checked") and len(hub.history("alice/checked")) == 2


def test_a_wrong_module_stops_the_push_before_its_shard_leaves(hub, tmp_path):
    """`converter push` (verification on, the default) proves each shard tensor by tensor before its upload: a
    merge that leaves one module unmerged stops at the shard holding it, in one line naming the tensor, its
    module and how far off it is; that shard is never uploaded, nothing is committed and the repo is deleted."""
    code = """
import sys
from converter.engine import merging as merge
from converter.cli import main

real = merge.plan_merge
def one_module_left_unmerged(*args, **kwargs):
    plan, warnings, quantized = real(*args, **kwargs)
    next(o for o in plan.outputs if o.name == "model.layers.1.self_attn.v_proj.weight").patches.clear()
    return plan, warnings, quantized
merge.plan_merge = one_module_left_unmerged
sys.exit(main(["push", "--repo", "alice/one-wrong", "--base", "alice/sharded", "--adapter", "alice/lora",
               "--max-shard-size", "40KB", "--weight", "0.9"]))
"""
    hub.reset_log()
    rc, out, err = push(hub, tmp_path, "", code=code)
    assert rc == 3, out + err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: verification failed: tensor proof of model-0000"), err
    module = "base_model.model.model.layers.1.self_attn.v_proj"
    assert f"model.layers.1.self_attn.v_proj.weight (LoRA, module {module})" in line
    assert "x its rounding bound (as if the change were not merged)" in line and "Traceback" not in err
    wrong = int(line.split("tensor proof of model-")[1][:5])
    uploads = [s for s in hub.seen if "one-wrong" in s.path and s.path.endswith("/preupload/main")]
    assert len(uploads) < wrong  # it never went up (those before it may have: uploads trail the proofs)
    assert not [s for s in hub.seen if "one-wrong" in s.path and "/commit/" in s.path]
    assert "/api/repos/delete" in [s.path for s in hub.seen] and not hub.exists("alice/one-wrong")
    assert not any((tmp_path / "tmp").iterdir())


def test_a_verified_push_proves_each_shard_as_it_goes(hub, tmp_path):
    """The same push, right: every shard proven before its upload, the verdict reused by verification (the
    files are not read again), the card says both proofs, one commit."""
    code, out, err = push(hub, tmp_path, "alice/verified", "--weight", "0.9")
    assert code == 0, err
    assert "tensor proof: each output shard against the base and the PEFT referee, before it is uploaded" in out
    assert "proven shard by shard as they were written" in out
    assert len(hub.history("alice/verified")) == 2
    card = hub.read_file("alice/verified", "README.md").decode()
    assert "every tensor within rounding of base + ΔW (referee: PEFT)" in card
    assert "| mean KL(reference‖model) |" in card and "two proofs" in card  # and the behaviour table
    report = json.loads(hub.read_file("alice/verified", "verification.json"))
    assert report["verdict"] == "pass" and report["tensors"]["failed"] == 0 and not report["tensors"]["missing"]
    assert report["tensors"]["tensors"] == len(read_tensors(hub.local["reference"]))


def fetched_bytes(hub: HubServer, name: str) -> int:
    """How many bytes of the base's file `name` the server sent, from the Range of each GET (all are ranged)."""
    total = 0
    for s in hub.seen:
        if s.method == "GET" and "/alice/sharded/resolve/" in s.path and s.path.endswith("/" + name):
            assert s.range, f"{name} downloaded whole, not streamed"
            start, end = s.range.split("=")[1].split("-")
            total += int(end) - int(start) + 1
    return total


def test_a_verified_push_proves_both_ways_within_a_few_shards_of_disk(hub, tmp_path):
    """With verification on, both proofs run while the models stream: each base weight file is fetched exactly
    once, by Range reads, into the job's own files (never the HF cache), and the behaviour is compared as the base
    arrives and the output is written, so the scratch disk holds a few shards of each side, as without it."""
    home = tmp_path / "hf-home"
    hub.reset_log()
    code, out, err = push(hub, tmp_path, "alice/verified-once", home=home)
    assert code == 0, err
    assert same_as_reference(hub, "alice/verified-once") and len(hub.history("alice/verified-once")) == 2
    shards = hub.local["shards"]
    assert {p.name: fetched_bytes(hub, p.name) for p in shards} == {p.name: p.stat().st_size for p in shards}
    assert not cached_weights(home) and not any((tmp_path / "tmp").iterdir())
    report = json.loads(hub.read_file("alice/verified-once", "verification.json"))
    assert report["verdict"] == "pass" and report["tensors"]["failed"] == 0, report
    assert report.get("execution") == EXECUTION, report["notes"]  # (the behaviour's fields at the top)
    assert report["behaviour_skipped"] is None
    assert report["merged_vs_reference"]["mean_kl"] < report["tolerance"]["mean_kl"]
    peak = float(re.search(r"scratch disk peak: ([\d.]+) MiB", out)[1]) * 2**20
    base_shard = max(p.stat().st_size for p in shards)
    out_shard = max(len(hub.read_file("alice/verified-once", n)) for n in hub.files("alice/verified-once")
                    if n.endswith(".safetensors"))  # fmt: skip
    # The base's window and the output shards on disk; at this size one range request is a whole file, so the base
    # may be a file over its window, and one more where every reader waits for bytes
    held = WINDOW_SHARDS * out_shard + 2 * base_shard + SHARDS_ON_DISK * out_shard
    assert 0 < peak <= held + 128 * 1024, (peak, held)  # (+ the side files, a 4 KiB block each)


def test_a_verified_push_holds_the_same_disk_and_memory_for_a_model_four_times_larger(hub, tmp_path):
    """The same verified push of a 4-layer and a 16-layer base (the same 40 KB shards): the weights grow more than
    threefold, the job's scratch disk peak and its process's peak memory do not; both proofs run and pass each time."""
    from transformers import AutoModelForCausalLM

    peaks = {}
    for layers in (4, 16):
        folder = tmp_path / f"base-{layers}"
        tiny = make_base(tmp_path / f"tiny-{layers}", "llama", dtype=torch.bfloat16, num_hidden_layers=layers)
        AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
        hub.seed_folder(f"alice/layers-{layers}", folder)
        hub.seed_folder(f"alice/lora-{layers}", make_adapter(folder, tmp_path / f"lora-{layers}", r=4, lora_alpha=8))
        (tmp_path / "tmp").mkdir(exist_ok=True)
        env = client_env(hub, ALICE, tmp_path / f"home-{layers}") | {"TMPDIR": str(tmp_path / "tmp")}
        cmd = [sys.executable, "-m", "converter", "push", "--repo", f"alice/twice-{layers}", "--base",
               f"alice/layers-{layers}", "--adapter", f"alice/lora-{layers}", "--max-shard-size", "40KB"]  # fmt: skip
        log = tmp_path / f"push-{layers}.log"
        with open(log, "w") as f:  # the child's own peak memory, from its exit status's resource usage
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            _, status, usage = os.wait4(proc.pid, 0)
        out = log.read_text()
        assert os.waitstatus_to_exitcode(status) == 0, out
        report = json.loads(hub.read_file(f"alice/twice-{layers}", "verification.json"))
        assert report["verdict"] == "pass" and report["behaviour_skipped"] is None and report["tensors_skipped"] is None
        weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        scratch = float(re.search(r"scratch disk peak: ([\d.]+) MiB", out)[1]) * 2**20
        peaks[layers] = (weights, scratch, usage.ru_maxrss)
    (small_w, small_disk, small_rss), (big_w, big_disk, big_rss) = peaks[4], peaks[16]
    assert big_w > 3 * small_w
    assert big_disk < 1.5 * small_disk + 64 * 1024, peaks  # a few shards either way (+ a block or two of side files)
    assert big_rss < 1.25 * small_rss, peaks


LAGGING_REFERENCE = """
import sys, time
from converter.verification import streamed
expect, ready = streamed.BaseGate.expect, streamed.BaseGate.ready
def expecting(self, reads):
    self.reads_left = len(reads)
    expect(self, reads)
def lagging(self, src):
    self.reads_left -= 1
    if self.reads_left == 0:
        time.sleep(3)  # the merge is over (its base all read) before the reference reads its last weight
    return ready(self, src)
streamed.BaseGate.expect, streamed.BaseGate.ready = expecting, lagging
from converter.cli import main
sys.exit(main(["push", "--repo", "alice/lagging", "--base", "alice/sharded", "--adapter", "alice/lora",
               "--max-shard-size", "40KB"]))
"""


def test_a_reference_slower_than_the_merge_still_reads_every_base_weight(hub, tmp_path):
    """The base's files outlive the merge while the streamed reference still reads them: both proofs run."""
    code, out, err = push(hub, tmp_path, "alice/lagging", code=LAGGING_REFERENCE)
    assert code == 0, err
    report = json.loads(hub.read_file("alice/lagging", "verification.json"))
    assert report.get("execution") == EXECUTION and report["behaviour_skipped"] is None, report["notes"]
    assert not any((tmp_path / "tmp").iterdir())


def test_a_verified_push_whose_download_fails_leaves_nothing(hub, tmp_path):
    """A download that fails for good midway: no repo, and nothing of the base is left on disk."""
    fourth = hub.local["shards"][3].name
    hub.inject("GET", rf"resolve/[^/]+/{fourth}", status=500, times=100, after=2)
    home = tmp_path / "hf-home"
    code, out, err = push(hub, tmp_path, "alice/verified-doomed", "--weight", "0.7", home=home)
    hub.clear_faults()
    assert code == 2 and "Hub error 500" in err and "Traceback" not in err, err
    assert not hub.exists("alice/verified-doomed")
    assert not cached_weights(home) and not any((tmp_path / "tmp").iterdir())


def test_a_check_that_cannot_stream_reads_the_whole_model_after_the_merge(hub, tmp_path):
    """The full check generates continuations (every weight read once per token): verification then reads the
    finished folder, says why, and still proves both ways before the one commit."""
    code, out, err = push(hub, tmp_path, "alice/verified-full", "--verify", "full", "--max-new-tokens", "2")
    assert code == 0, err
    assert "verification reads the whole model once it is merged: the full check generates continuations" in out
    report = json.loads(hub.read_file("alice/verified-full", "verification.json"))
    assert report["verdict"] == "pass" and report.get("mode") == "full", report["notes"]
    assert report["execution"] != EXECUTION and same_as_reference(hub, "alice/verified-full")


def test_link_holds_transfers_to_its_rate():
    """The bench Hub's bandwidth: n bytes through a link of r bytes/s take at least n/r seconds (a lower bound:
    never a speed assertion), and concurrent transfers share the one link."""
    import threading
    import time

    link = Link(4e6)
    start = time.monotonic()
    threads = [threading.Thread(target=lambda: [link.take(100_000) for _ in range(10)]) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - start >= 2 * 10 * 100_000 / 4e6 * 0.99
    unlimited = Link(None)
    unlimited.take(10**12)  # returns at once


def test_pipelined_shard_size_keeps_what_the_user_gave():
    """--max-shard-size 5GB is the user's choice, not "no choice": only a size not given is picked for the pipeline."""
    assert pipelined_shard_size("5GB", 16 * 2**30) == "5GB"
    assert pipelined_shard_size(None, 6 * 2**30) == str(384 * 2**20)
    assert pipelined_shard_size(None, 2**20) == str(256 * 2**20) and pipelined_shard_size(None, 2**40) == str(2**29)
    recipe = Recipe(base="b", adapters=[AdapterSpec(source="a")])
    assert recipe.max_shard_size is None and "max_shard_size" not in recipe.to_dict()


class _SlowHub:
    """An `HfApi` stand-in for ShardUploader: each upload waits for `release(name)` (or fails the test)."""

    def __init__(self):
        import threading

        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self.uploaded: list[str] = []

    def gate(self, name: str):
        import threading

        return self.gates.setdefault(name, threading.Event())

    def began(self, name: str):
        import threading

        return self.started.setdefault(name, threading.Event())

    def preupload_lfs_files(self, repo_id, operations, **kwargs):
        (op,) = operations
        self.began(op.path_in_repo).set()
        assert self.gate(op.path_in_repo).wait(10), f"{op.path_in_repo}: its upload was never released"
        self.uploaded.append(op.path_in_repo)


def _shards(tmp_path: Path, n: int) -> list:
    from converter.engine.writer import Shard

    out = []
    for i in range(n):
        path = tmp_path / f"model-{i}.safetensors"
        path.write_bytes(b"x" * 1000)
        out.append(Shard(path, path.name, hashlib.sha256(path.read_bytes()).hexdigest(), 1000, b"x" * 512, ()))
    return out


def test_each_shard_is_proven_while_the_one_before_uploads(tmp_path):
    """The per-shard check (a CPU-bound tensor proof) and the uploads (network-bound) overlap: shard 2's check runs
    while shard 1 is still uploading; shard 1's upload only ends once shard 2's check has started, so taking turns
    would never finish (the fake upload fails after 10 s). Every shard is checked before its own upload."""
    from converter.jobs.streaming import ShardUploader

    api, shards, checked = _SlowHub(), _shards(tmp_path, 3), []

    def check(shard):
        assert shard.name not in api.uploaded
        checked.append(shard.name)
        if len(checked) > 1:
            api.gate(shards[len(checked) - 2].name).set()  # this check is running: the previous upload may end
        if len(checked) == len(shards):
            api.gate(shard.name).set()

    uploader = ShardUploader(api, "alice/x", tmp_path / "spool", ensure_repo=lambda: None, check=check,
                             log=lambda line: None)  # fmt: skip
    for shard in shards:
        uploader.submit(shard)
    uploader.checked()
    assert checked == [s.name for s in shards]
    assert [op.path_in_repo for op in uploader.close()] == [s.name for s in shards] == api.uploaded


def test_a_failed_check_stops_the_uploads_and_nothing_queued_starts(tmp_path):
    """A check that fails is raised by `checked()`; its shard never uploads. `abort()` lets the upload in flight
    end and starts none of those queued behind it."""
    from converter.errors import VerificationFailed
    from converter.jobs.streaming import ShardUploader

    api, shards = _SlowHub(), _shards(tmp_path, 3)

    def check(shard):
        if shard.name == shards[1].name:
            assert api.began(shards[0].name).wait(10)  # the upload before it is under way
            api.gate(shards[0].name).set()
            raise VerificationFailed(f"{shard.name}: sabotaged")

    uploader = ShardUploader(api, "alice/x", tmp_path / "spool", ensure_repo=lambda: None, check=check,
                             log=lambda line: None)  # fmt: skip
    for shard in shards[:2]:
        uploader.submit(shard)
    with pytest.raises(VerificationFailed, match="model-1.safetensors: sabotaged"):
        uploader.checked()
    uploader.abort()
    assert api.uploaded == [shards[0].name]


def test_the_merge_waits_while_the_output_holds_its_shards_unless_a_reader_waits_for_a_later_one(tmp_path):
    """Without `keep`, at most SHARDS_ON_DISK output shards are on disk (the one being written counted): each goes
    once uploaded and read. A reader busy with one it has holds the merge back; one waiting for a shard not yet
    written lets it go on."""
    import threading
    import time

    from converter.jobs.streaming import SHARDS_ON_DISK, ShardUploader

    class Reader:  # reads nothing until told to, then lets go of what it holds
        def __init__(self):
            self.held, self.starved = [], False

        def arrived(self, shard, let_go):
            self.held.append(let_go)

    api, reader = _SlowHub(), Reader()
    shards = _shards(tmp_path, SHARDS_ON_DISK + 2)
    for s in shards:
        api.gate(s.name).set()  # uploads are instant here
    uploader = ShardUploader(api, "alice/x", tmp_path / "spool", ensure_repo=lambda: None, reader=reader,
                             log=lambda line: None)  # fmt: skip
    submitted = []

    def writer():
        for s in shards:
            uploader.submit(s)
            submitted.append(s.name)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    time.sleep(0.5)
    assert len(submitted) == SHARDS_ON_DISK - 1  # the next one's submit waits: with it, SHARDS_ON_DISK + 1
    assert len(list((tmp_path / "spool").iterdir())) == SHARDS_ON_DISK
    reader.held.pop(0)()  # the reader is done with the first: one goes, one more comes
    time.sleep(0.3)
    assert len(submitted) == SHARDS_ON_DISK
    reader.starved = True  # it waits for a shard not written yet: the merge must go on
    thread.join(5)
    assert len(submitted) == len(shards)
    uploader.close()


def test_with_keep_the_merge_runs_ahead_of_a_slow_upload(tmp_path):
    """A verified push keeps every shard on disk for the verification, so a slow upload does not hold the merge
    back: all shards are submitted and proven while the first upload is still stalled."""
    from converter.jobs.streaming import ShardUploader

    api, shards = _SlowHub(), _shards(tmp_path, 4)
    uploader = ShardUploader(api, "alice/x", tmp_path / "spool", ensure_repo=lambda: None, keep=True,
                             check=lambda shard: None, log=lambda line: None)  # fmt: skip
    for shard in shards:
        uploader.submit(shard)  # would block at the third shard without keep: nothing has uploaded yet
    uploader.checked()
    assert api.uploaded == [] and all(s.path.is_file() for s in shards)
    for shard in shards:
        api.gate(shard.name).set()
    assert [op.path_in_repo for op in uploader.close()] == [s.name for s in shards]
