"""The verification report: markdown for the card and the log, the skipped report, the phase clock."""

from __future__ import annotations

import json
import time
from pathlib import Path

from converter.records import REPORT_FILE
from converter.verify.metrics import NOISE_MARGIN, Run


class Clock:
    """Seconds per phase: the verification benchmark compares the loads and the forward passes with one load."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self._last, 2)
        self._last = now


def skipped_report(merged: Path, reason: str) -> dict:
    report = {
        "verdict": "skipped",
        "problems": [],
        "notes": [reason],
        "markdown": f"**Not verified**: verification was skipped because {reason}.",
    }
    (merged / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def side_by_side(tok, prompts: list[str], bare: Run, ref: Run, out: Run, count: int = 3) -> list[dict]:
    def text(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else " ".join(map(str, ids))

    return [
        {
            "prompt": prompts[i] if tok is not None else f"(random token ids #{i})",
            "base": text(bare.generations[i]),
            "reference": text(ref.generations[i]),
            "merged": text(out.generations[i]),
        }
        for i in range(min(count, len(ref.generations)))
    ]


def markdown(report: dict) -> str:
    m, b, tol = report["merged_vs_reference"], report["base_vs_reference"], report["tolerance"]
    verdict = {"pass": "**Passed**", "fail": "**FAILED**"}[report["verdict"]]
    check = {"quick": "quick check: logits", "full": "full check: logits and greedy continuations"}
    lines = [
        f"{verdict}: the merged model was compared with {report.get('reference', 'the base + adapters')} "
        f"({check[report.get('mode', 'full')]} on {report['inputs']['count']} prompts, {report['compute_dtype']} "
        f"compute, weights in {report['output_dtype']}).",
        "",
        "| metric | merged vs reference | base vs reference | pass if |",
        "|---|---|---|---|",
        f"| mean KL(reference‖model) | {m['mean_kl']:.3g} | {b['mean_kl']:.3g} | ≤ {tol['mean_kl']:.3g} |",
        f"| top-1 agreement, confident positions ({m['confident_positions']}) | "
        f"{_share(m)} | {_share(b)} | "
        f"≥ {tol['confident_top1_agreement']:.0%} |",
        f"| top-1 agreement, all positions | {m['top1_agreement']:.2%} | {b['top1_agreement']:.2%} | |",
        f"| max / mean abs logit diff | {m['max_abs_logit_diff']:.3g} / {m['mean_abs_logit_diff']:.3g} | "
        f"{b['max_abs_logit_diff']:.3g} / {b['mean_abs_logit_diff']:.3g} | |",
        f"| perplexity (reference {m['perplexity_reference']:.3g}) | {m['perplexity']:.3g} | {b['perplexity']:.3g} | |",
    ]
    if m["greedy_total"]:  # --verify full
        lines.insert(
            -1,
            f"| greedy continuations identical | {m['greedy_identical']}/{m['greedy_total']} | "
            f"{b['greedy_identical']}/{b['greedy_total']} | |",
        )
    if "kernel_noise_mean_kl" in tol:
        lines.append(
            f"\nThe reference runs bitsandbytes' 4-bit kernels, measured {tol['kernel_noise_mean_kl']:.3g} mean KL "
            f"from exact math on their own weights: the KL threshold is rounding + {NOISE_MARGIN:g}x that noise."
        )
    if report.get("qlora"):
        lines += ["", *_qlora_markdown(report["qlora"])]
    for p in report["problems"]:
        lines.append(f"\n- problem: {p}")
    for n in report["notes"]:
        lines.append(f"\n- note: {n}")
    if report.get("execution"):
        lines.append(f"\n- ran as: {report['execution']}")
    if report.get("offloaded"):
        lines.append("\n- note: the models did not fit in memory and ran with weights offloaded to disk (accelerate)")
    return "\n".join(lines)


def _qlora_markdown(q: dict) -> list[str]:
    modes = q["modes"]
    lines = [
        f"**QLoRA**: the adapters were trained on a 4-bit base. Both merge bases against the training setting "
        f"({q['reference']}):",
        "",
        "| merge base | mean KL vs 4-bit reference | top-1 agreement | mean KL vs full-precision reference | "
        "perplexity |",
        "|---|---|---|---|---|",
    ]
    for mode in ("original", "dequantized"):
        m = modes[mode]
        name = f"{mode} (this merge)" if m["this_merge"] else mode
        lines.append(
            f"| {name} | {m['vs_qlora_reference']['mean_kl']:.3g} | {m['vs_qlora_reference']['top1_agreement']:.2%} "
            f"| {m['vs_full_precision_reference']['mean_kl']:.3g} | {m['perplexity']:.4g} |"
        )
    lines += [
        "",
        f"Closer to the 4-bit reference: **{q['closer']}** (mean KL {q['kl_ratio']:.3g}x lower). Perplexity of the "
        f"4-bit reference {q['perplexity_qlora_reference']:.4g}, of the full-precision reference "
        f"{q['perplexity_full_precision_reference']:.4g}; the dequantized merge's is "
        f"{q['dequantized_perplexity_change']:+.1%} relative to the original merge's.",
    ]
    return lines


def _share(metrics: dict) -> str:
    """Confident top-1 agreement, or n/a when the reference was never confident (tiny random models)."""
    return f"{metrics['confident_top1_agreement']:.2%}" if metrics["confident_positions"] else "n/a"
