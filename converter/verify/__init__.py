"""Prove a merge: the merged folder must behave like the base with the adapters applied *unmerged* (PEFT itself).

One load gives the reference and the bare base (PEFT's disable_adapter()); the merged model loads after it, never
together. Weights stay in their own dtype and each layer is upcast to float32 while it runs (precision.py), so the
only expected difference is the one rounding of each merged weight to its dtype; thresholds are derived from that
dtype's unit roundoff, or, for a reference on a 4-bit base, from its kernels' noise measured on the same inputs.
The bare base is measured too, so a merge that changed nothing fails. `mode="quick"` (the default) judges on one
batched forward per model; "full" adds greedy continuations for the card. The module probe of the merged model
runs only when the verdict is a fail. Modules: metrics (runs and thresholds), loading (models, offload, inputs),
precision (float32 compute), fourbit (4-bit references and the QLoRA study), report (JSON + Markdown).
"""

from __future__ import annotations

import gc
import json
import resource
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from converter.dtypes import TORCH_TO_ST
from converter.recipe import Recipe
from converter.records import REPORT_FILE
from converter.scratch import temp_folder
from converter.units import human_bytes
from converter.verify.fourbit import (
    four_bit_base,
    four_bit_config,
    is_qlora,
    kernel_noise,
    qlora_quantization,
    qlora_study,
    quantized_peft_merge,
)
from converter.verify.loading import (
    PERPLEXITY_TEXT,
    PROMPTS,
    Offload,
    available_memory,
    build_inputs,
    choose_placement,
    load_model,
    load_reference,
    load_tokenizer,
    own_dtype,
    resident_bytes,
    upcast_working_set,
    vocab_size,
    weights_summary,
)
from converter.verify.metrics import (
    NOISE_MARGIN,
    UNIT_ROUNDOFF,
    Run,
    compare,
    first_disagreement,
    mixed_batch,
    probe_modules,
    run_model,
    tolerance,
)
from converter.verify.precision import float32_compute
from converter.verify.report import Clock, markdown, side_by_side, skipped_report

MODES = ("quick", "full")

__all__ = [
    "MODES",
    "NOISE_MARGIN",
    "PROMPTS",
    "REPORT_FILE",
    "UNIT_ROUNDOFF",
    "Offload",
    "Run",
    "markdown",
    "require_pass",
    "tolerance",
    "verify",
]


def verify(
    merged: Path,
    recipe: Recipe,
    *,
    prompts: list[str] | None = None,
    max_new_tokens: int = 16,
    memory: int | None = None,
    token: str | None = None,
    log: Callable[[str], None] = print,
    mode: str = "quick",
    single_file_config: str | None = None,
) -> dict:
    """Compare `merged` with base + adapters (unmerged); returns the report (also written next to the model).

    `memory` caps the bytes the models may take (default: what the machine has available); a model larger than
    that is verified with accelerate's disk offloading, slower but exact. `mode`: "quick" judges on the logits
    alone (the verdict never used more); "full" also runs `max_new_tokens` greedy tokens per prompt for the card."""
    if mode not in MODES:
        raise ValueError(f"verification mode {mode!r}: use one of {', '.join(MODES)}")
    from converter.verify.warmup import wait

    wait()  # a warm-up import started beside the merge (cli) must finish before this thread imports anything
    merged = Path(merged)
    if (merged / "model_index.json").is_file() or not (merged / "config.json").is_file():
        # a diffusers pipeline or a single diffusion file: diffusers' own loader, else the published formula
        from converter.verify.diffusion import verify_diffusion

        return verify_diffusion(merged, recipe, token=token, log=log, single_file_config=single_file_config)
    with temp_folder("verify", log=log) as scratch:
        return _verify(merged, recipe, prompts, (mode, max_new_tokens), memory, token, log, Path(scratch))


def _verify(
    merged: Path,
    recipe: Recipe,
    prompts: list[str] | None,
    mode_tokens: tuple[str, int],
    memory: int | None,
    token: str | None,
    log: Callable[[str], None],
    scratch: Path,
) -> dict:
    import torch

    from converter.sources import fetch

    started = time.time()
    mode, max_new_tokens = mode_tokens
    new_tokens = max_new_tokens if mode == "full" else 0
    output_dtype, params = weights_summary(merged)
    stored_4bit = four_bit_config(merged)
    # Weights kept in their own dtype, float32 per layer (precision.py); 4-bit paths load in the compute dtype,
    # and so does the full check: upcasting every layer again for each greedy token cost ~4x its forward on the
    # 0.85 B bench model (bench/RESULTS.md), so it holds a float32 copy where that fits.
    own = mode == "quick" and not stored_4bit and recipe.qlora_base != "dequantized"
    budget = memory or available_memory()
    # Streamed (own dtype, precision.py): the weights stay mapped from their files, untouched; only the working set
    # (one block in float32, buffers, activations) is resident.
    stored_bytes, working = (0, upcast_working_set(merged)) if own else (4, None)
    placement = choose_placement(params, budget, scratch, stored_bytes, working)
    if placement is None:
        return skipped_report(
            merged,
            f"the model needs about {human_bytes(params * 2)} to load, {human_bytes(budget)} of memory is available "
            f"and {scratch} has too little disk to offload the rest",
        )
    compute, offload = placement
    if offload and (stored_4bit or recipe.qlora_base == "dequantized"):
        return skipped_report(
            merged, f"4-bit models cannot be offloaded to disk and this one needs more than {human_bytes(budget)}"
        )
    if offload:
        log(
            f"the model does not fit in {human_bytes(budget)}: offloading weights to disk (accelerate), computing "
            f"in {compute}; slower, exact"
        )
    dtype = getattr(torch, compute)
    base = fetch(recipe.base, "model", token).local
    adapter_dirs = []
    for spec in recipe.adapters:
        local = fetch(spec.source, "adapter", token).local
        adapter_dirs.append(local if local.is_dir() else local.parent)
    tok = load_tokenizer(merged, " ".join([*(prompts or PROMPTS), PERPLEXITY_TEXT]))
    inputs, probe_ids, ppl_ids, template = build_inputs(tok, prompts or PROMPTS, vocab_size(merged))

    four_bit = four_bit_base(recipe, base)
    own = own and offload is None and not four_bit and compute == "float32"
    kind = f"{four_bit} 4-bit base" if four_bit else "base"
    log(
        f"verifying {merged.name} ({mode}): reference = {kind} + {len(adapter_dirs)} adapter(s) through PEFT "
        f"({compute} compute)"
    )

    def lean(model, sources):  # float32 compute over weights kept in their own dtype, read from their files
        return float32_compute(model, sources) if own else nullcontext()

    def peft_reference(quantization):
        """PEFT's unmerged model and (when computing from the files) where its base weights came from."""
        sources: dict | None = {} if own else None
        model = load_reference(
            base,
            adapter_dirs,
            recipe,
            own_dtype(base) if own else dtype,
            vocab_size(merged),
            quantization,
            offload,
            sources=sources,
        )
        return model, sources

    clock = Clock()
    try:
        quantization = qlora_quantization(recipe, merged, base, dtype)
        reference_model, ref_sources = peft_reference(quantization)
    except (ValueError, KeyError, RuntimeError) as e:  # PEFT refuses the adapter on this base
        return skipped_report(
            merged, f"PEFT cannot apply the adapters to this base unmerged ({str(e).splitlines()[0][:200]})"
        )
    clock.lap("load reference")
    with lean(reference_model, ref_sources):
        both = mixed_batch(reference_model, inputs, ppl_ids) if own and len(adapter_dirs) == 1 else None
        if both:  # quick: reference and bare base in one forward, the base weights read once
            ref, bare = both
            noise = None
        else:
            # The module probe only where it is needed on a pass: a 4-bit reference's per-module noise
            probe = probe_ids if four_bit else None
            ref = run_model(reference_model, inputs, probe, ppl_ids, new_tokens, prefix="base_model.model.")
            # A 4-bit reference: how far its kernels are from exact math on its own weights, measured
            noise = kernel_noise(reference_model, ref, inputs, ppl_ids, probe_ids) if four_bit else None
            with reference_model.disable_adapter():
                bare = run_model(reference_model, inputs, None, ppl_ids, new_tokens)
    clock.lap("run reference and bare base")
    reference = "the base + adapters applied unmerged through PEFT"
    if stored_4bit:  # 4-bit weights cannot match an unmerged model to rounding: judge against PEFT's own merge,
        # quantized by transformers' own 4-bit loader, both computing in the dtype the weights were quantized from
        logical = stored_4bit["bnb_4bit_compute_dtype"]
        output_dtype, compute, dtype = TORCH_TO_ST[getattr(torch, logical)], logical, getattr(torch, logical)
        ref = quantized_peft_merge(reference_model, stored_4bit, (inputs, probe_ids, ppl_ids, new_tokens))
        reference = f"PEFT's own merge quantized to {stored_4bit['bnb_4bit_quant_type'].upper()} by transformers"
        clock.lap("4-bit reference: PEFT merge, save, quantized load, run")
    # Collect the reference before the merged model loads, unless (streamed) it holds little but mappings: a
    # full collection costs ~0.4 s after transformers' imports
    if resident_bytes(reference_model, ref_sources) > 2**29:
        del reference_model
        gc.collect()
    else:
        del reference_model

    candidate_sources: dict | None = {} if own else None
    candidate = load_model(merged, own_dtype(merged) if own else dtype, offload=offload, sources=candidate_sources)
    clock.lap("load merged")
    with lean(candidate, candidate_sources):
        out = run_model(candidate, inputs, None, ppl_ids, new_tokens)
    clock.lap("run merged")

    tol = tolerance(output_dtype, TORCH_TO_ST[dtype])
    if noise and not stored_4bit:  # the 4-bit reference's own noise bounds the agreement a right merge can reach
        tol = {
            **tol,
            "mean_kl": tol["mean_kl"] + NOISE_MARGIN * noise["mean_kl"],
            "confident_top1_agreement": min(tol["confident_top1_agreement"], 0.99),  # as for any inexact compute
            "kernel_noise_mean_kl": noise["mean_kl"],
        }
    merged_vs_ref = compare(ref, out)
    base_vs_ref = compare(ref, bare)
    merged_vs_ref["perplexity_reference"] = ref.perplexity
    base_vs_ref["perplexity_reference"] = ref.perplexity
    problems = []
    if merged_vs_ref["mean_kl"] > tol["mean_kl"]:
        problems.append(f"mean KL(reference‖merged) {merged_vs_ref['mean_kl']:.3g} > {tol['mean_kl']:.3g}")
    if merged_vs_ref["confident_top1_agreement"] < tol["confident_top1_agreement"]:
        problems.append(
            f"top-1 agreement where the reference is confident {merged_vs_ref['confident_top1_agreement']:.2%} "
            f"< {tol['confident_top1_agreement']:.0%}"
        )
    effect = base_vs_ref["mean_kl"]
    notes = []
    if effect <= tol["mean_kl"]:
        notes.append("the adapters barely change the base here: a merge that did nothing could not be told apart")
    elif merged_vs_ref["mean_kl"] >= 0.25 * effect:
        problems.append("the merged model is as far from the reference as the bare base is (was anything merged?)")
    culprit = None
    if problems and not stored_4bit:  # only a fail needs the module probe: merged, then the reference reloaded
        with lean(candidate, candidate_sources), torch.no_grad():
            out.probe = probe_modules(candidate, probe_ids, "")
        del candidate
        gc.collect()
        if not ref.probe:
            reference_model, ref_sources = peft_reference(quantization)
            with lean(reference_model, ref_sources), torch.no_grad():
                ref.probe = probe_modules(reference_model, probe_ids, "base_model.model.")
            del reference_model
        clock.lap("module probe (on failure)")
        module_noise = (noise or {}).get("module_rel_err", {})
        culprit = first_disagreement(ref.probe, out.probe, tol["module_rel_err"], module_noise)
    else:
        del candidate
    study = is_qlora(recipe, adapter_dirs) and not four_bit_config(base) and not stored_4bit
    if not own or study:  # streamed models hold little but mappings: no full collection needed before the end
        gc.collect()
    if culprit:
        problems.append(
            f"first module that disagrees: {culprit['module']} (relative error {culprit['relative_error']:.3g})"
        )
    qlora = None
    if study:
        log("QLoRA adapters: measuring both merge bases against the 4-bit training setting")
        batch = (inputs, ppl_ids, new_tokens)
        qlora = qlora_study(merged, recipe, base, adapter_dirs, dtype, batch, (ref, out), token)
        clock.lap("QLoRA study: other merge, 4-bit reference")
    report = {
        "verdict": "fail" if problems else "pass",
        "problems": problems,
        "notes": notes,
        "mode": mode,
        "reference": reference,
        "compute_dtype": compute,
        # Weights as held in memory: their own dtype, upcast per layer while computing (or the compute dtype)
        "weights_in_memory": output_dtype if own else TORCH_TO_ST[dtype],
        "offloaded": offload is not None,  # weights beyond offload_memory_bytes went to disk (accelerate)
        # How the forwards ran (bench/RESULTS.md measures each way): the card says it
        "execution": _execution(own, offload is not None, both is not None),
        "offload_memory_bytes": offload.max_memory if offload else None,
        "output_dtype": stored_4bit["bnb_4bit_quant_type"].upper() if stored_4bit else output_dtype,
        "tolerance": tol,
        "inputs": {
            "count": len(inputs),
            "chat_template": template,
            "tokenizer": tok is not None,
            "max_new_tokens": new_tokens,
        },
        "merged_vs_reference": merged_vs_ref,
        "base_vs_reference": base_vs_ref,
        "first_disagreeing_module": culprit,
        "generations": side_by_side(tok, prompts or PROMPTS, bare, ref, out) if new_tokens else [],
        "qlora": qlora,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": round(time.time() - started, 1),
        "phase_seconds": clock.phases,
    }
    report["markdown"] = markdown(report)
    (merged / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _execution(streamed: bool, offloaded: bool, one_batch: bool) -> str:
    weights = (
        "weights read block by block from their files into float32 buffers (never the whole model in memory)"
        if streamed
        else "weights offloaded to disk by accelerate"
        if offloaded
        else "each model loaded whole in the compute dtype"
    )
    bare = "one PEFT mixed-adapter batch" if one_batch else "two forwards (PEFT's disable_adapter for the bare base)"
    return f"{weights}; the reference and the bare base in {bare}; the merged model after them"


def require_pass(report: dict) -> None:
    from converter.errors import VerificationFailed

    if report["verdict"] == "fail":
        raise VerificationFailed("verification failed: " + "; ".join(report["problems"]))
