"""What a push is asked to do besides its recipe, as data: one frozen PushOptions that the command line, the
Space and the Python API build once, checked when built, and that a push here and a push on Hugging Face Jobs
both read (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from converter.gguf.types import parse_types as gguf_types
from converter.mlx.types import parse_types as mlx_types


@dataclass(frozen=True, kw_only=True)
class PushOptions:
    """`private`, `create_pr`, `overwrite`: how the repo is written (converter push's flags of the same names).
    `verify`: verification's settings (mode, prompts, max_new_tokens, memory, single_file_config; {} for the
    defaults), None for --no-verify. `gguf` / `mlx`: the types also published, proven, beside the model (comma
    lists, as --gguf / --mlx take them; push() makes them: converter.jobs.companions)."""

    private: bool = False
    create_pr: bool = False
    overwrite: bool = False
    verify: dict | None = field(default_factory=dict)
    gguf: str | None = None
    mlx: str | None = None

    def __post_init__(self) -> None:
        if self.gguf:
            gguf_types(self.gguf)
        if self.mlx:
            mlx_types(self.mlx)
