"""What a model produced on the verification inputs, and how two such runs are compared and judged.

Thresholds come from the dtypes' unit roundoff, or from a 4-bit reference's measured kernel noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Unit roundoff of each output dtype: the relative error of rounding one weight once.
UNIT_ROUNDOFF = {"F32": 2.0**-24, "F16": 2.0**-11, "BF16": 2.0**-8}
CONFIDENT_GAP = 0.5  # nats between the reference's top-1 and top-2 logits
# A 4-bit reference is judged against its own measured kernel noise: KL is quadratic in the logit error, so 4x
# the noise's KL allows twice its amplitude (the noise is measured on a few inputs: it varies between them).
NOISE_MARGIN = 4.0
# How much a right module may amplify the relative error of its inputs (norms, attention and the MLP's product are
# not contractions): measured up to 1.8x per module (o_proj) on the tiny llama in bfloat16 compute; 2x allowed.
UPSTREAM_GAIN = 2.0


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


def compare(ref: Run, other: Run) -> dict:
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


def summary(metrics: dict) -> dict:
    keys = ("mean_kl", "max_abs_logit_diff", "top1_agreement", "greedy_identical", "greedy_total")
    return {k: metrics[k] for k in keys}


def logits_of(model, rows: list, variants: list[str] | None = None) -> list:
    """Float32 logits of each row of token ids ([1, n] each), all in one forward and without padding: the rows
    are packed into one sequence, each with its own positions from 0, which transformers' masks turn into a
    block-diagonal causal mask (no row sees another), so each row's logits are its own. `variants`: PEFT adapter
    names (or "__base__") to run the same pack through at once, one batch row each (PEFT's mixed-adapter batch);
    the result is then one list of per-row logits per variant."""
    import torch

    ids = torch.cat([r[0] for r in rows])[None]
    positions = torch.cat([torch.arange(r.shape[1]) for r in rows])[None]
    count = len(variants) if variants else 1
    extra = {"adapter_names": list(variants)} if variants else {}
    with torch.no_grad():
        logits = model(
            input_ids=ids.expand(count, -1), position_ids=positions.expand(count, -1), use_cache=False, **extra
        ).logits
    ends = torch.tensor([r.shape[1] for r in rows]).cumsum(0).tolist()
    split = [
        [logits[v, end - r.shape[1] : end].float() for r, end in zip(rows, ends, strict=True)] for v in range(count)
    ]
    return split if variants else split[0]


def greedy(model, inputs: list, max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations with the KV cache, one prompt at a time: a left-padded batched generate is slower on a
    CPU, and unpadded each continuation is exactly its own."""
    import torch

    generations = []
    with torch.no_grad():
        for ids in inputs:
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            generations.append(out[0, ids.shape[1] :].tolist())
    return generations


def run_model(model, inputs, probe_ids, ppl_ids, max_new_tokens: int, prefix: str = "") -> Run:
    """One forward for the logits of every prompt and the perplexity text together; greedy continuations only
    when max_new_tokens > 0 (`--verify full`); the module probe only when probe_ids are given."""
    import torch

    run = _scored(logits_of(model, _rows(ppl_ids, inputs)), ppl_ids)
    if max_new_tokens > 0:
        run.generations = greedy(model, inputs, max_new_tokens)
    if probe_ids is not None:
        with torch.no_grad():
            run.probe = probe_modules(model, probe_ids, prefix)
    return run


def run_variants(model, inputs, ppl_ids, variants: list[str]) -> list[Run]:
    """The quick check's runs of one PEFT model under several adapter settings (e.g. the adapter and "__base__",
    the bare base) in one forward: the weights are read once for all of them."""
    return [_scored(logits, ppl_ids) for logits in logits_of(model, _rows(ppl_ids, inputs), variants)]


def mixed_batch(model, inputs, ppl_ids) -> tuple[Run, Run] | None:
    """The reference (a PEFT model with one LoRA adapter) and the bare base in one forward, as rows of PEFT's
    mixed-adapter batch (the adapter's name, and "__base__" for no adapter); None where PEFT does not offer that
    for these adapters (DoRA, aLoRA): then the caller runs the two one after the other (disable_adapter)."""
    name = mixed_batch_adapter(model)
    if name is None:
        return None
    try:
        ref, bare = run_variants(model, inputs, ppl_ids, [name, "__base__"])
    except (ValueError, TypeError, NotImplementedError):  # PEFT refused adapter_names after all
        _drop_adapter_names_hooks(model)
        return None
    return ref, bare


def mixed_batch_adapter(model) -> str | None:
    """The one adapter of a PEFT model that PEFT's mixed-adapter batch can run beside the bare base (a plain
    LoRA: not DoRA, not aLoRA); None where it cannot."""
    config = getattr(model, "peft_config", {})
    if len(config) != 1:
        return None
    ((name, adapter),) = config.items()
    if adapter.peft_type != "LORA" or adapter.use_dora or getattr(adapter, "alora_invocation_tokens", None):
        return None
    return name


def _drop_adapter_names_hooks(model) -> None:
    """PEFT 0.21 registers a pre-hook per layer for a mixed batch and removes them after the forward, but not when
    the forward raises (its context manager has no `finally`): every later forward would then get the batch's
    adapter names. Remove what it left behind."""
    for module in model.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if getattr(getattr(hook, "func", None), "__name__", "") == "_adapter_names_pre_forward_hook":
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)


def _rows(ppl_ids, inputs: list) -> list:
    """The packed rows: the perplexity text first (when it runs), then the prompts."""
    return inputs if ppl_ids is None else [ppl_ids, *inputs]


def _scored(logits: list, ppl_ids) -> Run:
    """A Run from packed logits: the perplexity text first (it is packed first, so it never depends on whether a
    model's mask keeps the rows apart), then the prompts; no perplexity (NaN) when the text did not run."""
    if ppl_ids is None:
        return Run(logits=list(logits))
    ppl_logits, *prompts = logits
    nll = -ppl_logits[:-1].log_softmax(-1).gather(-1, ppl_ids[0, 1:, None]).mean().item()
    return Run(logits=prompts, perplexity=math.exp(min(nll, 50.0)))


def probe_modules(model, ids, prefix: str) -> dict:
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


def first_disagreement(
    ref: dict, merged: dict, tol: float, noise: dict | None = None, floor: float = 1e-12
) -> dict | None:
    """The first module (in execution order) whose output is off by more than its own rounding (or NOISE_MARGIN
    times the reference's measured 4-bit kernel noise there) on top of what it inherits: a right module passes
    on the relative error of its inputs, so in low-precision compute, where rounding accumulates layer by layer,
    each module may carry UPSTREAM_GAIN times the largest error seen upstream of it; a wrong one jumps past that.
    Shared by the LLM's and the diffusion's module probes; `floor`: the smallest reference norm divided by."""
    upstream = 0.0
    for name, r in ref.items():
        m = merged.get(name)
        if m is None or m.shape != r.shape:
            continue
        err = ((m - r).norm() / r.norm().clamp_min(floor)).item()
        if err > max(tol, NOISE_MARGIN * (noise or {}).get(name, 0.0)) + UPSTREAM_GAIN * upstream:
            return {"module": name, "relative_error": err}
        upstream = max(upstream, err)
    return None
