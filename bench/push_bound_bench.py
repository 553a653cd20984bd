"""Benchmark a verified `converter push` held to a few shards of disk and a fixed memory, at two model sizes.

Why: people merge into models bigger than their machine's free disk and memory. A verified push from the Hub
streams (the base's files deleted once merged and compared, the output's once uploaded and compared), so its
scratch disk and memory must not grow with the model, and both proofs must still run. This script seeds two
synthetic bf16 Llama bases (hidden 2048, 16 and 32 layers, in 256 MB shards, as the issue that asked for it had)
and a rank-16 all-linear LoRA each on the local Hub (its own process, no link limit unless --link), then, for each
size, alternating:

  (u) `converter push` (verified, the default) with the temp folder and HF cache on the machine's disk;
  (c) the same push with the temp folder and HF cache on a loop-mounted file system of the model's size / 2.5
      and inside a memory cgroup of the model's size / 2 (page cache charged to it, as a container's is).

Measured: wall time, peak scratch (the used bytes of the loop file system, or of the temp folder and HF cache,
sampled every 0.1 s from outside the job), peak RSS of the push process (and the cgroup's peak, page cache
included). Checked: exit 0, the pushed repo holds exactly the tensors of a local merge (bit for bit), and its
verification.json says both proofs ran and passed.

    sudo python bench/push_bound_bench.py [--rounds 3] [--layers 16,32] [--link 100] [--no-record]

Needs root (a loop mount and a cgroup v1 memory controller); without them it runs only (u).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from merge_bench import FULL, MiB, Shape, build_inputs, machine_info, make_cgroup, memory_cgroup_root, remove_cgroup  # noqa: E402
from push_bench import Server, env_for, forget_uploads, same_tensors  # noqa: E402

SHARD = "256MB"
DISK_SHARE, MEMORY_SHARE = 2.5, 2.0  # the capped run's scratch disk and memory: the model's size divided by these


@dataclass
class Run:
    label: str
    layers: int
    rc: int
    wall_s: float
    scratch_peak: int
    rss_peak: int
    cgroup_peak: int | None
    proofs: str
    same: bool
    log: Path
    caps: dict = field(default_factory=dict)


class Sampler:
    """The largest used bytes of `probe()` seen every 0.1 s on a thread, until stopped."""

    def __init__(self, probe):
        self.probe, self.peak, self._stop = probe, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, self.probe())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            self.peak = max(self.peak, self.probe())
        return self.peak


def used_in(*folders: Path) -> int:
    """Bytes allocated under `folders` (sparse holes not counted)."""
    total = 0
    for folder in folders:
        for root, _, names in os.walk(folder):
            for n in names:
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(root, n)).st_blocks * 512
    return total


def fs_used(mount: Path) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@contextlib.contextmanager
def loop_fs(image: Path, mount: Path, size: int):
    """An ext4 file system of `size` bytes mounted at `mount` (removed afterwards)."""
    image.unlink(missing_ok=True)
    subprocess.run(["truncate", "-s", str(size), str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        image.unlink(missing_ok=True)


def push(label: str, layers: int, repo: str, server: Server, scratch: Path, logs: Path, group: Path | None,
         reference: Path, probe) -> Run:  # fmt: skip
    """One verified push of alice/base-L{layers} + its LoRA into alice/{repo}, measured from outside."""
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    env = env_for(server, scratch / "hf-home") | {"TMPDIR": str(scratch / "tmp")}
    cmd = [sys.executable, "-m", "converter", "push", "--repo", f"alice/{repo}", "--base", f"alice/base-l{layers}",
           "--adapter", f"alice/lora-l{layers}"]  # fmt: skip
    log, peak_kib = logs / f"{repo}.log", logs / f"{repo}.maxrss"
    # /usr/bin/time starts the push and reports its peak: a child of this (large) process would inherit its
    # high-water mark in ru_maxrss.
    cmd = ["/usr/bin/time", "-f", "%M", "-o", str(peak_kib), *cmd]
    baseline = probe()
    sampler = Sampler(probe)
    start = time.perf_counter()
    with open(log, "w") as f:
        pre = (lambda: open(group / "cgroup.procs", "w").write(str(os.getpid()))) if group else None  # noqa: SIM115
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=BENCH_DIR.parent, preexec_fn=pre)
    wall = time.perf_counter() - start
    peak = sampler.stop() - baseline
    rss = int(peak_kib.read_text().split()[-1]) * 1024 if peak_kib.is_file() else 0
    cgroup_peak = int((group / "memory.max_usage_in_bytes").read_text()) if group else None
    proofs, same = "-", False
    if rc == 0:
        from converter.testing.hub import HubServer

        report = json.loads(HubServer(server.root).read_file(f"alice/{repo}", "verification.json"))
        ran = [p for p, skipped in (("tensors", "tensors_skipped"), ("behaviour", "behaviour_skipped"))
               if report.get(skipped) is None]  # fmt: skip
        proofs = f"{report['verdict']}: {' + '.join(ran)}"
        same = same_tensors(server.root, repo, reference)[0]
    run = Run(label, layers, rc, wall, peak, rss, cgroup_peak, proofs, same, log)
    print(f"  L{layers} {label}: exit {rc}, {wall:.1f} s, scratch peak {peak / MiB:.0f} MiB, peak RSS "
          f"{run.rss_peak / MiB:.0f} MiB, {proofs}, same as a local merge: {same}", flush=True)  # fmt: skip
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", default="16,32", help="the bases' layer counts (hidden 2048)")
    parser.add_argument("--link", type=float, default=0, help="MB/s each way between the Hub and the job (0: none)")
    parser.add_argument("--work", default="/tmp/converter-push-bound-bench")
    parser.add_argument("--unlimited-only", action="store_true", help="skip the capped runs")
    parser.add_argument("--disk-share", type=float, default=DISK_SHARE, help="capped scratch disk: the model / this")
    parser.add_argument("--memory-share", type=float, default=MEMORY_SHARE, help="capped memory: the model / this")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    work = Path(args.work)
    logs = work / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    sizes = [int(n) for n in args.layers.split(",")]
    models = {}
    for layers in sizes:
        shape = Shape(**{**FULL.__dict__, "layers": layers})
        base, adapter = build_inputs(shape, work / f"inputs-l{layers}", shard=SHARD)
        weights = sum(p.stat().st_size for p in base.glob("*.safetensors"))
        reference = work / f"reference-l{layers}"
        if not (reference / "config.json").is_file():
            shutil.rmtree(reference, ignore_errors=True)
            merge = ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(reference), "--no-verify"]
            subprocess.run([sys.executable, "-m", "converter", *merge], check=True, cwd=BENCH_DIR.parent)
        models[layers] = (base, adapter, weights, reference)
    root = work / "hub"
    shutil.rmtree(root, ignore_errors=True)
    from converter.testing.hub import HubServer

    hub = HubServer(root)
    for layers, (base, adapter, _, _) in models.items():
        hub.seed_folder(f"alice/base-l{layers}", base)
        hub.seed_folder(f"alice/lora-l{layers}", adapter)
    seeded = [f"alice/{kind}-l{layers}" for layers in models for kind in ("base", "lora")]
    keep = {entry.sha256 for repo in seeded for entry in hub.files(repo).values()}
    server = Server(root, args.link or 0, args.link or 0, logs / "server.log")
    group_root = memory_cgroup_root()
    can_cap = os.geteuid() == 0 and shutil.which("mkfs.ext4") is not None and group_root is not None
    runs: list[Run] = []
    try:
        for i in range(args.rounds):
            for layers, (_, _, weights, reference) in models.items():
                for capped in (False, True) if i % 2 == 0 else (True, False):
                    if capped and (args.unlimited_only or not can_cap):
                        continue
                    forget_uploads(root, keep)
                    scratch = work / "scratch"
                    shutil.rmtree(scratch, ignore_errors=True)
                    repo = f"out-l{layers}-{'c' if capped else 'u'}{i}"
                    if not capped:
                        scratch.mkdir(parents=True)
                        runs.append(push("unlimited", layers, repo, server, scratch, logs, None, reference,
                                         lambda s=scratch: used_in(s)))  # fmt: skip
                        continue
                    disk, memory = int(weights / args.disk_share), int(weights / args.memory_share)
                    with loop_fs(work / "scratch.img", scratch, disk) as mount:
                        group, _ = make_cgroup(group_root, f"push-bound-{os.getpid()}-{repo}", memory // MiB)
                        try:
                            run = push("capped", layers, repo, server, mount, logs, group, reference,
                                       lambda m=mount: fs_used(m))  # fmt: skip
                        finally:
                            remove_cgroup(group)
                    run.caps = {"disk": disk, "memory": memory}
                    runs.append(run)
    finally:
        server.stop()
    text = render(runs, models, args)
    print(text)
    if not args.no_record:
        with open(BENCH_DIR / "RESULTS.md", "a") as f:
            f.write("\n" + text)
    return 0 if all(r.rc == 0 and r.same for r in runs) else 1


def render(runs: list[Run], models: dict, args) -> str:
    info = machine_info()
    lines = [
        f"## push_bound_bench: a verified push in a few shards ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"- Command: `python bench/push_bound_bench.py --rounds {args.rounds} --layers {args.layers}"
        + (f" --link {args.link:g}" if args.link else "")
        + "`; converter "
        + info.get("source", "?"),
        f"- Machine: {info.get('cpu', '?')}, load average at start {os.getloadavg()[0]:.2f}",
        "- Bases: synthetic bf16 Llama, hidden 2048, in 256 MB shards, rank-16 all-linear LoRA; the local Hub in its "
        "own process; capped: temp folder and HF cache on a loop-mounted ext4 of the model's size / 2.5, the push "
        "in a memory cgroup of the model's size / 2 (page cache charged)",
        "",
        "| model | run | exit | wall (s), median | scratch peak | peak RSS | cgroup peak | proofs | repo = merge |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for layers, (_, _, weights, _) in models.items():
        for label in ("unlimited", "capped"):
            mine = [r for r in runs if r.layers == layers and r.label == label]
            if not mine:
                continue
            caps = mine[0].caps
            what = (
                f"{label} ({caps['disk'] / MiB:.0f} MiB disk, {caps['memory'] / MiB:.0f} MiB memory)" if caps else label
            )
            lines.append(
                f"| L{layers}, {weights / 2**30:.2f} GiB | {what} | {','.join(str(r.rc) for r in mine)} | "
                f"{statistics.median(r.wall_s for r in mine):.1f} | "
                f"{max(r.scratch_peak for r in mine) / MiB:.0f} MiB | "
                f"{max(r.rss_peak for r in mine) / MiB:.0f} MiB | "
                + (f"{max(r.cgroup_peak for r in mine) / MiB:.0f} MiB" if mine[0].cgroup_peak else "-")
                + f" | {mine[0].proofs} | {all(r.same for r in mine)} |"
            )
    for layers in models:
        u = [r.wall_s for r in runs if r.layers == layers and r.label == "unlimited"]
        c = [r.wall_s for r in runs if r.layers == layers and r.label == "capped"]
        if u and c:
            ratio = statistics.median(c) / statistics.median(u)
            lines.append(f"\n- L{layers}: capped / unlimited wall time, medians: **{ratio:.2f}x**")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
