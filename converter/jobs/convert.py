"""`convert()` for Python callers: every target `converter convert --to` offers, GGUF included.

Why here: the adapter formats (converter.conversion) sit below GGUF export in the layers, and GGUF export uses them
(an adapter's modules looked up on the base), so neither may dispatch to the other; a job may use both. The command
line dispatches the same way (converter.cli.convert), so both refuse with the same typed errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from converter import outcome
from converter.conversion.core import TARGETS, ConvertResult
from converter.conversion.core import convert as convert_format
from converter.errors import UsageError
from converter.gguf.proof import FileProof, Part

#: every `to` convert() takes: the adapter formats, and llama.cpp's GGUF adapter
ALL_TARGETS = (*TARGETS, "gguf")


@dataclass
class GGUFConvertResult(ConvertResult):
    """A `to="gguf"` conversion: what every target returns (`out` is the .gguf file, `modules` its LoRA pairs),
    plus the file's alpha and type and each part of its proof ("file", then "behaviour" where llama-cpp-python is
    installed)."""

    alpha: float = 1.0
    type: str = "F32"
    proof: list[Part] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """The proof's verdict: "pass" when every part that ran passed (a failed one raises instead); "skipped" when
        none ran (`verify=False`)."""
        return "pass" if self.proof and all(p.passed for p in self.proof) else "skipped"

    def as_proofs(self) -> outcome.Proofs:
        """The file's proof for the command's outcome (converter.outcome)."""
        return FileProof(self.out.name, self.type, self.proof).as_proofs() + outcome.Proofs(notes=tuple(self.notes))


def convert(
    adapter_spec: str,
    to: str,
    out: str | Path,
    *,
    base: str | None = None,
    rank: int | None = None,
    component: str | None = None,
    force: bool = False,
    token: str | None = None,
    allow_pickle: bool = False,
    log: Callable[[str], None] = print,
    lora_alpha: float | None = None,
    verify: bool = True,
    type: str | None = None,  # the option's name on the command line (--type)
) -> ConvertResult:
    """Convert the adapter at `adapter_spec` to `to` and write `out`, proven unless `verify` is False: an adapter
    format (converter.conversion.core.convert), or `to="gguf"`: a GGUF LoRA adapter for llama.cpp on `base`, of
    GGUF type `type` (F32, F16, BF16 or Q8_0; default F32), read back and run by llama.cpp against PEFT."""
    if to not in ALL_TARGETS:
        raise UsageError(f"--to {to}: choose one of {', '.join(ALL_TARGETS)}")
    if to != "gguf":
        if type:
            raise UsageError("--type is for --to gguf (the GGUF type of the adapter file)")
        return convert_format(adapter_spec, to, out, base=base, rank=rank, component=component, force=force,
                              token=token, allow_pickle=allow_pickle, log=log, lora_alpha=lora_alpha,
                              verify=verify)  # fmt: skip
    return to_gguf(
        adapter_spec,
        out,
        base=base,
        type_name=type,
        rank=rank,
        component=component,
        force=force,
        token=token,
        allow_pickle=allow_pickle,
        log=log,
        lora_alpha=lora_alpha,
        verify=verify,
    )


def to_gguf(
    adapter_spec: str, out: str | Path, *, base: str | None, type_name: str | None = None, rank: int | None = None,
    component: str | None = None, force: bool = False, token: str | None = None, allow_pickle: bool = False,
    log: Callable[[str], None] = print, lora_alpha: float | None = None, verify: bool = True,
) -> GGUFConvertResult:  # fmt: skip
    """`--to gguf`: a proven GGUF LoRA adapter for llama.cpp (converter.gguf.adapter_export)."""
    from converter.gguf.adapter_export import export_adapter

    if component:
        raise UsageError("--component is for diffusion adapters; --to gguf takes language-model adapters")
    result = export_adapter(adapter_spec, base, out, type_name=type_name, force=force, token=token,
                            allow_pickle=allow_pickle, lora_alpha=lora_alpha, rank=rank, verify=verify,
                            log=log)  # fmt: skip
    notes = (
        []
        if not verify or any(p.name == "behaviour" for p in result.parts)
        else ["llama.cpp's behaviour proof did not run: it needs llama-cpp-python (converter[gguf])"]
    )
    return GGUFConvertResult(result.path, [result.path.name], result.pairs, notes, alpha=result.alpha,
                             type=result.type_name, proof=list(result.parts))  # fmt: skip
