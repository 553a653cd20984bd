"""Benchmark the whole Hub job, `converter push --base HUB --adapter HUB --repo ...`, through a bandwidth-limited Hub.

Why: the job a user waits for is download + merge + upload, not the local merge. This script runs the local Hub
server (converter.testing.hub, the real HTTP API) as its own process behind one shared link each way, seeds the
bench model of merge_bench.py (0.85 B bf16 Llama + rank-16 all-linear LoRA) on it, and measures side by side,
each in its own process with an empty HF cache:

  (a) download alone: `snapshot_download` of the base's files and the adapter (what any job must fetch);
  (b) upload alone: `upload_folder` of a merged-size folder (a local merge's output) to a new repo;
  (c) `converter push --no-verify` of this tree (pipelined: download, merge and upload at once, one commit);
  (d) today's sequential push: the same command from another source tree (`--baseline REF`, a git ref);
  (e) PEFT's way: download, `from_pretrained` + `PeftModel` + `merge_and_unload` + `save_pretrained`,
      `upload_folder`;
  (f) `converter push` as it runs by default: verified (each shard's tensor proof before its upload, then the
      logits check against PEFT's unmerged forward), compared with (c) and with the verification's own time.

It reports each time and the ratios to the larger of (a) and (b) (the target: (c) within 1.25x), checks that
(c)'s repo holds exactly the tensors of a local merge (bit for bit) in one commit, and appends a section to
bench/RESULTS.md (not with --small or --no-record).

    python bench/push_bench.py [--links 100/100,200/50] [--baseline REF] [--small] [--no-record]

Blobs the runs upload are removed from the server between runs (the Hub skips an upload whose bytes it already
has), so every run uploads for real. The server is a process on the same machine: its CPU (hashing and writing
what it receives) competes with the tools, which a real Hub's does not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from merge_bench import FULL, SMALL, build_inputs, machine_info  # noqa: E402

TOKEN = "hf_bench_alice_0123456789"
BASELINE = "7b83ef7"  # main before the pipelined push: merge, then upload
TARGET = 1.25

DOWNLOAD = textwrap.dedent(
    """
    from huggingface_hub import snapshot_download
    from converter.hub.sources import MODEL_FILES, ADAPTER_FILES
    snapshot_download("alice/base", allow_patterns=MODEL_FILES)
    snapshot_download("alice/lora", allow_patterns=ADAPTER_FILES)
    """
)
UPLOAD = textwrap.dedent(
    """
    import sys
    from huggingface_hub import HfApi
    api = HfApi()
    api.create_repo(sys.argv[2])
    api.upload_folder(repo_id=sys.argv[2], folder_path=sys.argv[1])
    """
)
PEFT = textwrap.dedent(
    """
    import sys, tempfile
    import torch
    from huggingface_hub import HfApi, snapshot_download
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = snapshot_download("alice/base")
    adapter = snapshot_download("alice/lora")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        api = HfApi()
        api.create_repo(sys.argv[1])
        api.upload_folder(repo_id=sys.argv[1], folder_path=out)
    """
)


@dataclass
class Run:
    name: str
    label: str
    rc: int
    wall_s: float
    cpu_s: float
    load1: float
    log: Path
    proof_s: float | None = None  # (f): the tensor proof's seconds, from the verification report in the repo


class Server:
    """The local Hub as a process of its own, behind `down`/`up` MB/s links."""

    def __init__(self, root: Path, down: float, up: float, log: Path):
        self.root = root
        cmd = [sys.executable, "-m", "converter.testing.hub", "--root", str(root), "--user", f"alice:{TOKEN}"]
        cmd += ["--down", str(down), "--up", str(up)]
        with open(log, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http"):
            raise RuntimeError("the Hub server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def seed(root: Path, base: Path, adapter: Path) -> set[str]:
    """The bench repos on the server's disk (no HTTP: seeding is not what is measured); returns their blobs."""
    from converter.testing.hub import HubServer

    hub = HubServer(root)
    if not hub.exists("alice/base"):
        hub.seed_folder("alice/base", base)
        hub.seed_folder("alice/lora", adapter)
    # Only the seeded repos' blobs: the server's disk also keeps what earlier invocations pushed, and a blob kept
    # would let the next push of the same bytes skip its upload.
    return {entry.sha256 for repo in ("alice/base", "alice/lora") for entry in hub.files(repo).values()}


def forget_uploads(root: Path, keep: set[str]) -> None:
    """Remove every blob but the seeded ones: the next run uploads for real (repo names differ per run)."""
    for p in (root / "blobs").glob("*/*"):
        if p.name not in keep:
            p.unlink()


def env_for(server: Server, home: Path, pythonpath: Path | None = None) -> dict[str, str]:
    from converter.testing.hub import client_env

    class _Url:  # client_env wants the server object only for its URL and root
        url, root = server.url, server.root

    env = client_env(_Url, TOKEN, home) | {"OPENBLAS_NUM_THREADS": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def measure(name: str, label: str, cmd: list[str], env: dict[str, str], logs: Path, cwd: Path) -> Run:
    """One run in its own process, in `cwd` (`python -m converter` imports the package found there first)."""
    log = logs / f"{name}.log"
    load1 = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=3600, cwd=cwd)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"  {label}: exit {rc}, {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
    return Run(name, label, rc, wall, cpu, load1, log)


def baseline_tree(ref: str, work: Path) -> Path:
    """`git archive` of `ref` (its converter package and keymaps), made once."""
    tree = work / f"baseline-{ref}"
    if not (tree / "converter").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(BENCH_DIR.parent), "archive", ref, "converter", "keymaps"],
                                 capture_output=True, check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def same_tensors(root: Path, repo: str, reference: Path) -> tuple[bool, int]:
    """Whether `repo` on the server holds exactly the tensors of `reference` (bit for bit), and its commits."""
    import torch
    from safetensors import safe_open

    from converter.testing.hub import HubServer

    hub = HubServer(root)
    files = hub.files(f"alice/{repo}")
    ours = {}
    for name, entry in files.items():
        if name.endswith(".safetensors"):
            with safe_open(hub._blob_path(entry.sha256), "pt") as f:
                ours.update({k: (f, name) for k in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
    ref = {}
    for path in sorted(reference.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for k in f.keys():  # noqa: SIM118
                ref[k] = path
    if ours.keys() != ref.keys():
        return False, len(hub.history(f"alice/{repo}"))
    for k, path in ref.items():
        name = ours[k][1]
        with safe_open(hub._blob_path(files[name].sha256), "pt") as a, safe_open(path, "pt") as b:
            x, y = a.get_tensor(k), b.get_tensor(k)
            if (
                x.dtype != y.dtype
                or x.shape != y.shape
                or not x.view(-1).view(torch.uint8).equal(y.view(-1).view(torch.uint8))
            ):
                return False, len(hub.history(f"alice/{repo}"))
    return True, len(hub.history(f"alice/{repo}"))


def tensor_proof_seconds(root: Path, repo: str) -> float | None:
    """The tensor proof's seconds, from the pushed repo's verification report (the published report keeps no
    other timings: a re-push of the same merge must be byte-identical)."""
    from converter.io.records import REPORT_FILE
    from converter.testing.hub import HubServer

    report = json.loads(HubServer(root).read_file(f"alice/{repo}", REPORT_FILE))
    return (report.get("tensors") or {}).get("seconds")


def run_link(down: float, up: float, args, base: Path, adapter: Path, merged: Path, work: Path) -> dict:
    tag = f"{down:g}-{up:g}"
    root, logs = work / f"hub-{tag}", work / f"logs-{tag}"
    logs.mkdir(parents=True, exist_ok=True)
    keep = seed(root, base, adapter)
    baseline = baseline_tree(args.baseline, work) if args.baseline else None
    server = Server(root, down, up, logs / "server.log")
    py = sys.executable
    runs: list[Run] = []
    stamp = time.strftime("%Y%m%d%H%M%S")  # the server keeps its repos across invocations: new names each time
    try:
        for rnd in range(args.rounds):
            print(f"link {down:g} MB/s down / {up:g} MB/s up, round {rnd + 1}", flush=True)
            verified = [py, "-m", "converter", "push", "--base", "alice/base", "--adapter", "alice/lora"]
            push = [*verified, "--no-verify"]
            plan = [
                ("download", "(a) download alone", [py, "-c", DOWNLOAD], None),
                ("upload", "(b) upload alone", [py, "-c", UPLOAD, str(merged), f"alice/upload-{stamp}-{rnd}"], None),
                ("converter", "(c) `converter push --no-verify`", [*push, "--repo", f"alice/pushed-{stamp}-{rnd}"],
                 None),
            ]  # fmt: skip
            if baseline is not None:
                cmd = [*push, "--repo", f"alice/sequential-{stamp}-{rnd}"]
                plan.append(("sequential", f"(d) sequential push ({args.baseline})", cmd, baseline))
            if not args.no_peft:
                plan.append(("peft", "(e) PEFT's way", [py, "-c", PEFT, f"alice/peft-{stamp}-{rnd}"], None))
            if not args.no_verified:
                cmd = [*verified, "--repo", f"alice/verified-{stamp}-{rnd}"]
                plan.append(("verified", "(f) `converter push` (verified)", cmd, None))
            for name, label, cmd, pythonpath in plan:
                forget_uploads(root, keep)
                home = work / "hf-home"
                shutil.rmtree(home, ignore_errors=True)
                env = env_for(server, home, pythonpath)
                run = measure(f"{name}-{rnd}", label, cmd, env, logs, pythonpath or work)
                runs.append(run)
                if name == "converter":
                    ok, commits = same_tensors(root, f"pushed-{stamp}-{rnd}", merged)
                    run.label += "" if ok and commits == 2 else " (WRONG OUTPUT)"
                    print(f"    same tensors as a local merge: {ok}; commits: {commits}", flush=True)
                if name == "verified" and run.rc == 0:
                    run.proof_s = tensor_proof_seconds(root, f"verified-{stamp}-{rnd}")
                    print(f"    tensor proof: {run.proof_s} s", flush=True)
    finally:
        server.stop()
    return {"down": down, "up": up, "runs": runs}


def best(runs: list[Run], name: str) -> Run | None:
    ok = [r for r in runs if r.name.startswith(f"{name}-") and r.rc == 0]
    return min(ok, key=lambda r: r.wall_s) if ok else None


def render(results: list[dict], info: dict, command: str, shape_tag: str, weights: int) -> str:
    lines = [
        f"## Pipelined Hub job: {info['date']}",
        "",
        f"- Machine: {info['cores']} cores, {info['ram']} RAM, CPU `{info['cpu']}`, Python {info['python']}; "
        f"converter source: {info['source']}",
        f"- Command: `{command}`; model {shape_tag} ({weights / 1e9:.2f} GB of safetensors) + rank-16 LoRA; "
        "the local Hub server in its own process, one shared link each way; empty HF cache for every run",
        "",
    ]
    for res in results:
        runs = res["runs"]
        a, b = best(runs, "download"), best(runs, "upload")
        larger = max(r.wall_s for r in (a, b) if r) if (a or b) else None
        lines += [
            f"Link {res['down']:g} MB/s down, {res['up']:g} MB/s up:",
            "",
            "| run | exit | wall (s) | CPU (s) | / larger of (a), (b) | load avg |",
            "|---|---|---|---|---|---|",
        ]
        for r in runs:
            ratio = f"{r.wall_s / larger:.2f}x" if larger and r.rc == 0 else "-"
            lines.append(f"| {r.label} | {r.rc} | {r.wall_s:.1f} | {r.cpu_s:.1f} | {ratio} | {r.load1:.2f} |")
        c, d, e, f = (best(runs, n) for n in ("converter", "sequential", "peft", "verified"))
        lines.append("")
        if c and larger:
            verdict = "met" if c.wall_s <= TARGET * larger else "**missed**"
            lines.append(f"- (c) / larger of (a), (b): **{c.wall_s / larger:.2f}x** (target {TARGET}x: {verdict})")
        if c and d:
            lines.append(f"- sequential push / pipelined push: **{d.wall_s / c.wall_s:.2f}x**")
        if c and e:
            lines.append(f"- PEFT's way / pipelined push: **{e.wall_s / c.wall_s:.2f}x**")
        if c and f:
            lines.append(
                f"- verified push (f) - unverified (c): **{f.wall_s - c.wall_s:.1f} s** wall, "
                f"{f.cpu_s - c.cpu_s:.1f} s CPU, of which the tensor proof {f.proof_s} s (shard "
                "by shard, before each upload) and the rest the behaviour check (PEFT's unmerged forward vs the merge)"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def parse_links(text: str) -> list[tuple[float, float]]:
    return [tuple(float(x) for x in pair.split("/")) for pair in text.split(",")]  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", default="100/100,200/50", help="DOWN/UP MB/s pairs, comma-separated")
    p.add_argument("--baseline", default=BASELINE, help="git ref of today's sequential push ('' to skip)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of all runs per link (fastest of each counts)")
    p.add_argument("--small", action="store_true", help="merge_bench's small model: a smoke run, nothing recorded")
    p.add_argument("--no-peft", action="store_true", help="skip (e), PEFT's way")
    p.add_argument("--no-verified", action="store_true", help="skip (f), the verified push")
    p.add_argument("--workdir", type=Path, default=BENCH_DIR / "work")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md")
    args = p.parse_args(argv)
    shape = SMALL if args.small else FULL
    work = args.workdir.resolve() / ("push-small" if args.small else "push")
    inputs = args.workdir.resolve() / ("small" if args.small else "full") / "inputs"  # merge_bench's cache
    base, adapter = build_inputs(shape, inputs)
    merged = work / "merged"
    if not (merged / "config.json").is_file():
        shutil.rmtree(merged, ignore_errors=True)
        cmd = [sys.executable, "-m", "converter", "merge", "--base", str(base), "--adapter", str(adapter), "--out",
               str(merged), "--no-verify"]  # fmt: skip
        subprocess.run(cmd, check=True, env=os.environ | {"OPENBLAS_NUM_THREADS": "1"})
    weights = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    info = machine_info()
    results = [run_link(d, u, args, base, adapter, merged, work) for d, u in parse_links(args.links)]
    command = "python bench/push_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(results, info, command.strip(), shape.tag, weights)
    print(text)
    (work / "last.json").write_text(json.dumps({"info": info}, indent=1))
    if not (args.no_record or args.small):
        with open(args.results, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
