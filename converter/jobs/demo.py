"""`converter demo` (what `make run` runs): a complete merge offline, on a tiny model built from a config.

It builds a small Llama-shaped base and a PEFT LoRA (random, non-zero), merges them with the streaming engine,
then verifies the result against PEFT's unmerged model (the same check every merge runs).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from converter.engine.merging import MergeResult, merge
from converter.engine.recipe import AdapterSpec, Recipe
from converter.jobs.pipeline import verify_folder
from converter.verification.report import VerificationReport


def build_demo_inputs(folder: Path) -> tuple[Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base_dir, adapter_dir = folder / "base", folder / "adapter"
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(base_dir)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    peft_model.save_pretrained(adapter_dir)
    return base_dir, adapter_dir


def run_demo(directory: str, log: Callable[[str], None] = print) -> tuple[MergeResult, VerificationReport]:
    """Build, merge, verify; the merge's result and its VerificationReport (for the command's outcome)."""
    folder = Path(directory).resolve()
    log(f"building a tiny Llama base (bf16) and a rank-8 all-linear LoRA in {folder}")
    base_dir, adapter_dir = build_demo_inputs(folder)
    recipe = Recipe(base=str(base_dir), adapters=[AdapterSpec(str(adapter_dir))], out=str(folder / "merged"))
    result = merge(recipe, force=True, log=log)
    report = verify_folder(result.out, recipe, log=log)
    log(f"merged model: {result.out}")
    log(f"files: {', '.join(result.files)}")
    log(f"try: converter inspect {result.out}")
    return result, report
