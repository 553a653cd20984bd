"""The merge's per-block math three ways, side by side: numpy passes, torch float64 ops, the compiled fused pass.

Why: converter/engine/npkernel.py is native code built at run time; it is kept only if it wins clearly over what the
installed libraries do. One 5632x2048 bf16 weight plus a rank-16 LoRA product (the bench model's MLP shape), merged
in blocks of 16 rows (the cache-sized blocks of converter/engine/npmerge.py), on one thread; each way computes
out = bf16(W + scale * B @ A) with the float64 sum rounded once, and must give the same bits as the others:

  numpy:  BLAS product into a float64 block, then npmath's passes (widen, add, narrow with the tie fix, finite);
  torch:  addmm on the float64 block (base widened by torch), float32 conversion, the tie fix, bf16 conversion,
          finite check (torch imported first; its import time is reported apart);
  fused:  the same BLAS product, then npkernel's one pass (add, round once, finite).

    python bench/kernel_bench.py [--repeat 5] [--no-record]

Reports CPU time per element (best of --repeat, `time.thread_time`), the ratios, and whether the bits agree; appends
to bench/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

import numpy as np  # noqa: E402

from converter.engine import npkernel, npmath  # noqa: E402

ROWS, COLS, RANK, STEP = 5632, 2048, 16, 16


def inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    base = npmath.narrow(rng.standard_normal((ROWS, COLS)) * 0.02, "BF16")
    up = (rng.standard_normal((ROWS, RANK)) * 0.01).astype(np.float32)
    down = (rng.standard_normal((RANK, COLS)) * 0.01).astype(np.float32)
    return base, up.astype(np.float64) * 2.0, down.astype(np.float64)


def numpy_way(base, left, right, out):
    acc, w = np.empty((STEP, COLS)), np.empty((STEP, COLS), np.float32)
    for i in range(0, ROWS, STEP):
        np.matmul(left[i : i + STEP], right, out=acc)
        acc += npmath.widen(base[i : i + STEP], "BF16", out=w)
        npmath.narrow(acc, "BF16", out[i : i + STEP])
        assert npmath.finite(out[i : i + STEP], "BF16")


def fused_way(kernel, base, left, right, out):
    acc = np.empty((STEP, COLS))
    for i in range(0, ROWS, STEP):
        np.matmul(left[i : i + STEP], right, out=acc)
        assert kernel.add_round_bf16(acc, base[i : i + STEP], out[i : i + STEP])


def torch_way(torch, base, left, right, out):
    tb = torch.from_numpy(base.view(np.int16)).view(torch.bfloat16)
    tl, tr = torch.from_numpy(left), torch.from_numpy(right)
    to = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    for i in range(0, ROWS, STEP):
        acc = torch.addmm(tb[i : i + STEP].to(torch.float64), tl[i : i + STEP], tr)
        f = acc.to(torch.float32)
        u = f.view(torch.int32)
        tie = ((u & 0xFFFF) == 0x8000) & (f.to(torch.float64) != acc)
        if bool(tie.any()):  # a float32 exactly on a bf16 tie, the float64 not: one float32 step towards it
            away = (acc - f.to(torch.float64)).sign() == acc.sign()
            u[tie] += torch.where(away, 1, -1).to(torch.int32)[tie]
        to[i : i + STEP] = f.to(torch.bfloat16)
        assert bool(torch.isfinite(to[i : i + STEP]).all())


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best / (ROWS * COLS) * 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md")
    args = p.parse_args(argv)
    base, left, right = inputs()
    outs = {k: np.empty((ROWS, COLS), np.uint16) for k in ("numpy", "torch", "fused")}
    ns = {"numpy": timed(lambda: numpy_way(base, left, right, outs["numpy"]), args.repeat)}
    kernel = npkernel.get()
    if kernel is not None:
        ns["fused"] = timed(lambda: fused_way(kernel, base, left, right, outs["fused"]), args.repeat)
    t = time.perf_counter()
    import torch

    import_s = time.perf_counter() - t
    torch.set_num_threads(1)
    ns["torch"] = timed(lambda: torch_way(torch, base, left, right, outs["torch"]), args.repeat)
    same = {k: bool(np.array_equal(outs[k], outs["numpy"])) for k in ns}
    load = os.getloadavg()[0]
    lines = [
        f"## Per-block merge math, three ways: {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}",
        "",
        f"`python bench/kernel_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`".replace(" `", "`"),
        f"one {ROWS}x{COLS} bf16 weight + rank-{RANK} LoRA, blocks of {STEP} rows, one thread, CPU time per element "
        f"(best of {args.repeat}); load average {load:.2f}; torch import {import_s:.2f} s (not in its time)",
        "",
        "| way | ns / element | vs numpy | same bits as numpy |",
        "|---|---|---|---|",
    ]
    for k in ("numpy", "torch", "fused"):
        if k in ns:
            lines.append(f"| {k} | {ns[k]:.2f} | {ns['numpy'] / ns[k]:.2f}x | {same[k]} |")
    if kernel is None:
        lines.append("| fused | no C compiler here | | |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_record:
        with open(args.results, "a") as f:
            f.write("\n" + text)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
