"""Prove a merge: the merged folder must behave like the base with the adapters applied *unmerged* (PEFT itself).

Reference and merged model are loaded one after the other, never together. Both run in float32 when that fits
in memory, so the only expected difference is the one rounding of each merged weight to its dtype; thresholds
are derived from that dtype's unit roundoff. The bare base is measured too, so a merge that changed nothing fails.
"""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from converter.dtypes import TORCH_TO_ST
from converter.errors import ConverterError
from converter.recipe import Recipe
from converter.units import human_bytes

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers.",
]
PERPLEXITY_TEXT = (
    "The quick brown fox jumps over the lazy dog. Rivers flow to the sea, and the sea gives back the rain. "
    "Every merge should be checked before it is published."
)
# Unit roundoff of each output dtype: the relative error of rounding one weight once.
UNIT_ROUNDOFF = {"F32": 2.0**-24, "F16": 2.0**-11, "BF16": 2.0**-8}
REPORT_FILE = "verification.json"
CONFIDENT_GAP = 0.5  # nats between the reference's top-1 and top-2 logits


@dataclass
class Run:
    """What one model produced on the verification inputs."""

    logits: list = field(default_factory=list)  # per input: float32 [positions, vocab]
    generations: list[list[int]] = field(default_factory=list)
    perplexity: float = float("nan")
    probe: dict = field(default_factory=dict)  # leaf module name -> output on the probe input


def tolerance(output_dtype: str, compute_dtype: str) -> dict:
    """Pass thresholds from rounding: mean KL grows with the square of the weights' relative rounding error."""
    u = max(UNIT_ROUNDOFF.get(output_dtype, 2.0**-8), UNIT_ROUNDOFF.get(compute_dtype, 2.0**-24))
    return {
        "mean_kl": 100 * u * u + 1e-9,
        # Judged only where the reference is decided (top-1 beats top-2 by CONFIDENT_GAP nats): on near-ties
        # any rounding may flip the argmax, and overfit or random models have many of them.
        "confident_top1_agreement": 1.0 if u < 1e-6 else 0.99,
        "module_rel_err": 4 * u + 1e-5,
    }


def _compare(ref: Run, other: Run) -> dict:
    max_abs, abs_sum, count, kl_sum, agree, positions, sure, sure_agree = 0.0, 0.0, 0, 0.0, 0, 0, 0, 0
    for r, o in zip(ref.logits, other.logits, strict=True):
        n = min(r.shape[-1], o.shape[-1])  # a resized vocabulary: compare the shared rows
        r, o = r[:, :n], o[:, :n]
        diff = (r - o).abs()
        max_abs = max(max_abs, diff.max().item())
        abs_sum += diff.sum().item()
        count += diff.numel()
        lr, lo = r.double().log_softmax(-1), o.double().log_softmax(-1)  # float32 KL has a ~1e-7 noise floor
        kl_sum += (lr.exp() * (lr - lo)).sum(-1).clamp_min(0).sum().item()
        same = r.argmax(-1) == o.argmax(-1)
        top2 = r.topk(2, dim=-1).values
        confident = (top2[:, 0] - top2[:, 1]) > CONFIDENT_GAP
        agree += same.sum().item()
        sure += confident.sum().item()
        sure_agree += (same & confident).sum().item()
        positions += r.shape[0]
    divergence = []
    for a, b in zip(ref.generations, other.generations, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        divergence.append(first)
    return {
        "max_abs_logit_diff": max_abs,
        "mean_abs_logit_diff": abs_sum / max(count, 1),
        "mean_kl": kl_sum / max(positions, 1),
        "top1_agreement": agree / max(positions, 1),
        "confident_positions": sure,
        "confident_top1_agreement": sure_agree / sure if sure else 1.0,
        "greedy_identical": sum(d is None for d in divergence),
        "greedy_total": len(divergence),
        "first_divergence": divergence,
        "perplexity": other.perplexity,
    }


def verify(
    merged: Path,
    recipe: Recipe,
    *,
    prompts: list[str] | None = None,
    max_new_tokens: int = 16,
    memory: int | None = None,
    token: str | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Compare `merged` with base + adapters (unmerged); returns the report (also written next to the model).

    `memory` caps the bytes the models may take (default: what the machine has available); a model larger than
    that is verified with accelerate's disk offloading, slower but exact."""
    with tempfile.TemporaryDirectory(prefix="converter-verify-") as scratch:
        return _verify(Path(merged), recipe, prompts, max_new_tokens, memory, token, log, Path(scratch))


def _verify(
    merged: Path,
    recipe: Recipe,
    prompts: list[str] | None,
    max_new_tokens: int,
    memory: int | None,
    token: str | None,
    log: Callable[[str], None],
    scratch: Path,
) -> dict:
    import torch

    from converter.sources import fetch

    started = time.time()
    if (merged / "model_index.json").is_file() or not (merged / "config.json").is_file():
        return _skipped(
            merged,
            "the base is a diffusion model; its merge is checked against diffusers' own LoRA loader in "
            "converter's tests, and there is no per-merge generation check for it yet",
        )
    output_dtype, params = _weights(merged)
    budget = memory or _available()
    compute, offload = _placement(params, budget, scratch)
    if offload and (_four_bit(merged) or recipe.qlora_base == "dequantized"):
        return _skipped(
            merged, f"4-bit models cannot be offloaded to disk and this one needs more than {human_bytes(budget)}"
        )
    if offload and shutil.disk_usage(scratch).free < params * 2 * 2:
        return _skipped(
            merged,
            f"the model needs about {human_bytes(params * 2)} to load, {human_bytes(budget)} of memory is available "
            f"and {scratch} has too little disk to offload the rest",
        )
    if offload:
        log(f"the model does not fit in {human_bytes(budget)}: offloading weights to disk (accelerate); slower, exact")
    dtype = getattr(torch, compute)
    base = fetch(recipe.base, "model", token).local
    adapter_dirs = []
    for spec in recipe.adapters:
        local = fetch(spec.source, "adapter", token).local
        adapter_dirs.append(local if local.is_dir() else local.parent)
    tok = _tokenizer(merged, " ".join([*(prompts or PROMPTS), PERPLEXITY_TEXT]))
    inputs, probe_ids, ppl_ids, template = _inputs(tok, prompts or PROMPTS, _vocab(merged))

    four_bit = _four_bit_base(recipe, base)
    kind = f"{four_bit} 4-bit base" if four_bit else "base"
    log(f"verifying {merged.name}: reference = {kind} + {len(adapter_dirs)} adapter(s) through PEFT ({compute})")
    clock = Clock()
    try:
        quantization = _quantization(recipe, merged, base, dtype)
        reference_model = _reference(base, adapter_dirs, recipe, dtype, _vocab(merged), quantization, offload)
    except (ValueError, KeyError, RuntimeError) as e:  # PEFT refuses the adapter on this base
        return _skipped(
            merged, f"PEFT cannot apply the adapters to this base unmerged ({str(e).splitlines()[0][:200]})"
        )
    clock.lap("load reference")
    ref = _run(reference_model, inputs, probe_ids, ppl_ids, max_new_tokens, prefix="base_model.model.")
    with reference_model.disable_adapter():
        bare = _run(reference_model, inputs, None, ppl_ids, max_new_tokens)
    clock.lap("run reference and bare base")
    reference = "the base + adapters applied unmerged through PEFT"
    stored_4bit = _four_bit(merged)
    if stored_4bit:  # 4-bit weights cannot match an unmerged model to rounding: judge against PEFT's own merge,
        # quantized by transformers' own 4-bit loader, both computing in the dtype the weights were quantized from
        logical = stored_4bit["bnb_4bit_compute_dtype"]
        output_dtype, compute, dtype = TORCH_TO_ST[getattr(torch, logical)], logical, getattr(torch, logical)
        ref = _quantized_peft_merge(reference_model, stored_4bit, (inputs, probe_ids, ppl_ids, max_new_tokens))
        reference = f"PEFT's own merge quantized to {stored_4bit['bnb_4bit_quant_type'].upper()} by transformers"
        clock.lap("4-bit reference: PEFT merge, save, quantized load, run")
    del reference_model
    gc.collect()

    candidate = _load(merged, dtype, offload=offload)
    clock.lap("load merged")
    out = _run(candidate, inputs, probe_ids, ppl_ids, max_new_tokens)
    del candidate
    gc.collect()
    clock.lap("run merged")

    # bitsandbytes' 4-bit kernels do not reproduce a float32 matmul bit for bit: judge at half precision then.
    reference_precision = "F16" if four_bit else "F32"
    tol = tolerance(output_dtype, reference_precision if compute == "float32" else output_dtype)
    merged_vs_ref = _compare(ref, out)
    base_vs_ref = _compare(ref, bare)
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
    culprit = _first_disagreement(ref.probe, out.probe, tol["module_rel_err"]) if problems and not stored_4bit else None
    if culprit:
        problems.append(
            f"first module that disagrees: {culprit['module']} (relative error {culprit['relative_error']:.3g})"
        )
    qlora = None
    if _is_qlora(recipe, adapter_dirs) and not _four_bit(base) and not stored_4bit:
        log("QLoRA adapters: measuring both merge bases against the 4-bit training setting")
        batch = (inputs, ppl_ids, max_new_tokens)
        qlora = _qlora_study(merged, recipe, base, adapter_dirs, dtype, batch, (ref, out), token)
        clock.lap("QLoRA study: other merge, 4-bit reference")
    report = {
        "verdict": "fail" if problems else "pass",
        "problems": problems,
        "notes": notes,
        "reference": reference,
        "compute_dtype": compute,
        "offloaded": offload is not None,  # weights beyond offload_memory_bytes went to disk (accelerate)
        "offload_memory_bytes": offload.max_memory if offload else None,
        "output_dtype": stored_4bit["bnb_4bit_quant_type"].upper() if stored_4bit else output_dtype,
        "tolerance": tol,
        "inputs": {
            "count": len(inputs),
            "chat_template": template,
            "tokenizer": tok is not None,
            "max_new_tokens": max_new_tokens,
        },
        "merged_vs_reference": merged_vs_ref,
        "base_vs_reference": base_vs_ref,
        "first_disagreeing_module": culprit,
        "generations": _side_by_side(tok, prompts or PROMPTS, bare, ref, out),
        "qlora": qlora,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": round(time.time() - started, 1),
        "phase_seconds": clock.phases,
    }
    report["markdown"] = markdown(report)
    (merged / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


class Clock:
    """Seconds per phase: the verification benchmark compares the loads and the forward passes with one load."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self._last, 2)
        self._last = now


@dataclass
class Offload:
    """accelerate's disk offloading: what stays in memory, and where the rest goes."""

    max_memory: int
    folder: Path

    def kwargs(self) -> dict:
        folder = tempfile.mkdtemp(dir=self.folder)  # one per model loaded: offloaded files must not mix
        return {"device_map": "auto", "max_memory": {"cpu": self.max_memory}, "offload_folder": folder}

    def peft_safe(self, base: Path) -> Path:
        """The base seen through a path PEFT's disk-offload rewrite can use safely.

        PEFT 0.21 (`PeftModel._update_offload`) writes a renamed copy of every offloaded base shard at
        `os.path.join(*path.split(os.sep))` with "-peft" appended to the first path part containing "--": an
        absolute path loses its leading "/" (the copy lands under the working directory) and a path without "--"
        is overwritten in place. A relative path through a `models--*` link in our scratch folder sends the copy
        to a sibling inside the scratch folder, removed with it."""
        link = self.folder / f"models--reference-{uuid.uuid4().hex[:8]}"
        link.symlink_to(base.resolve(), target_is_directory=True)
        relative = Path(os.path.relpath(link))
        if next(part for part in relative.parts if "--" in part) != link.name:
            raise ConverterError(f"{self.folder}: the temp folder's path contains '--'; set TMPDIR elsewhere")
        return relative


def _placement(params: int, budget: int, scratch: Path) -> tuple[str, Offload | None]:
    """float32 when one fp32 copy fits comfortably, else bfloat16, else bfloat16 with most weights on disk."""
    if params * 4 * 1.5 < budget:
        return "float32", None
    if params * 2 * 1.5 < budget:
        return "bfloat16", None
    return "bfloat16", Offload(budget // 2, scratch)  # the other half: activations, logits, one layer loaded


def _load(folder: Path, dtype, quantization=None, offload: Offload | None = None):
    from transformers import AutoModelForCausalLM

    extra = {"quantization_config": quantization} if quantization else {}
    if offload:
        extra.update(offload.kwargs())
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra).eval()


def _quantized_peft_merge(model, q: dict, batch: tuple) -> Run:
    """PEFT's merge_and_unload of the reference, rounded to the 4-bit output's float dtype, saved and reloaded
    with the output's BitsAndBytesConfig: exactly what a user gets from PEFT + transformers for the same merge."""
    import torch

    texts, probe_ids, ppl_ids, max_new_tokens = batch
    logical = getattr(torch, q["bnb_4bit_compute_dtype"])
    with tempfile.TemporaryDirectory(prefix="converter-4bit-reference-") as tmp:
        model.merge_and_unload().to(logical).save_pretrained(tmp)
        config = _bnb_config(
            q["bnb_4bit_quant_type"], q["bnb_4bit_use_double_quant"], logical, q.get("llm_int8_skip_modules")
        )
        oracle = _load(Path(tmp), logical, config)
        return _run(oracle, texts, probe_ids, ppl_ids, max_new_tokens)


def _four_bit(folder: Path) -> dict | None:
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


def _skipped(merged: Path, reason: str) -> dict:
    report = {
        "verdict": "skipped",
        "problems": [],
        "notes": [reason],
        "markdown": f"**Not verified**: verification was skipped because {reason}.",
    }
    (merged / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _weights(folder: Path) -> tuple[str, int]:
    """The dtype most parameters are stored in, and the parameter count (from safetensors headers)."""
    from converter.checkpoint import Checkpoint

    ckpt = Checkpoint(folder)
    counts: dict[str, int] = {}
    for name in ckpt.names():
        info = ckpt.info(name)
        counts[info.dtype] = counts.get(info.dtype, 0) + info.numel
    return max(counts, key=counts.get), sum(counts.values())


def _available() -> int:
    """Memory this process may still use: MemAvailable, capped by its memory cgroup's limit (v1 or v2)."""
    free = 8 * 2**30
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            free = int(line.split()[1]) * 1024
    try:
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return free
    for line in groups:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            limit, usage = Path(f"/sys/fs/cgroup{path}/memory.max"), Path(f"/sys/fs/cgroup{path}/memory.current")
        elif "memory" in controllers.split(","):
            folder = Path(f"/sys/fs/cgroup/memory{path}")
            limit, usage = folder / "memory.limit_in_bytes", folder / "memory.usage_in_bytes"
        else:
            continue
        try:
            cap = limit.read_text().strip()
            if cap != "max" and int(cap) < 2**60:
                free = min(free, int(cap) - int(usage.read_text()))
        except (OSError, ValueError):
            continue
    return max(free, 0)


def _vocab(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    return int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size"))


def _tokenizer(folder: Path, sample: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        return None
    # Some model types get a tokenizer with only special tokens when the folder has no tokenizer files.
    return tok if len(set(tok(sample).input_ids)) >= 3 else None


def _inputs(tok, prompts: list[str], vocab: int):
    """Token ids for each prompt (chat template when there is one); random ids when the model has no tokenizer."""
    import torch

    if tok is None:
        g = torch.Generator().manual_seed(0)
        inputs = [torch.randint(0, vocab, (1, 12 + 3 * i), generator=g) for i in range(len(prompts))]
        return inputs, inputs[0][:, :16], torch.randint(0, vocab, (1, 48), generator=g), False
    template = bool(getattr(tok, "chat_template", None))
    inputs = []
    for prompt in prompts:
        if template:
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = prompt
        inputs.append(tok(text, return_tensors="pt", add_special_tokens=not template).input_ids)
    ppl = tok(PERPLEXITY_TEXT, return_tensors="pt").input_ids
    return inputs, inputs[0][:, :16], ppl, template


def _four_bit_base(recipe: Recipe, base: Path) -> str | None:
    """The 4-bit type the reference's base is loaded in: the QLoRA setting, or a pre-quantized base's own."""
    if recipe.qlora_base == "dequantized":
        return recipe.qlora_quant
    own = _four_bit(base)
    return own.get("bnb_4bit_quant_type", "fp4") if own else None


def _is_qlora(recipe: Recipe, adapter_dirs: list[Path]) -> bool:
    from converter.formats import load_adapter
    from converter.merge import qlora_hint

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


def _qlora_study(
    merged: Path,
    recipe: Recipe,
    base: Path,
    adapter_dirs: list[Path],
    dtype,
    batch: tuple,
    runs: tuple[Run, Run],
    token: str | None,
) -> dict:
    """QLoRA adapters: which merge base is closer to the adapters as trained (PEFT on the 4-bit base), measured.

    One of the two merges is `merged` (`runs` = its reference and its own run); the other is made here in a temp
    folder. Both are compared with the 4-bit reference and the full-precision one, and their perplexities reported
    (the claimed ~20% perplexity cost of merging onto dequantized weights is checked here, not assumed)."""
    from converter.merge import merge

    texts, ppl_ids, max_new_tokens = batch
    ref, out = runs

    def measure(model) -> Run:
        return _run(model, texts, None, ppl_ids, max_new_tokens)

    this = recipe.qlora_base
    other = "original" if this == "dequantized" else "dequantized"
    vocab = _vocab(merged)
    if this == "dequantized":
        qlora_ref, full_ref = ref, measure(_reference(base, adapter_dirs, recipe, dtype, vocab))
    else:
        quantization = _quantization(replace(recipe, qlora_base="dequantized"), merged, base, dtype)
        qlora_ref, full_ref = measure(_reference(base, adapter_dirs, recipe, dtype, vocab, quantization)), ref
    with tempfile.TemporaryDirectory(prefix="converter-qlora-") as tmp:
        merge(replace(recipe, qlora_base=other, out=str(Path(tmp) / "m")), token=token, log=lambda _line: None)
        alternative = measure(_load(Path(tmp) / "m", dtype))
    gc.collect()
    by_mode = {this: out, other: alternative}
    modes = {
        mode: {
            "this_merge": mode == this,
            "vs_qlora_reference": _summary(_compare(qlora_ref, run)),
            "vs_full_precision_reference": _summary(_compare(full_ref, run)),
            "perplexity": run.perplexity,
        }
        for mode, run in by_mode.items()
    }
    kl = {mode: m["vs_qlora_reference"]["mean_kl"] for mode, m in modes.items()}
    closer = min(kl, key=kl.get)
    farther = other if closer == this else this
    return {
        "reference": f"base in {recipe.qlora_quant.upper()} 4-bit (block size {recipe.qlora_blocksize}, double "
        f"quantization {'on' if recipe.qlora_double_quant else 'off'}) + adapters through PEFT",
        "modes": modes,
        "closer": closer,
        "kl_ratio": kl[farther] / kl[closer] if kl[closer] > 0 else float("inf"),
        "perplexity_qlora_reference": qlora_ref.perplexity,
        "perplexity_full_precision_reference": full_ref.perplexity,
        "dequantized_perplexity_change": by_mode["dequantized"].perplexity / by_mode["original"].perplexity - 1,
    }


def _summary(metrics: dict) -> dict:
    keys = ("mean_kl", "max_abs_logit_diff", "top1_agreement", "greedy_identical", "greedy_total")
    return {k: metrics[k] for k in keys}


def _quantization(recipe: Recipe, merged: Path, base: Path, dtype):
    """For a merge onto dequantized weights the reference is the QLoRA setting itself: the base loaded in 4-bit
    (the targeted linear layers only, as they were merged) with the adapters on top."""
    if recipe.qlora_base != "dequantized":
        return None
    from converter.checkpoint import Checkpoint
    from converter.merge import PROVENANCE_FILE

    changed = set(json.loads((merged / PROVENANCE_FILE).read_text())["tensors"]["changed"])
    ckpt = Checkpoint(base)
    untouched = [
        n.removesuffix(".weight")
        for n in ckpt.names()
        if n.endswith(".weight") and len(ckpt.info(n).shape) == 2 and n not in changed
    ]
    return _bnb_config(recipe.qlora_quant, recipe.qlora_double_quant, dtype, ["lm_head", *untouched])


def _reference(base: Path, adapters: list[Path], recipe: Recipe, dtype, vocab: int, quantization=None, offload=None):
    from peft import PeftModel

    if offload:
        base = offload.peft_safe(base)
    model = _load(base, dtype, quantization, offload)  # (a base's own quantization_config applies by itself)
    if model.get_input_embeddings().weight.shape[0] != vocab:
        model.resize_token_embeddings(vocab)  # the adapters were trained on a resized vocabulary
    names = [f"adapter{i}" for i in range(len(adapters))]
    # PEFT re-dispatches an offloaded model when it adds adapters: keep the placement accelerate chose.
    placed = {**offload.kwargs(), "device_map": model.hf_device_map} if offload else {}
    model = PeftModel.from_pretrained(model, adapters[0], adapter_name=names[0], **placed)
    for name, path in zip(names[1:], adapters[1:], strict=True):
        model.load_adapter(path, adapter_name=name, **placed)
    if len(names) > 1:
        model.base_model.set_adapter(names)
    for name, spec in zip(names, recipe.adapters, strict=True):
        for module_name, module in model.named_modules():
            if hasattr(module, "set_scale") and name in getattr(module, "scaling", {}):
                key = module_name.removeprefix("base_model.model.") + ".weight"
                module.set_scale(name, spec.weight if spec.admits(key) else 0.0)
    return model.eval()


def _run(model, inputs, probe_ids, ppl_ids, max_new_tokens: int, prefix: str = "") -> Run:
    import torch

    run = Run()
    with torch.no_grad():
        for ids in inputs:
            run.logits.append(model(input_ids=ids).logits[0].float())
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            run.generations.append(out[0, ids.shape[1] :].tolist())
        loss = model(input_ids=ppl_ids, labels=ppl_ids).loss.float().item()
        run.perplexity = math.exp(min(loss, 50.0))
        if probe_ids is not None:
            run.probe = _probe(model, probe_ids, prefix)
    return run


def _probe(model, ids, prefix: str) -> dict:
    """Outputs of every leaf module (named as in the merged model) on a short input, in execution order."""
    outputs: dict = {}
    hooks = []
    for name, module in model.named_modules():
        plain = name.removeprefix(prefix)
        if not plain or ".lora_" in plain or plain.endswith(".base_layer") or ".base_layer." in plain:
            continue
        is_leaf = not any(True for _ in module.children()) or hasattr(module, "base_layer")
        if is_leaf:

            def hook(_m, _i, out, plain=plain):
                if hasattr(out, "float"):
                    outputs.setdefault(plain, out.detach().float().clone())

            hooks.append(module.register_forward_hook(hook))
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return outputs


def _first_disagreement(ref: dict, merged: dict, tol: float) -> dict | None:
    for name, r in ref.items():
        m = merged.get(name)
        if m is None or m.shape != r.shape:
            continue
        err = ((m - r).norm() / r.norm().clamp_min(1e-12)).item()
        if err > tol:
            return {"module": name, "relative_error": err}
    return None


def _side_by_side(tok, prompts: list[str], bare: Run, ref: Run, out: Run, count: int = 3) -> list[dict]:
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
    lines = [
        f"{verdict}: the merged model was compared with {report.get('reference', 'the base + adapters')} "
        f"({report['inputs']['count']} prompts, {report['compute_dtype']} compute, "
        f"weights in {report['output_dtype']}).",
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
        f"| greedy continuations identical | {m['greedy_identical']}/{m['greedy_total']} | "
        f"{b['greedy_identical']}/{b['greedy_total']} | |",
        f"| perplexity (reference {m['perplexity_reference']:.3g}) | {m['perplexity']:.3g} | {b['perplexity']:.3g} | |",
    ]
    if report.get("qlora"):
        lines += ["", *_qlora_markdown(report["qlora"])]
    for p in report["problems"]:
        lines.append(f"\n- problem: {p}")
    for n in report["notes"]:
        lines.append(f"\n- note: {n}")
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


def require_pass(report: dict) -> None:
    from converter.errors import VerificationFailed

    if report["verdict"] == "fail":
        raise VerificationFailed("verification failed: " + "; ".join(report["problems"]))
