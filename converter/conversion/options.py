"""What `convert` is asked to do, as data (no torch here: the parser is built for every command). The command
line, the Space and the Python API build one ConvertOptions and hand it over whole; it checks itself when built."""

from __future__ import annotations

from dataclasses import dataclass

from converter.errors import UsageError

TARGETS = ("peft", "diffusers", "kohya", "comfyui")
#: targets written as one .safetensors file (the others are folders)
FILE_TARGETS = ("kohya", "comfyui")
#: every `to` convert takes: the adapter formats, and llama.cpp's GGUF adapter (converter.jobs.convert)
ALL_TARGETS = (*TARGETS, "gguf")


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """`to`: one of ALL_TARGETS. `base`: the model the adapter is for (kohya's flattened names are looked up
    there; `to="gguf"` needs it). `rank`: LoHa/LoKr/full modules approximated by an SVD of this rank. `component`:
    the model part a PEFT adapter is for. `lora_alpha`: the alpha of a file that stores none. `type`: the GGUF
    type of `to="gguf"` (F32, F16, BF16 or Q8_0). `verify`: read the output back and prove it."""

    to: str
    base: str | None = None
    rank: int | None = None
    component: str | None = None
    lora_alpha: float | None = None
    type: str | None = None
    force: bool = False
    allow_pickle: bool = False
    verify: bool = True

    def __post_init__(self) -> None:
        if self.to not in ALL_TARGETS:
            raise UsageError(f"--to {self.to}: choose one of {', '.join(ALL_TARGETS)}")
        if self.rank is not None and self.rank < 1:
            raise UsageError(f"--rank {self.rank}: give a positive rank")
        if self.type and self.to != "gguf":
            raise UsageError("--type is for --to gguf (the GGUF type of the adapter file)")
        if self.component and self.to == "gguf":
            raise UsageError("--component is for diffusion adapters; --to gguf takes language-model adapters")
