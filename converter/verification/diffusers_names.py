"""Adapter files diffusers' loader reads only once their names say which model they are for.

A UNet LoRA saved by diffusers' `save_attn_procs` before it used PEFT (2023) names the attention processors without
a component: `down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor.to_q_lora.down.weight`. diffusers'
pipeline loader filters keys by component (`unet.`) and so reads none of them, though its UNet loader converts the
rest of the spelling itself (`convert_unet_state_dict_to_peft`: `.processor.` dropped, `to_q_lora.down` to
`to_q.lora_A`). diffusers' own migration note for these files is to put `unet.` before every key; the referee and
the behaviour check give diffusers the file so, and nothing else of it changes.
"""

from __future__ import annotations

from pathlib import Path

from converter.io.safetensors_file import SafetensorsFile

# the attention processors' LoRA layers as save_attn_procs named them (LoRAAttnProcessor's children)
PROCESSOR_LAYERS = ("to_q_lora.", "to_k_lora.", "to_v_lora.", "to_out_lora.")


def is_attn_procs_file(file: Path) -> bool:
    """Whether every key of a safetensors file is an attention processor's LoRA named without a component."""
    if not (file.is_file() and file.suffix == ".safetensors"):
        return False
    keys = list(SafetensorsFile(file).tensors)
    return bool(keys) and all(".processor." in k and any(p in k for p in PROCESSOR_LAYERS) for k in keys)


def for_the_unet(file: Path, unet: str = "unet") -> dict:
    """The file's tensors under `unet.` names, as diffusers' pipeline loader takes a UNet's LoRA."""
    from safetensors.torch import load_file

    return {f"{unet}.{k}": v for k, v in load_file(file).items()}
