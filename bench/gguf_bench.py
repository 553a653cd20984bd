"""Benchmark `converter merge --gguf Q8_0` against the usual way to a Q8_0 GGUF, side by side.

Why: a user who wants a merged LoRA as a GGUF usually runs three tools: PEFT (`from_pretrained` +
`PeftModel.from_pretrained` + `merge_and_unload` + `save_pretrained`, the tokenizer saved beside it), llama.cpp's
`convert_hf_to_gguf.py` to F16, and llama.cpp's quantizer to Q8_0. `converter merge --gguf Q8_0` does the same in one
command, verifies the merge and proves the GGUF. Both run in alternating rounds (who goes first alternates too), each
step in its own subprocess (merge_bench.py's launcher: wall, CPU and peak RSS of that process), on a Llama-shaped
random bf16 model of merge_bench.py's size with SmolLM2's tokenizer and vocabulary (so both converters accept it) and
a rank-16 all-linear PEFT LoRA, built once and cached. The usual way's wall and CPU are its three steps' sums, its
peak the largest of them; every wall time includes the `sync` after its process (so pages left unwritten count for
whoever left them). As root the page cache is dropped before each tool (before the usual way's first step only:
its steps find what the one before wrote in the cache, as converter keeps its own in memory). Afterwards
llama.cpp (llama-cpp-python) loads each Q8_0 file (and the usual way's F16 file, for scale) and evaluates one prompt;
the two Q8_0 files' logits and tensor bytes are compared, and the converter run's own proof verdict (gguf-proof.json)
and its merge's verification are reported with them.

    python bench/gguf_bench.py [--workdir DIR] [--small] [--rounds N] [--no-record] [--results FILE]

`--small` runs the same steps on the SmolLM2-135M fixture itself with a small LoRA: a smoke run of the script
(a couple of minutes), nothing recorded. Results are appended to bench/RESULTS.md otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))
from build_fixtures import cache_dir, is_complete  # noqa: E402
from merge_bench import (  # noqa: E402
    BENCH_DIR,
    FULL,
    PEFT_SCRIPT,
    RunResult,
    _param_count,
    build_inputs,
    drop_caches,
    machine_info,
    measure,
)
from verify_bench import _median_run, _phases_line, _round_ratios  # noqa: E402

from converter.testing import llama_convert  # noqa: E402

# merge_bench's Llama with SmolLM2's vocabulary and one layer fewer: 0.88 B parameters, as the other benches' 0.86 B
SHAPE = dataclasses.replace(FULL, vocab=49152, layers=15)
SMOLLM2 = "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SMALL_RANK = 4
# A smaller scale than the full run's (2): on a trained model a random LoRA of scale 2 moves the logits more than
# the quick behaviour check's bf16 bound allows, and the smoke run must pass verification to reach the GGUF
SMALL_ALPHA = 1
TYPE = "Q8_0"
PROMPT = (
    "The river rose in the night, and by morning the old bridge was under water. People gathered on the hill to "
    "watch the brown current carry branches, fences and a small red boat past the church."
)

# The PEFT way of merge_bench, and the tokenizer beside it: llama.cpp's converter reads it from the model's folder.
USUAL_MERGE = PEFT_SCRIPT + textwrap.dedent(
    """
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    """
)
# llama.cpp's quantizer (llama_model_quantize through llama-cpp-python), as converter calls it for K-quants.
QUANTIZE = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from converter.gguf import llama
    llama.quantize(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
    """
)
# One GGUF loaded by llama.cpp, the prompt tokenized by its own vocabulary and evaluated: ids and logits to files.
EVALUATE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import numpy as np
    from converter.gguf import llama
    path, prompt, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    tok = llama.tokenizer(path)
    ids = tok.tokenize(prompt.encode(), add_bos=True, special=True)
    tok.close()
    np.save(out.with_suffix(".npy"), llama.logits(path, [ids])[0])
    out.with_suffix(".json").write_text(json.dumps(ids))
    """
)
# Rows of the table: the two totals, then the usual way's steps.
STEPS = {
    "peft": "PEFT merge + `save_pretrained` (+ tokenizer)",
    "convert": "llama.cpp `convert_hf_to_gguf.py --outtype f16`",
    "quantize": f"llama.cpp's quantizer, F16 -> {TYPE}",
}
CONVERTER_LABEL = f"`converter merge --gguf {TYPE}` (merge, quick verification, GGUF written and proven)"
USUAL_LABEL = f"the usual way: PEFT, then `convert_hf_to_gguf.py` to F16, then quantize to {TYPE} (no check)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=BENCH_DIR / "work" / "gguf", help="cache and outputs")
    parser.add_argument("--small", action="store_true", help="the SmolLM2 fixture and a small LoRA: a smoke run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians are reported)")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    parser.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md", help="where results are appended")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.workdir.resolve() / ("small" if args.small else "full")
    logs = work / "logs"
    info = machine_info()
    info["versions"] += f", llama-cpp-python {_version('llama_cpp_python')}, gguf {_version('gguf')}"
    base, adapter = small_inputs(work / "inputs") if args.small else gguf_inputs(work / "inputs")
    logs.mkdir(parents=True, exist_ok=True)
    llama_root = llama_convert.unpack(llama_convert.default_sdist(), work / "llama.cpp")
    os.environ["PYTHONPATH"] = str(ROOT)  # the measured subprocesses import this tree's converter
    ours, usual = work / "out-converter", work / "usual"
    gguf_ours = ours.with_name(f"{ours.name}-GGUF") / f"{ours.name}-{TYPE}.gguf"
    # each GGUF in a folder of its own: read into the page cache alone before llama.cpp loads it
    f16, gguf_usual = usual / "F16" / "model-F16.gguf", usual / TYPE / f"model-{TYPE}.gguf"
    converter_cmd = [sys.executable, "-P", "-m", "converter", "merge", "--base", str(base), "--adapter",
                     str(adapter), "--out", str(ours), "--force", "--gguf", TYPE]  # fmt: skip
    usual_cmds = {
        "peft": [sys.executable, "-c", USUAL_MERGE, str(base), str(adapter), str(usual / "merged")],
        # llama.cpp's converter runs from its own folder (it imports its conversion/ and gguf-py/ from there)
        "convert": [
            "/bin/sh",
            "-c",
            'cd "$0" && exec "$@"',
            str(llama_root),
            *llama_convert.command([("f16", f16, usual / "merged")]),
        ],
        "quantize": [sys.executable, "-c", QUANTIZE, str(f16), str(gguf_usual), TYPE],
    }
    cold = drop_caches()
    runs: dict[str, list[RunResult]] = {name: [] for name in ("converter", "usual", *STEPS)}
    for i in range(args.rounds):
        order = ("converter", "usual") if i % 2 == 0 else ("usual", "converter")
        for tool in order:
            if tool == "converter":
                for folder in (ours, gguf_ours.parent):  # each round writes into nothing, as the usual way does
                    shutil.rmtree(folder, ignore_errors=True)
                r = _run(f"converter-{i}", converter_cmd, logs, cold)
                if r is None:
                    return 1
                runs["converter"].append(r)
                continue
            shutil.rmtree(usual, ignore_errors=True)
            for folder in (usual, f16.parent, gguf_usual.parent):
                folder.mkdir(parents=True)
            steps = []
            for j, (name, cmd) in enumerate(usual_cmds.items()):
                # the page cache dropped before the first step only: run back to back, each step finds the file
                # the one before wrote in the cache, as converter keeps its intermediate results in memory
                r = _run(f"{name}-{i}", cmd, logs, cold and j == 0)
                if r is None:
                    return 1
                runs[name].append(r)
                steps.append(r)
            runs["usual"].append(combine(f"usual-{i}", steps))
    proof = json.loads((gguf_ours.parent / "gguf-proof.json").read_text())
    verification = json.loads((ours / "verification.json").read_text())
    outputs = evaluate({"converter": gguf_ours, "usual": gguf_usual, "f16": f16}, work, logs)
    if outputs is None:
        return 1
    compared = {
        pair: compare_logits(*(outputs[n][k] for n in pair for k in ("ids", "logits")))
        for pair in (("converter", "usual"), ("converter", "f16"), ("usual", "f16"))
    }
    tensors = compare_tensors(gguf_ours, gguf_usual)
    command = f"python bench/gguf_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip()
    text = render(
        info, command, _param_count(base), args.rounds, cold, runs, outputs, compared, tensors, proof, verification
    )
    print(text)
    if not args.small and not args.no_record:
        with open(args.results, "a") as f:
            f.write(text)
    return 0 if proof["files"] and all(f["passed"] for f in proof["files"]) else 1


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "missing"


def evaluate(files: dict[str, Path], work: Path, logs: Path) -> dict[str, dict] | None:
    """llama.cpp loads each GGUF (in its own process, the file read into the page cache first) and evaluates the
    prompt: its ids, logits, size and that process's run. One evaluation first, not counted, loads the libraries."""
    outputs = {}
    for name, path in {"warm-up": next(iter(files.values())), **files}.items():
        cmd = [sys.executable, "-c", EVALUATE, str(path), PROMPT, str(work / f"eval-{name}")]
        r = _run(f"eval-{name}", cmd, logs, cold=False, warm=path.parent)
        if r is None:
            return None
        ids = json.loads((work / f"eval-{name}.json").read_text())
        outputs[name] = {"run": r, "bytes": path.stat().st_size, "ids": ids,
                         "logits": np.load(work / f"eval-{name}.npy")}  # fmt: skip
    del outputs["warm-up"]
    return outputs


def _run(name: str, cmd: list[str], logs: Path, cold: bool, warm: Path | None = None) -> RunResult | None:
    """One measured subprocess; its wall time includes the `sync` after it. None (and a line saying where its log
    is) if it failed."""
    r = measure(name, cmd, logs / f"{name}.log", cold, warm=warm)
    if not r.ok:
        print(f"{name} failed (exit {r.rc}): see {r.log}", file=sys.stderr)
        return None
    return dataclasses.replace(r, wall_s=r.wall_s + r.sync_s, sync_s=0.0)


def combine(name: str, steps: list[RunResult]) -> RunResult:
    """Consecutive processes as one run: wall and CPU add up, the peak is the largest of them (one runs at a time)."""
    return RunResult(
        name,
        0,
        sum(r.wall_s for r in steps),
        sum(r.sync_s for r in steps),
        max(r.peak_rss_mib for r in steps),
        steps[0].log,
        cpu_s=sum(r.cpu_s for r in steps),
        load1=steps[0].load1,
        cache=steps[0].cache,
    )


# ---------------------------------------------------------------------------------------------------------- inputs


def gguf_inputs(folder: Path) -> tuple[Path, Path]:
    """merge_bench's random Llama and rank-16 LoRA (cached), at SmolLM2's vocabulary, with SmolLM2's tokenizer."""
    base, adapter = build_inputs(SHAPE, folder)
    fixture = _smollm2()
    for name in TOKENIZER_FILES:
        if not (base / name).is_file():
            shutil.copy(fixture / name, base / name)
    return base, adapter


def small_inputs(folder: Path) -> tuple[Path, Path]:
    """The SmolLM2 fixture itself and a small all-linear LoRA with non-zero B (built once)."""
    base, adapter, marker = _smollm2(), folder / "adapter", folder / ".complete"
    if not marker.is_file():
        shutil.rmtree(folder, ignore_errors=True)
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        lora = LoraConfig(r=SMALL_RANK, lora_alpha=SMALL_ALPHA, target_modules="all-linear",
                          init_lora_weights=False)  # fmt: skip
        get_peft_model(model, lora).save_pretrained(adapter)
        marker.write_text("ok")
    return base, adapter


def _smollm2() -> Path:
    folder = cache_dir() / SMOLLM2
    if not is_complete(folder):
        raise SystemExit(f"the SmolLM2 fixture is missing at {folder}: run `make fixtures`")
    return folder


# ------------------------------------------------------------------------------------------------------- reporting


def compare_logits(ids_a: list[int], logits_a: np.ndarray, ids_b: list[int], logits_b: np.ndarray) -> dict:
    """Two files' logits over the same prompt: max abs difference, relative RMS, top-1 agreement. Tokenized
    differently, the logits are not comparable: only that is said."""
    if list(ids_a) != list(ids_b):
        return {"same_tokens": False, "tokens": (len(ids_a), len(ids_b))}
    a, b = np.asarray(logits_a, dtype=np.float64), np.asarray(logits_b, dtype=np.float64)
    diff = a - b
    return {
        "same_tokens": True,
        "tokens": len(ids_a),
        "max_abs": float(np.abs(diff).max()),
        "span": float(max(np.abs(a).max(), np.abs(b).max())),
        "rel_rms": float(np.sqrt(np.mean(diff**2)) / max(np.sqrt(np.mean(b**2)), 1e-30)),
        "top1": int(np.sum(a.argmax(-1) == b.argmax(-1))),
    }


def compare_tensors(a: Path, b: Path) -> dict:
    """Two GGUF files' tensor data: how many tensors are byte-identical and, of all of them, how many blocks (a
    quantized type's unit: Q8_0's 32 weights and their scale; one value of a float type) differ."""
    import gguf

    theirs = {t.name: t for t in gguf.GGUFReader(b).tensors}
    out = {"tensors": 0, "identical": 0, "blocks": 0, "blocks_differing": 0, "unmatched": 0}
    for t in gguf.GGUFReader(a).tensors:
        out["tensors"] += 1
        u = theirs.pop(t.name, None)
        if u is None or u.tensor_type != t.tensor_type or tuple(u.shape) != tuple(t.shape):
            out["unmatched"] += 1
            continue
        unit = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
        x = np.asarray(t.data).view(np.uint8).reshape(-1, unit)
        y = np.asarray(u.data).view(np.uint8).reshape(-1, unit)
        differing = int((x != y).any(axis=1).sum())
        out["identical"] += differing == 0
        out["blocks"] += len(x)
        out["blocks_differing"] += differing
    out["unmatched"] += len(theirs)
    return out


def render(info: dict, command: str, params: str, rounds: int, cold: bool, runs: dict[str, list[RunResult]],
           outputs: dict, compared: dict, tensors: dict, proof: dict, verification: dict) -> str:  # fmt: skip
    """The Markdown section: timings, the bold ratio line, both outputs run by llama.cpp, their logits and tensors,
    the proof."""
    rows = []
    labels = {"converter": CONVERTER_LABEL, "usual": USUAL_LABEL, **{k: f"   {v}" for k, v in STEPS.items()}}
    for name, label in labels.items():
        m = _median_run(runs[name])
        walls = " / ".join(f"{r.wall_s:.1f}" for r in runs[name])
        cpus = " / ".join(f"{r.cpu_s:.1f}" for r in runs[name])
        loads = " / ".join(f"{r.load1:.1f}" for r in runs[name])
        rows.append(f"| {label} | {m.wall_s:.1f} s ({walls}) | {m.cpu_s:.1f} s ({cpus}) | {m.peak_rss_mib:.0f} MiB "
                    f"| {loads} |")  # fmt: skip
    wall, cpu, peak = _round_ratios(runs["converter"], runs["usual"])
    files = []
    for name, label in (("converter", f"converter's {TYPE}"), ("usual", f"the usual way's {TYPE}"),
                        ("f16", "the usual way's F16 (for scale)")):  # fmt: skip
        out = outputs[name]
        files.append(f"| {label} | {out['bytes'] / 2**20:.0f} MiB | {len(out['ids'])} | "
                     f"{out['run'].wall_s:.1f} s, {out['run'].peak_rss_mib:.0f} MiB |")  # fmt: skip
    return "\n".join(
        [
            f"\n## `converter merge --gguf {TYPE}` vs the usual way to a GGUF: {info['date']} ({params}, "
            f"{'cold' if cold else 'warm'} cache, {rounds} alternating rounds)",
            "",
            f"Command: `{command}`. Machine: {info['cores']} cores, {info['ram']}, {info['cpu']}; "
            f"{info['versions']}; converter {info['source']}. Median of the rounds (each round in brackets) of wall "
            "time (with the `sync` after each process), CPU time (user + system) and peak RSS; the usual way's wall "
            "and CPU are its steps' sums, its peak their largest; load average (1 min) at the start of each run.",
            "",
            "| run | wall | CPU | peak RSS | load avg |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"**converter / the usual way (median of the rounds' ratios): wall {wall:.2f}x, CPU {cpu:.2f}x, peak RSS "
            f"{peak:.2f}x** (below 1: converter is cheaper).",
            "",
            "| output | size | prompt tokens | llama.cpp load + evaluation (wall, peak RSS) |",
            "|---|---|---|---|",
            *files,
            "",
            _logits_line(compared),
            "",
            _tensors_line(tensors),
            "",
            _proof_line(proof, verification),
            "",
        ]
    )


def _logits_line(compared: dict) -> str:
    """The two files' logits against each other, and each against the F16 file's, which says how far apart two
    quantizations of the same weights usually are."""
    c = compared["converter", "usual"]
    if not c["same_tokens"]:
        a, b = c["tokens"]
        return f"llama.cpp tokenized the prompt differently in the two files ({a} and {b} tokens): logits not compared."
    scale = []
    for name, label in (("converter", "converter's"), ("usual", "the usual way's")):
        f = compared[name, "f16"]
        if f["same_tokens"]:
            scale.append(f"{label} {f['rel_rms']:.2g} ({f['top1']}/{f['tokens']} same top-1)")
    return (
        f"**Logits of the two {TYPE} files** over the prompt's {c['tokens']} tokens: max abs difference "
        f"{c['max_abs']:.3g} (logits up to {c['span']:.3g} in size), relative RMS difference {c['rel_rms']:.2g}, "
        f"same top-1 token at {c['top1']}/{c['tokens']} positions. Against the usual way's F16 file, relative RMS: "
        + ("; ".join(scale) or "not compared (tokenized differently)")
        + "."
    )


def _tensors_line(t: dict) -> str:
    unmatched = f"; {t['unmatched']} not in both files alike (name, type, shape)" if t["unmatched"] else ""
    return (
        f"Tensor data of the two {TYPE} files: {t['identical']} of {t['tensors']} tensors byte-identical; "
        f"{t['blocks_differing']:,} of {t['blocks']:,} blocks differ ({TYPE}: 32 weights and their scale; F32: one "
        f"value){unmatched}."
    )


def _proof_line(proof: dict, verification: dict) -> str:
    parts = []
    for f in proof["files"]:
        detail = "; ".join(f"{p['name']} {'ok' if p['passed'] else 'FAILED'}" for p in f["parts"])
        behaviour = next((p["detail"] for p in f["parts"] if p["name"] == "behaviour"), None)
        parts.append(f"{f['file']}: **{'pass' if f['passed'] else 'FAIL'}** ({detail})"
                     + (f"; behaviour: {behaviour}" if behaviour else ""))  # fmt: skip
    llama_cpp = "" if proof.get("llama_cpp", True) else " (llama.cpp missing: tokenizer and behaviour not proven)"
    return (
        f"converter's own proof (gguf-proof.json){llama_cpp}: {'; '.join(parts)}. Its merge's verification "
        f"(verification.json): {verification.get('verdict')}, {verification.get('seconds')} s of the run"
        + (f"; {_phases_line('phases', verification)}" if verification.get("phase_seconds") else ".")
    )


if __name__ == "__main__":
    sys.exit(main())
