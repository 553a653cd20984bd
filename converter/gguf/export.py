"""`converter gguf`: a model folder (or Hub id) to proven GGUF files, one per type, all or nothing.

Why staged: each file is written and proven in a staging folder inside OUT; only when every requested type has
passed its proof are the files moved into OUT (with gguf-proof.json, the proof as data). A failure leaves OUT as
it was. The K-quants are made by llama.cpp's quantizer from our F32 file after that file has passed its own proof.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from converter import outcome
from converter.engine.model_inputs import ModelLogits
from converter.errors import UsageError, VerificationFailed
from converter.gguf import llama, proof
from converter.gguf.arch import family_of
from converter.gguf.fileio import Reader
from converter.gguf.source import Source, open_source
from converter.gguf.types import LLAMA_TYPES, needs_llama, parse_types, written_in_python
from converter.gguf.write import Written, plan, write_ggufs
from converter.hub.sources import is_diffusion_base
from converter.io.optional import install_hint

PROOF_FILE = "gguf-proof.json"


@dataclass
class GGUFResult:
    out: Path
    files: list[Path] = field(default_factory=list)
    proofs: list[proof.FileProof] = field(default_factory=list)
    llama_proof: bool = True  # False: llama.cpp was not installed, tokenizer and behaviour were not proven

    def to_json(self) -> dict:
        return {"files": [p.to_json() for p in self.proofs], "llama_cpp": self.llama_proof}

    def as_proofs(self) -> outcome.Proofs:
        """Every file's proof, for a verb's outcome (converter.outcome)."""
        notes = () if self.llama_proof else ("llama.cpp's tokenizer and behaviour proofs did not run (no llama.cpp)",)
        return outcome.Proofs(gguf=tuple(p.summary() for p in self.proofs), notes=notes)


def file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def resolve_source(spec: str | Path, token: str | None = None) -> Path:
    """A local folder as it is (also where only Hub sources are taken: the Space's merged folder); a Hub id fetched
    (config, tokenizer, safetensors) into the HF cache."""
    if Path(spec).expanduser().is_dir():
        return Path(spec).expanduser()
    from converter.hub.sources import fetch

    return Path(fetch(str(spec), "model", token).local)


def export(
    source: str | Path, types: list[str], out: str | Path, *, name: str | None = None, force: bool = False,
    token: str | None = None, log: Callable[[str], None] = print, pre: str | None = None,
    written: dict[str, Written] | None = None, merged_logits: ModelLogits | None = None,
) -> GGUFResult:  # fmt: skip
    """Write and prove `types` of `source` into the folder `out`. `pre` forces a pre-tokenizer name (tests);
    `written`: files of these types already written from this source (converter.gguf.stream), proven and kept
    instead of written again; `merged_logits`: the source's float32 logits from its verification, the behaviour
    proof's reference where they are of its inputs (proof.reference)."""
    if is_diffusion_source(source):
        from converter.gguf.diffusion_export import export as export_diffusion

        return export_diffusion(source, types, out, name=name, force=force, log=log)
    folder = resolve_source(source, token)
    src = open_source(folder)
    family = family_of(src.config, folder)
    plan(src, family, "F32")  # every tensor has its place (headers only): refused before anything is loaded
    if needs_llama(types):
        llama.require_llama(f"GGUF type {next(t for t in types if t in LLAMA_TYPES)}")
    out = Path(out)
    local = Path(str(source)).expanduser().exists()
    stem = file_stem(name or (folder.name if local else str(source).split("@")[0].split("/")[1]))  # a Hub id: its name
    targets = {t: out / f"{stem}-{t}.gguf" for t in types}
    existing = [p.name for p in targets.values() if p.exists()]
    if existing and not force:
        raise UsageError(f"{out}: {existing[0]} exists already (give --force to replace it)")
    have_llama = llama.available()
    if not have_llama:
        log(f"llama.cpp's proof (tokenizer, behaviour) needs llama-cpp-python: {install_hint('gguf')}")
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gguf-staging-", dir=out))
    result = GGUFResult(out, llama_proof=have_llama)
    try:
        ref = proof.reference(src, with_logits=have_llama, merged=merged_logits)
        staged = _write_python_types(src, family, types, staging, stem, ref, result, log, pre, have_llama,
                                     written or {})  # fmt: skip
        for t in (t for t in types if t in LLAMA_TYPES):
            path = staging / targets[t].name
            log(f"{path.name}: quantizing with llama.cpp from the proven F32 file")
            llama.quantize(staged, path, t)
            _prove(path, src, family, t, ref, result, log, have_llama)
        for t in types:
            shutil.move(staging / targets[t].name, targets[t])
            result.files.append(targets[t])
        (out / PROOF_FILE).write_text(json.dumps(result.to_json(), indent=1) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def _write_python_types(src: Source, family, types: list[str], staging: Path, stem: str, ref, result: GGUFResult,
                        log, pre, have_llama: bool, written: dict[str, Written]) -> Path | None:  # fmt: skip
    """Write (in one pass over the source) and prove the types we write ourselves; an F32 file for llama.cpp's
    quantizer when K-quants are asked for (kept only if F32 was asked for too). Returns the F32 file, if any. The
    tensor proof reads each file back against the digests its writing kept (Written): the source is read once."""
    paths = {t: staging / f"{stem}-{t}.gguf" for t in written_in_python(types)}
    digests = {}
    for t, path in paths.items():
        if t in written:
            shutil.move(written[t].path, path)
            digests[t] = written[t].digests
        else:
            log(f"{path.name}: writing" + ("" if t in types else " (for llama.cpp's quantizer; not kept)"))
    if to_write := {t: path for t, path in paths.items() if t not in written}:
        write_ggufs(src, family, to_write, name=stem, pre=pre, digests=digests)
    for t, path in paths.items():
        _prove(path, src, family, t, ref, result, log, have_llama, record=t in types, digests=digests[t])
    return paths.get("F32")


def _prove(path: Path, src: Source, family, type_name: str, ref, result: GGUFResult, log, have_llama: bool,
           record: bool = True, digests: dict[str, bytes] | None = None) -> proof.FileProof:  # fmt: skip
    fp = proof.FileProof(path.name, type_name)
    reader = Reader(path)  # it parses the whole vocabulary when it opens: once for both parts
    fp.parts.append(proof.prove_metadata(reader, src, family))
    if fp.passed:
        written = Written(path, digests) if digests is not None else None
        fp.parts.append(proof.prove_tensors(reader, src, family, type_name, written))
    del reader  # its memory map goes before llama.cpp maps the file again
    if fp.passed and have_llama:
        fp.parts.append(proof.prove_tokenizer(path, ref))
    if fp.passed and have_llama:
        fp.parts.append(proof.prove_behaviour(path, ref, type_name))
    for part in fp.parts:
        log(f"  {part.name}: {part.verdict}: {part.detail}")
    if record:
        result.proofs.append(fp)
    if not fp.passed:
        bad = next(p for p in fp.parts if not p.passed)
        raise VerificationFailed(f"{path.name}: {bad.name} proof failed: {bad.detail}; nothing was written", report=fp)
    return fp


def is_diffusion_source(source: str | Path) -> bool:
    """A diffusion model's single file (or a merge's folder holding one), or a diffusers pipeline folder: exported
    by converter.gguf.diffusion_export."""
    from converter.gguf.diffusion import is_diffusion_folder, single_file

    return single_file(source) is not None or is_diffusion_folder(source)


def names_single_file(base: str | Path) -> bool:
    """A base named as a single .safetensors file (local, or a file in a Hub repo): a diffusion model's, whose GGUF
    files are written from the merged file, not as the merge streams."""
    return str(base).endswith(".safetensors")


def check_merge_gguf(text: str | None, base: str | None, token: str | None = None) -> list[str] | None:
    """`merge --gguf`: the types, the extra they need and the base (a language model llama.cpp runs, or a diffusion
    model's single file; for a local base, its architecture), checked before the merge starts, so a refusal costs
    nothing."""
    if not text:
        return None
    types = parse_types(text)
    if base and (is_diffusion_base(base, token) or is_diffusion_source(base)):  # (a merge's single-file folder too)
        from converter.gguf.diffusion import check_types, single_file

        if not names_single_file(base) and single_file(base) is None:
            raise UsageError(f"--gguf {text}: {base} is a diffusers pipeline; ComfyUI-GGUF and diffusers' GGUF loader "
                             "read the original single-file layout (give the model's single file as base)")  # fmt: skip
        check_types(types, base)
        return types
    if needs_llama(types):
        llama.require_llama(f"GGUF type {next(t for t in types if t in LLAMA_TYPES)}")
    config = Path(base or "") / "config.json"
    if base and config.is_file():
        family_of(json.loads(config.read_text()), base)
    return types
