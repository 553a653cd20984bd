"""4-bit bases and outputs: the QLoRA reference, its measured kernel noise, PEFT's own quantized merge, and the
QLoRA study (which merge base is closer to the adapters as trained).
"""

from __future__ import annotations

import gc
import json
from dataclasses import replace
from pathlib import Path

from converter.engine.checkpoint import Checkpoint
from converter.engine.merging import merge
from converter.engine.plan import qlora_hint
from converter.engine.recipe import Recipe
from converter.formats import load_adapter
from converter.io.records import PROVENANCE_FILE
from converter.io.scratch import temp_folder
from converter.verification.loading import load_model, load_reference, vocab_size
from converter.verification.metrics import Run, compare, logits_of, probe_modules, run_model, summary
from converter.verification.report import MetricSummary, QLoRAMerge, QLoRAStudy


def quantized_peft_merge(model, q: dict, batch: tuple) -> Run:
    """PEFT's merge_and_unload of the reference, rounded to the 4-bit output's float dtype, saved and reloaded
    with the output's BitsAndBytesConfig: exactly what a user gets from PEFT + transformers for the same merge."""
    import torch

    texts, probe_ids, ppl_ids, max_new_tokens = batch
    logical = getattr(torch, q["bnb_4bit_compute_dtype"])
    with temp_folder("4bit-reference") as tmp:
        model.merge_and_unload().to(logical).save_pretrained(tmp)
        config = _bnb_config(
            q["bnb_4bit_quant_type"], q["bnb_4bit_use_double_quant"], logical, q.get("llm_int8_skip_modules")
        )
        oracle = load_model(Path(tmp), logical, config)
        return run_model(oracle, texts, probe_ids, ppl_ids, max_new_tokens)


def four_bit_config(folder: Path) -> dict | None:
    """A folder's bitsandbytes 4-bit quantization_config (our 4-bit output, or a pre-quantized base), else None."""
    q = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    return q if q.get("load_in_4bit") else None


def _bnb_config(quant_type: str, double_quant: bool, dtype, skip: list[str] | None):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=skip,
    )


def four_bit_base(recipe: Recipe, base: Path) -> str | None:
    """The 4-bit type the reference's base is loaded in: the QLoRA setting, or a pre-quantized base's own."""
    if recipe.qlora_base == "dequantized":
        return recipe.qlora_quant
    own = four_bit_config(base)
    return own.get("bnb_4bit_quant_type", "fp4") if own else None


def is_qlora(recipe: Recipe, adapter_dirs: list[Path]) -> bool:
    if recipe.qlora or recipe.qlora_base == "dequantized":
        return True
    for folder in adapter_dirs:
        card = folder / "README.md"
        if qlora_hint(
            load_adapter(folder, allow_pickle=recipe.allow_pickle, require_scale=False),
            card.read_text() if card.is_file() else None,
        ):
            return True
    return False


def qlora_study(
    merged: Path,
    recipe: Recipe,
    base: Path,
    adapter_dirs: list[Path],
    dtype,
    batch: tuple,
    runs: tuple[Run, Run],
    token: str | None,
) -> QLoRAStudy:
    """QLoRA adapters: which merge base is closer to the adapters as trained (PEFT on the 4-bit base), measured.

    One of the two merges is `merged` (`runs` = its reference and its own run); the other is made here in a temp
    folder. Both are compared with the 4-bit reference and the full-precision one, and their perplexities reported
    (the claimed ~20% perplexity cost of merging onto dequantized weights is checked here, not assumed)."""
    texts, ppl_ids, max_new_tokens = batch
    ref, out = runs

    def measure(model) -> Run:
        return run_model(model, texts, None, ppl_ids, max_new_tokens)

    this = recipe.qlora_base
    other = "original" if this == "dequantized" else "dequantized"
    vocab = vocab_size(merged)
    if this == "dequantized":
        qlora_ref, full_ref = ref, measure(load_reference(base, adapter_dirs, recipe, dtype, vocab))
    else:
        quantization = qlora_quantization(replace(recipe, qlora_base="dequantized"), merged, base, dtype)
        qlora_ref, full_ref = measure(load_reference(base, adapter_dirs, recipe, dtype, vocab, quantization)), ref
    with temp_folder("qlora") as tmp:
        merge(replace(recipe, qlora_base=other, out=str(Path(tmp) / "m")), token=token, log=lambda _line: None)
        alternative = measure(load_model(Path(tmp) / "m", dtype))
    gc.collect()
    by_mode = {this: out, other: alternative}
    modes = {
        mode: QLoRAMerge(
            this_merge=mode == this,
            vs_qlora_reference=MetricSummary(**summary(compare(qlora_ref, run))),
            vs_full_precision_reference=MetricSummary(**summary(compare(full_ref, run))),
            perplexity=run.perplexity,
        )
        for mode, run in by_mode.items()
    }
    kl = {mode: m.vs_qlora_reference.mean_kl for mode, m in modes.items()}
    closer = min(kl, key=kl.get)
    farther = other if closer == this else this
    return QLoRAStudy(
        reference=f"base in {recipe.qlora_quant.upper()} 4-bit (block size {recipe.qlora_blocksize}, double "
        f"quantization {'on' if recipe.qlora_double_quant else 'off'}) + adapters through PEFT",
        modes=modes,
        closer=closer,
        kl_ratio=kl[farther] / kl[closer] if kl[closer] > 0 else float("inf"),
        perplexity_qlora_reference=qlora_ref.perplexity,
        perplexity_full_precision_reference=full_ref.perplexity,
        dequantized_perplexity_change=by_mode["dequantized"].perplexity / by_mode["original"].perplexity - 1,
    )


def qlora_quantization(recipe: Recipe, merged: Path, base: Path, dtype):
    """For a merge onto dequantized weights the reference is the QLoRA setting itself: the base loaded in 4-bit
    (the targeted linear layers only, as they were merged) with the adapters on top."""
    if recipe.qlora_base != "dequantized":
        return None

    changed = set(json.loads((merged / PROVENANCE_FILE).read_text())["tensors"]["changed"])
    ckpt = Checkpoint(base)
    untouched = [
        n.removesuffix(".weight")
        for n in ckpt.names()
        if n.endswith(".weight") and len(ckpt.info(n).shape) == 2 and n not in changed
    ]
    return _bnb_config(recipe.qlora_quant, recipe.qlora_double_quant, dtype, ["lm_head", *untouched])


def kernel_noise(model, ref: Run, inputs: list, ppl_ids, probe_ids) -> dict:
    """How far bitsandbytes' 4-bit kernels are from exact math on the very weights they hold: the reference
    (4-bit base + adapters) against itself with each 4-bit layer computing x @ dequantize(W).T, same inputs.

    A right merge onto the dequantized weights is that exact math folded into one weight, so it differs from the
    reference by this noise (plus one rounding): the yardstick is measured on this machine's kernels (their CPU
    path computes in bfloat16 where the CPU can), never a constant."""
    import bitsandbytes as bnb
    import torch

    patched = []
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):

            def exact(x, m=module):
                if getattr(m.weight.quant_state, "packing_format_for_cpu", False):
                    m.state_dict()  # bitsandbytes repacks CPU weights for its kernel; saving restores the layout
                w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).to(x.dtype)
                return torch.nn.functional.linear(x, w, None if m.bias is None else m.bias.to(x.dtype))

            module.forward = exact
            patched.append(module)
    try:
        twin = Run(logits=logits_of(model, [ppl_ids, *inputs])[1:])  # packed as run_model packs them
        with torch.no_grad():
            probe = probe_modules(model, probe_ids, "base_model.model.")
    finally:
        for module in patched:
            del module.forward  # the class's own forward again
    kl = compare(Run(logits=ref.logits), twin)["mean_kl"]
    rel = {
        name: ((probe[name] - r).norm() / r.norm().clamp_min(1e-12)).item()
        for name, r in ref.probe.items()
        if name in probe and probe[name].shape == r.shape
    }
    return {"mean_kl": kl, "module_rel_err": rel}
