"""`converter convert ADAPTER --to gguf --base BASE`: an adapter (PEFT, kohya, anything converter reads) as a proven
GGUF LoRA adapter for llama.cpp.

Why staged: the adapter file is written and proven in a staging folder beside the output (with the base's F32 GGUF
and, for adapters PEFT cannot load as they are, their PEFT form: the referee's inputs); only a file that passed is
moved into place. A refusal or a failed proof leaves the output as it was.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from converter.errors import UsageError, VerificationFailed
from converter.formats import Adapter, load_adapter
from converter.gguf import adapter_proof, llama, proof
from converter.gguf.adapter import ADAPTER_TYPES, plan_adapter, write_adapter_gguf
from converter.gguf.arch import family_of
from converter.gguf.export import file_stem, resolve_source
from converter.gguf.source import Source, open_source
from converter.gguf.write import write_gguf
from converter.hub.sources import fetch
from converter.io.optional import install_hint


@dataclass
class AdapterGGUFResult:
    path: Path
    pairs: int
    alpha: float
    type_name: str = "F32"
    parts: list[proof.Part] = field(default_factory=list)


def adapter_type(text: str | None) -> str:
    name = (text or "F32").strip().upper()
    if name not in ADAPTER_TYPES:
        raise UsageError(f"--type {text}: an adapter GGUF is one of {', '.join(ADAPTER_TYPES)}")
    return name


def target_path(out: str | Path, stem: str, type_name: str) -> Path:
    """A path ending in .gguf is the file; anything else a folder the file goes into, named after the adapter."""
    out = Path(out)
    return out if out.suffix == ".gguf" else out / f"{stem}-{type_name}.gguf"


def export_adapter(
    adapter_spec: str, base: str, out: str | Path, *, type_name: str = "F32", force: bool = False,
    token: str | None = None, allow_pickle: bool = False, lora_alpha: float | None = None, rank: int | None = None,
    verify: bool = True, log: Callable[[str], None] = print,
) -> AdapterGGUFResult:  # fmt: skip
    """Write `adapter_spec` as a GGUF LoRA adapter for the base `base` (a local folder or Hub id) at `out` (a .gguf
    file, or a folder), then prove it (unless `verify` is False). Every refusal comes before anything is written."""
    if not base:
        raise UsageError("--to gguf needs --base: the base model gives the architecture and llama.cpp's tensor names")
    type_name = adapter_type(type_name)
    fetched = fetch(adapter_spec, "adapter", token)
    stem = file_stem(Path(str(fetched.local)).stem if fetched.sha is None else adapter_spec.split("@")[0].split("/")[1])
    target = target_path(out, stem, type_name)
    if target.exists() and not force:
        raise UsageError(f"{target}: exists already (give --force to replace it)")
    adapter = load_adapter(fetched.local, allow_pickle=allow_pickle, lora_alpha=lora_alpha)
    folder = resolve_source(base, token)
    src = open_source(folder)
    family = family_of(src.config, folder)
    planned = plan_adapter(adapter, src, family, rank=rank)
    made = not target.parent.exists()  # a folder made here is removed again if nothing is written into it
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gguf-staging-", dir=target.parent))
    result = AdapterGGUFResult(target, len(planned.pairs), planned.alpha, type_name)
    try:
        staged = staging / target.name
        write_adapter_gguf(planned, family, type_name, staged, name=stem)
        log(f"{target.name}: {len(planned.pairs)} LoRA pairs, alpha {planned.alpha:g}, {type_name}")
        if verify:
            _prove(adapter, adapter_spec, staged, src, family, planned, type_name, staging, result, log,
                   dict(token=token, allow_pickle=allow_pickle, lora_alpha=lora_alpha))  # fmt: skip
        shutil.move(staged, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if made and not target.exists():
            shutil.rmtree(target.parent, ignore_errors=True)
    return result


def _prove(adapter: Adapter, adapter_spec: str, staged: Path, src: Source, family, planned, type_name: str,
           staging: Path, result: AdapterGGUFResult, log, options: dict) -> None:  # fmt: skip
    result.parts.append(adapter_proof.prove_file(staged, planned, family, type_name))
    if result.parts[-1].passed:
        if llama.available():
            result.parts.append(_behaviour(adapter, adapter_spec, staged, src, family, planned, type_name, staging,
                                           options))  # fmt: skip
        else:
            log(f"llama.cpp's behaviour proof needs llama-cpp-python: {install_hint('gguf')}")
    for part in result.parts:
        log(f"  {part.name}: {part.verdict}: {part.detail}")
    bad = next((p for p in result.parts if not p.passed), None)
    if bad is not None:
        raise VerificationFailed(
            f"{staged.name}: {bad.name} proof failed: {bad.detail}; nothing was written",
            report=proof.FileProof(staged.name, type_name, list(result.parts)),
        )


def _behaviour(adapter: Adapter, adapter_spec: str, staged: Path, src: Source, family, planned, type_name: str,
               staging: Path, options: dict) -> proof.Part:  # fmt: skip
    """llama.cpp (base GGUF + this adapter) against PEFT (base + the adapter, unmerged) on the proof's texts."""
    peft_folder = _peft_form(adapter, adapter_spec, src.folder, staging, options, planned.relaid)
    ref = proof.reference(src, with_logits=False)
    applied = adapter_proof.peft_reference(src.folder, peft_folder, ref)
    if applied != len(planned.pairs):
        return proof.Part("behaviour", False, f"PEFT applies the adapter to {applied} modules of the base, the file "
                          f"has {len(planned.pairs)}")  # fmt: skip
    base_gguf = staging / "base-F32.gguf"
    write_gguf(src, family, "F32", base_gguf, name="base")
    return proof.prove_behaviour(base_gguf, ref, type_name, lora=staged)


def _peft_form(adapter: Adapter, adapter_spec: str, base: Path, staging: Path, options: dict, relaid: bool) -> Path:
    """The adapter as PEFT loads it on this base: its own folder when it is one whose modules are the base's, else
    its PEFT conversion against the base (proven by `converter convert`'s own read-back of ΔW on the base)."""
    path = Path(adapter.path)
    if adapter.format == "peft" and not relaid and path.is_dir() and (path / "adapter_config.json").is_file():
        return path
    from converter.conversion.core import convert
    from converter.conversion.options import ConvertOptions

    out = staging / "peft"
    peft = ConvertOptions(to="peft", base=str(base), allow_pickle=options["allow_pickle"],
                          lora_alpha=options["lora_alpha"])  # fmt: skip
    convert(adapter_spec, out, peft, token=options["token"], log=lambda _: None)
    return out
