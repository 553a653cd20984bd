"""The behavioural comparison of a causal LM: the merged folder must behave like the base with the adapters
applied *unmerged* by PEFT, on the same prompts. It proves what tensors cannot: config, tokenizer, tied heads, a
model class that loads differently.

One load gives the reference and the bare base (PEFT's mixed-adapter batch, or disable_adapter()); the merged
model loads after it, never together. Weights stay in their own dtype and each layer is upcast to float32 while
it runs (converter.engine.precision), so the only expected difference is the one rounding of each merged weight;
thresholds come from that dtype's unit roundoff, or, for a reference on a 4-bit base, from its kernels' measured
noise. The module probe of the merged model runs only when the behaviour fails. Modules: metrics (runs and
thresholds), loading (models, offload, inputs), fourbit (4-bit references, the QLoRA study).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from converter.engine.model_inputs import PERPLEXITY_TEXT, PROMPTS, build_inputs
from converter.engine.precision import float32_compute, own_dtype, weights_summary
from converter.engine.recipe import Recipe
from converter.io.memory import available_memory
from converter.io.units import human_bytes
from converter.verification import fourbit
from converter.verification.judge import judge_llm
from converter.verification.loading import (
    choose_placement,
    load_model,
    load_reference,
    load_tokenizer,
    resident_bytes,
    upcast_working_set,
    vocab_size,
)
from converter.verification.metrics import (
    NOISE_MARGIN,
    compare,
    first_disagreement,
    mixed_batch,
    probe_modules,
    run_model,
)
from converter.verification.metrics import tolerance as rounding_tolerance
from converter.verification.report import (
    Clock,
    Disagreement,
    Generation,
    LLMBehaviour,
    LLMInputs,
    LLMTolerance,
    LogitComparison,
    QLoRAStudy,
    Skip,
)


@dataclass
class Settings:
    prompts: list[str] | None = None
    mode: str = "quick"
    max_new_tokens: int = 16
    memory: int | None = None
    token: str | None = None
    # The bare base answers "was anything merged?"; a tensor proof that passed already has (what each changed
    # tensor must be, element by element), so the quick check then leaves it out, and the perplexity text with it.
    bare_base: bool = True


class LLMCheck:
    """One behavioural comparison, phase by phase (each method one phase; state on the object)."""

    def __init__(self, merged: Path, recipe: Recipe, base: Path, adapters: list[Path], settings: Settings,
                 scratch: Path, log: Callable[[str], None], clock: Clock):  # fmt: skip
        self.merged, self.recipe, self.base, self.adapters = merged, recipe, base, adapters
        self.settings, self.scratch, self.log, self.clock = settings, scratch, log, clock
        self.new_tokens = settings.max_new_tokens if settings.mode == "full" else 0
        self.prompts = settings.prompts or PROMPTS

    def run(self) -> tuple[LLMBehaviour, tuple[list[str], list[str]]]:
        self._place()
        self._inputs()
        ref, bare, noise = self._reference()
        out = self._candidate()
        tol = self._tolerance(noise)
        merged_vs_ref = LogitComparison(**compare(ref, out), perplexity_reference=ref.perplexity)
        base_vs_ref = LogitComparison(**compare(ref, bare), perplexity_reference=ref.perplexity) if bare else None
        problems, _ = judge_llm(merged_vs_ref, base_vs_ref, tol)
        culprit = self._probe(ref, out, tol, noise) if problems and not self.stored_4bit else None
        self.candidate = None
        findings = judge_llm(merged_vs_ref, base_vs_ref, tol, culprit)
        qlora = self._qlora_study(ref, out)
        return self._behaviour(tol, merged_vs_ref, base_vs_ref, culprit, (bare, ref, out), qlora), findings

    def _place(self) -> None:
        """Where the models run: streamed from their files in float32 (quick), in memory, or offloaded."""
        import torch

        self.output_dtype, params = weights_summary(self.merged)
        self.stored_4bit = fourbit.four_bit_config(self.merged)
        # 4-bit paths load in the compute dtype, and so does the full check: upcasting every layer again for
        # each greedy token cost ~4x its forward on the 0.85 B bench model, so it holds a float32 copy.
        own = self.settings.mode == "quick" and not self.stored_4bit and self.recipe.qlora_base != "dequantized"
        budget = self.settings.memory or available_memory()
        stored_bytes, working = (0, upcast_working_set(self.merged)) if own else (4, None)
        placement = choose_placement(params, budget, self.scratch, stored_bytes, working)
        if placement is None:
            raise Skip(f"the model needs about {human_bytes(params * 2)} to load, {human_bytes(budget)} of memory "
                       f"is available and {self.scratch} has too little disk to offload the rest")  # fmt: skip
        self.compute, self.offload = placement
        if self.offload and (self.stored_4bit or self.recipe.qlora_base == "dequantized"):
            raise Skip(f"4-bit models cannot be offloaded to disk and this one needs more than {human_bytes(budget)}")
        if self.offload:
            self.log(f"the model does not fit in {human_bytes(budget)}: offloading weights to disk (accelerate), "
                     f"computing in {self.compute}; slower, exact")  # fmt: skip
        self.dtype = getattr(torch, self.compute)
        self.four_bit = fourbit.four_bit_base(self.recipe, self.base)
        self.own = own and self.offload is None and not self.four_bit and self.compute == "float32"

    def _inputs(self) -> None:
        self.tok = load_tokenizer(self.merged, " ".join([*self.prompts, PERPLEXITY_TEXT]))
        self.inputs, self.probe_ids, self.ppl_ids, self.template = build_inputs(
            self.tok, self.prompts, vocab_size(self.merged)
        )
        # After a passed tensor proof the quick check is about the model as a whole (config, tokenizer, tied heads):
        # the prompts' logits show that; the perplexity text, like the bare base, runs in the full check.
        self.bare_base = self.settings.bare_base or self.four_bit or self.settings.mode == "full"
        self.study = (fourbit.is_qlora(self.recipe, self.adapters) and not fourbit.four_bit_config(self.base)
                      and not self.stored_4bit)  # fmt: skip
        if not self.bare_base and not self.study:  # the QLoRA study compares perplexities
            self.ppl_ids = None
        kind = f"{self.four_bit} 4-bit base" if self.four_bit else "base"
        self.log(f"comparing behaviour ({self.settings.mode}): reference = {kind} + {len(self.adapters)} adapter(s) "
                 f"through PEFT ({self.compute} compute)")  # fmt: skip

    def _lean(self, model, sources):
        """Float32 compute over weights kept in their own dtype, read from their files (converter.engine.precision)."""
        return float32_compute(model, sources) if self.own else nullcontext()

    def _load_reference(self):
        """PEFT's unmerged model and (when computing from the files) where its base weights came from."""
        sources: dict | None = {} if self.own else None
        dtype = own_dtype(self.base) if self.own else self.dtype
        model = load_reference(self.base, self.adapters, self.recipe, dtype, vocab_size(self.merged),
                               self.quantization, self.offload, sources=sources)  # fmt: skip
        return model, sources

    def _reference(self):
        """The reference's and the bare base's runs, and a 4-bit reference's measured kernel noise."""
        self.quantization = fourbit.qlora_quantization(self.recipe, self.merged, self.base, self.dtype)
        model, sources = self._load_reference()  # PeftRefused: the caller reports the behaviour as not run
        self.clock.lap("load reference")
        noise, self.one_batch = None, False
        with self._lean(model, sources):
            one = self.own and self.bare_base and len(self.adapters) == 1
            both = mixed_batch(model, self.inputs, self.ppl_ids) if one else None
            if both:  # quick: reference and bare base in one forward, the base weights read once
                (ref, bare), self.one_batch = both, True
            else:
                probe = self.probe_ids if self.four_bit else None  # a 4-bit reference's per-module noise
                ref = run_model(model, self.inputs, probe, self.ppl_ids, self.new_tokens, prefix="base_model.model.")
                if self.four_bit:
                    noise = fourbit.kernel_noise(model, ref, self.inputs, self.ppl_ids, self.probe_ids)
                bare = None
                if self.bare_base:
                    with model.disable_adapter():
                        bare = run_model(model, self.inputs, None, self.ppl_ids, self.new_tokens)
        self.clock.lap("run reference and bare base" if self.bare_base else "run reference")
        self.reference = "the base + adapters applied unmerged through PEFT"
        if self.stored_4bit:
            ref = self._quantized_reference(model)
        # Collect before the merged model loads, unless (streamed) it holds little but mappings
        big = resident_bytes(model, sources) > 2**29
        del model
        if big:
            gc.collect()
        return ref, bare, noise

    def _quantized_reference(self, model):
        """4-bit weights cannot match an unmerged model to rounding: PEFT's own merge quantized by transformers,
        both computing in the dtype the weights were quantized from."""
        import torch

        from converter.io.dtypes import TORCH_TO_ST

        logical = self.stored_4bit["bnb_4bit_compute_dtype"]
        self.output_dtype, self.compute, self.dtype = TORCH_TO_ST[getattr(torch, logical)], logical, getattr(
            torch, logical)  # fmt: skip
        batch = (self.inputs, self.probe_ids, self.ppl_ids, self.new_tokens)
        ref = fourbit.quantized_peft_merge(model, self.stored_4bit, batch)
        self.reference = (f"PEFT's own merge quantized to {self.stored_4bit['bnb_4bit_quant_type'].upper()} by "
                          "transformers")  # fmt: skip
        self.clock.lap("4-bit reference: PEFT merge, save, quantized load, run")
        return ref

    def _candidate(self):
        sources: dict | None = {} if self.own else None
        dtype = own_dtype(self.merged) if self.own else self.dtype
        self.candidate = load_model(self.merged, dtype, offload=self.offload, sources=sources)
        self.candidate_sources = sources
        self.clock.lap("load merged")
        with self._lean(self.candidate, sources):
            out = run_model(self.candidate, self.inputs, None, self.ppl_ids, self.new_tokens)
        self.clock.lap("run merged")
        return out

    def _tolerance(self, noise: dict | None) -> LLMTolerance:
        from converter.io.dtypes import TORCH_TO_ST

        tol = rounding_tolerance(self.output_dtype, TORCH_TO_ST[self.dtype])
        if noise and not self.stored_4bit:  # the 4-bit reference's own noise bounds what a right merge reaches
            tol = {**tol, "mean_kl": tol["mean_kl"] + NOISE_MARGIN * noise["mean_kl"],
                   "confident_top1_agreement": min(tol["confident_top1_agreement"], 0.99),
                   "kernel_noise_mean_kl": noise["mean_kl"]}  # fmt: skip
        self.noise = noise
        return LLMTolerance(**tol)

    def _probe(self, ref, out, tol: LLMTolerance, noise: dict | None) -> Disagreement | None:
        """Only on a failure: every module's output on a short input, merged then reference (reloaded)."""
        import torch

        with self._lean(self.candidate, self.candidate_sources), torch.no_grad():
            out.probe = probe_modules(self.candidate, self.probe_ids, "")
        self.candidate = None
        gc.collect()
        if not ref.probe:
            model, sources = self._load_reference()
            with self._lean(model, sources), torch.no_grad():
                ref.probe = probe_modules(model, self.probe_ids, "base_model.model.")
            del model
        self.clock.lap("module probe (on failure)")
        first = first_disagreement(ref.probe, out.probe, tol.module_rel_err, (noise or {}).get("module_rel_err", {}))
        return Disagreement(**first) if first else None

    def _qlora_study(self, ref, out) -> QLoRAStudy | None:
        study = self.study
        if not self.own or study:  # streamed models hold little but mappings: no full collection needed
            gc.collect()
        if not study:
            return None
        self.log("QLoRA adapters: measuring both merge bases against the 4-bit training setting")
        batch = (self.inputs, self.ppl_ids, self.new_tokens)
        result = fourbit.qlora_study(self.merged, self.recipe, self.base, self.adapters, self.dtype, batch,
                                     (ref, out), self.settings.token)  # fmt: skip
        self.clock.lap("QLoRA study: other merge, 4-bit reference")
        return result

    def _behaviour(self, tol, merged_vs_ref, base_vs_ref, culprit, runs, qlora) -> LLMBehaviour:
        from converter.io.dtypes import TORCH_TO_ST
        from converter.verification.loading import side_by_side

        bare, ref, out = runs
        return LLMBehaviour(
            mode=self.settings.mode,
            reference=self.reference,
            compute_dtype=self.compute,
            # Weights as held in memory: their own dtype, upcast per layer while computing (or the compute dtype)
            weights_in_memory=self.output_dtype if self.own else TORCH_TO_ST[self.dtype],
            offloaded=self.offload is not None,
            execution=_execution(self.own, self.offload is not None, self.one_batch, self.bare_base),
            offload_memory_bytes=self.offload.max_memory if self.offload else None,
            output_dtype=self.stored_4bit["bnb_4bit_quant_type"].upper() if self.stored_4bit else self.output_dtype,
            tolerance=tol,
            inputs=LLMInputs(len(self.inputs), self.template, self.tok is not None, self.new_tokens),
            merged_vs_reference=merged_vs_ref,
            base_vs_reference=base_vs_ref,
            first_disagreeing_module=culprit,
            generations=[Generation(**g) for g in side_by_side(self.tok, self.prompts, bare, ref, out)]
            if self.new_tokens
            else [],
            qlora=qlora,
        )


def _execution(streamed: bool, offloaded: bool, one_batch: bool, bare_base: bool) -> str:
    weights = (
        "weights read block by block from their files into float32 buffers (never the whole model in memory)"
        if streamed
        else "weights offloaded to disk by accelerate"
        if offloaded
        else "each model loaded whole in the compute dtype"
    )
    if not bare_base:
        return f"{weights}; the reference alone (the tensor proof shows what changed); the merged model after it"
    bare = "one PEFT mixed-adapter batch" if one_batch else "two forwards (PEFT's disable_adapter for the bare base)"
    return f"{weights}; the reference and the bare base in {bare}; the merged model after them"
