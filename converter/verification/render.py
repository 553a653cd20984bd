"""The verification report in Markdown, the one place it is written in words, for the log, the app and the model
card: the verdict, then each proof plainly (the tensors against their referee, the behaviour table), then what is
wrong or worth knowing; the card's section adds a diffusion merge's images."""

from __future__ import annotations

import math

from converter.verification.metrics import NOISE_MARGIN
from converter.verification.report import (
    DiffusionBehaviour,
    ImageRow,
    LLMBehaviour,
    LogitComparison,
    QLoRAStudy,
    VerificationReport,
)
from converter.verification.tensors import TensorProofResult

KEYMAP_PLACEMENT = "module placement from converter's keymap, as in the merge"
VERDICT = {"pass": "**Passed**", "fail": "**FAILED**", "skipped": "**Not verified**"}


def markdown(report: VerificationReport) -> str:
    if report.verdict == "skipped" and report.behaviour is None:
        why = "; ".join(n.split(": ", 1)[-1] for n in report.notes) or "no proof could run"
        return f"**Not verified**: verification was skipped because {why}."
    if report.verdict == "skipped":
        head = "**Not verified**: no referee could judge the tensors; the behaviour alone does not prove them."
    else:
        proofs = "two proofs" if report.tensors is not None and report.behaviour is not None else "one proof"
        head = f"{VERDICT[report.verdict]} ({proofs})."
    lines = [head, ""]
    lines += _tensors(report.tensors, report.tensors_skipped)
    lines += [""] + _behaviour(report)
    for p in report.problems:
        lines.append(f"\n- problem: {p}")
    for n in report.notes:
        lines.append(f"\n- note: {n}")
    return "\n".join(lines).rstrip()  # no blank line after it in the log


def _tensors(result: TensorProofResult | None, skipped: str | None) -> list[str]:
    if result is None:
        return [f"**Tensors**: not proven ({skipped or 'no referee'})."]
    ref = result.referee
    placed = "" if ref.independent else f"; {ref.shared or KEYMAP_PLACEMENT}"
    if result.passed:
        head = f"**Tensors**: every tensor within rounding of base + ΔW (referee: {ref.name}{placed})."
    else:
        wrong = result.failed + len(result.missing) + len(result.extra)
        head = f"**Tensors**: {wrong} tensor(s) are not base + ΔW (referee: {ref.name}{placed})."
    lines = [head, ""]
    facts = f"{result.changed} tensors changed by the adapters"
    if result.elements:
        exact = 1 - result.inexact / result.elements
        facts += f": {exact:.2%} of their {result.elements:,} elements exactly base + ΔW rounded to the output dtype"
        if result.inexact and result.worst is not None:
            facts += (
                f", the others within their rounding bound (worst {ratio_text(result.worst.ratio)}x, "
                f"`{result.worst.name}`)"
            )
    facts += f"; {result.untouched} untouched tensors compared with the base byte for byte."
    if result.added:
        facts += f" Added from the adapters, the base having none: {_names(result.added)} (the class's head)."
    if result.dropped:
        facts += f" Left out of the base, the class having no such module: {_names(result.dropped)}."
    facts += f" {ref.detail}."
    facts += "".join(f" Note: {n}." for n in ref.notes)
    lines.append(facts)
    if len(result.groups) > 1:
        lines += ["", "| component | tensors | changed | worst error / rounding bound | wrong |"]
        lines.append("|---|---|---|---|---|")
        for name, g in result.groups.items():
            lines.append(f"| {name} | {g.tensors} | {g.changed} | {ratio_text(g.worst_ratio)} | {g.failed} |")
    return lines


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _behaviour(report: VerificationReport) -> list[str]:
    b = report.behaviour
    lines = []
    if isinstance(b, LLMBehaviour):
        lines = _llm(b)
    elif isinstance(b, DiffusionBehaviour):
        lines = _diffusion(b)
    else:
        lines = [f"**Behaviour**: not compared ({report.behaviour_skipped or 'no reference model'})."]
    if report.images:
        psnr = ", ".join(f"{i.psnr:.1f} dB (max {i.max_abs})" for i in report.images)
        lines.append(f"\nImages (fixed seed, a few steps) of the base, the reference and the merge; merged vs "
                     f"reference PSNR: {psnr}.")  # fmt: skip
    return lines


def _llm(b: LLMBehaviour) -> list[str]:
    m, bare, tol = b.merged_vs_reference, b.base_vs_reference, b.tolerance
    check = {"quick": "quick check: logits", "full": "full check: logits and greedy continuations"}[b.mode]

    def cells(x: LogitComparison) -> list[str]:
        return [
            f"{x.mean_kl:.3g}",
            _share(x),
            f"{x.top1_agreement:.2%}",
            f"{x.max_abs_logit_diff:.3g} / {x.mean_abs_logit_diff:.3g}",
            f"{x.greedy_identical}/{x.greedy_total}",
            f"{x.perplexity:.3g}",
        ]

    rows = [
        ("mean KL(reference‖model)", f"≤ {tol.mean_kl:.3g}", True),
        (f"top-1 agreement, confident positions ({m.confident_positions})",
         f"≥ {tol.confident_top1_agreement:.0%}", True),
        ("top-1 agreement, all positions", "", True),
        ("max / mean abs logit diff", "", True),
        ("greedy continuations identical", "", m.greedy_total > 0),  # --verify full only
        # NaN: a model that is not a language model has no perplexity
        (f"perplexity (reference {m.perplexity_reference:.3g})", "", m.perplexity == m.perplexity),
    ]  # fmt: skip
    columns = ("metric", "merged vs reference", "base vs reference", "pass if")
    table = [columns, ("---",) * 4] + [
        (metric, merged, base, passes)
        for (metric, passes, shown), merged, base in zip(rows, cells(m), cells(bare) if bare else cells(m), strict=True)
        if shown
    ]
    lines = [
        f"**Behaviour**: the merged model was compared with {b.reference} ({check} on {b.inputs.count} "
        f"prompts, {b.compute_dtype} compute, weights in {b.output_dtype}).",
        "",
        *("| " + " | ".join(row if bare else (*row[:2], row[3])) + " |" for row in table),
    ]
    if not bare:
        lines.append("\nThe bare base and the perplexity text were not run: the tensor proof already shows what the "
                     "adapters change, tensor by tensor (`--verify full` runs both).")  # fmt: skip
    if tol.kernel_noise_mean_kl is not None:
        lines.append(
            f"\nThe reference runs bitsandbytes' 4-bit kernels, measured {tol.kernel_noise_mean_kl:.3g} mean KL "
            f"from exact math on their own weights: the KL threshold is rounding + {NOISE_MARGIN:g}x that noise."
        )
    if b.qlora:
        lines += ["", *_qlora(b.qlora)]
    lines.append(f"\n- ran as: {b.execution}")
    if b.offloaded:
        lines.append("\n- note: the models did not fit in memory and ran with weights offloaded to disk (accelerate)")
    return lines


def _diffusion(b: DiffusionBehaviour) -> list[str]:
    tol = b.tolerance
    lines = [
        f"**Behaviour**: the merged pipeline was compared with {b.reference} (components "
        f"{', '.join(b.inputs.components)} on fixed seeded inputs, denoiser at timesteps "
        f"{', '.join(map(str, b.inputs.timesteps))}; {b.compute_dtype} compute, weights in {b.output_dtype}).",
        "",
        "| component | relative error merged vs reference | base vs reference | max abs diff | pass if |",
        "|---|---|---|---|---|",
    ]
    for name, c in b.components.items():
        m, bare = c.merged_vs_reference, c.base_vs_reference
        lines.append(f"| {name} | {m.rel_err:.3g} | {bare.rel_err:.3g} | {m.max_abs:.3g} | "
                     f"≤ {tol.output_rel_err:.3g} and < 0.25× base |")  # fmt: skip
    return lines


def _qlora(q: QLoRAStudy) -> list[str]:
    lines = [
        f"**QLoRA**: the adapters were trained on a 4-bit base. Both merge bases against the training setting "
        f"({q.reference}):",
        "",
        "| merge base | mean KL vs 4-bit reference | top-1 agreement | mean KL vs full-precision reference | "
        "perplexity |",
        "|---|---|---|---|---|",
    ]
    for mode in ("original", "dequantized"):
        m = q.modes[mode]
        name = f"{mode} (this merge)" if m.this_merge else mode
        lines.append(
            f"| {name} | {m.vs_qlora_reference.mean_kl:.3g} | {m.vs_qlora_reference.top1_agreement:.2%} "
            f"| {m.vs_full_precision_reference.mean_kl:.3g} | {m.perplexity:.4g} |"
        )
    lines += [
        "",
        f"Closer to the 4-bit reference: **{q.closer}** (mean KL {q.kl_ratio:.3g}x lower). Perplexity of the "
        f"4-bit reference {q.perplexity_qlora_reference:.4g}, of the full-precision reference "
        f"{q.perplexity_full_precision_reference:.4g}; the dequantized merge's is "
        f"{q.dequantized_perplexity_change:+.1%} relative to the original merge's.",
    ]
    return lines


def ratio_text(ratio: float) -> str:
    """A tensor's error in units of its rounding bound ("∞" where it is not finite)."""
    return "∞" if not math.isfinite(ratio) else f"{ratio:.3g}"


def _share(metrics: LogitComparison) -> str:
    """Confident top-1 agreement, or n/a when the reference was never confident (tiny random models)."""
    return f"{metrics.confident_top1_agreement:.2%}" if metrics.confident_positions else "n/a"


def card_section(report: VerificationReport | None) -> str | None:
    """The model card's verification section: the report, then a diffusion merge's images as a grid (None: not
    verified, which the card says in its own words)."""
    if report is None:
        return None
    return "\n".join([markdown(report).strip(), *_image_grid(report.images, report.reference)])


def _image_grid(images: list[ImageRow], reference: str = "") -> list[str]:
    """A diffusion verification's images (saved in the folder, paths relative to it) as a small grid: one row per
    prompt, base | reference | merged; the reference column says which referee made it."""
    if not images:
        return []
    role = "reference (published formula)" if "formula" in reference else "reference (unmerged)"
    lines = ["", f"| prompt | base | {role} | merged | PSNR merged vs reference |", "|---|---|---|---|---|"]
    for i in images:
        cells = " | ".join(f"![{r}]({getattr(i, r)})" for r in ("base", "reference", "merged"))
        lines.append(f"| {i.prompt} | {cells} | {i.psnr:.1f} dB (max diff {i.max_abs}) |")
    return lines
