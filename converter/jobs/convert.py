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
from converter.conversion.core import ConvertResult
from converter.conversion.core import convert as convert_format
from converter.conversion.options import ConvertOptions
from converter.gguf.proof import FileProof, Part


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
    out: str | Path,
    options: ConvertOptions,
    *,
    token: str | None = None,
    log: Callable[[str], None] = print,
) -> ConvertResult:
    """Convert the adapter at `adapter_spec` as `options` say and write `out`, proven unless `options.verify` is
    False: an adapter format (converter.conversion.core.convert), or `to="gguf"`: a GGUF LoRA adapter for
    llama.cpp on `options.base`, of GGUF type `options.type` (default F32), read back and run by llama.cpp against
    PEFT."""
    if options.to != "gguf":
        return convert_format(adapter_spec, out, options, token=token, log=log)
    return to_gguf(adapter_spec, out, options, token=token, log=log)


def to_gguf(
    adapter_spec: str, out: str | Path, options: ConvertOptions, *, token: str | None = None,
    log: Callable[[str], None] = print,
) -> GGUFConvertResult:  # fmt: skip
    """`--to gguf`: a proven GGUF LoRA adapter for llama.cpp (converter.gguf.adapter_export)."""
    from converter.gguf.adapter_export import export_adapter

    o = options
    result = export_adapter(adapter_spec, o.base, out, type_name=o.type, force=o.force, token=token,
                            allow_pickle=o.allow_pickle, lora_alpha=o.lora_alpha, rank=o.rank, verify=o.verify,
                            log=log)  # fmt: skip
    notes = (
        []
        if not o.verify or any(p.name == "behaviour" for p in result.parts)
        else ["llama.cpp's behaviour proof did not run: it needs llama-cpp-python (converter[gguf])"]
    )
    return GGUFConvertResult(result.path, [result.path.name], result.pairs, notes, alpha=result.alpha,
                             type=result.type_name, proof=list(result.parts))  # fmt: skip
