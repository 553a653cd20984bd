"""`converter gguf` / `merge --gguf` / `push --gguf` for a diffusion model: its single file to proven GGUF files,
one per type, all or nothing.

Why staged, as for language models (converter.gguf.export): every file is written (in one pass over the source)
and proven in a staging folder inside OUT, and only when all have passed are they moved into OUT beside
gguf-proof.json. A failure leaves OUT as it was.
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
from converter.errors import UsageError, VerificationFailed
from converter.gguf import diffusion, diffusion_proof
from converter.gguf.proof import FileProof

PROOF_FILE = "gguf-proof.json"


@dataclass
class DiffusionResult:
    out: Path
    arch: str
    files: list[Path] = field(default_factory=list)
    proofs: list[FileProof] = field(default_factory=list)
    diffusers_class: str | None = None  # the class diffusers ran the files as in the behaviour proof, if it ran

    def to_json(self) -> dict:
        ran = {"diffusers_class": self.diffusers_class} if self.diffusers_class else {}
        return {"architecture": self.arch, **ran, "files": [p.to_json() for p in self.proofs]}

    def as_proofs(self) -> outcome.Proofs:
        return outcome.Proofs(gguf=tuple(p.summary() for p in self.proofs))


def source_of(spec: str | Path) -> Path:
    """The single file of a diffusion source; a diffusers pipeline folder is refused in one line."""
    file = diffusion.single_file(spec)
    if file is not None:
        return file
    if diffusion.is_diffusion_folder(spec):
        raise UsageError(f"{spec}: a diffusers pipeline folder; ComfyUI-GGUF and diffusers' GGUF loader read the "
                         "original single-file layout (merge into the model's single file, export that)")  # fmt: skip
    raise UsageError(f"{spec}: not a single-file diffusion checkpoint (a .safetensors file, or a folder holding one)")


def export(source: str | Path, types: list[str], out: str | Path, *, name: str | None = None, force: bool = False,
           log: Callable[[str], None] = print) -> DiffusionResult:  # fmt: skip
    """Write and prove `types` of the single file `source` into the folder `out` as NAME-TYPE.gguf."""
    file = source_of(source)
    diffusion.check_types(types, file)
    src = diffusion.open_source(file)
    log(diffusion.describe(src))
    default = file.stem if Path(source).expanduser().is_file() else Path(source).expanduser().name
    out, stem = Path(out), re.sub(r"[^A-Za-z0-9._-]+", "-", name or default).strip("-") or "model"
    targets = {t: out / f"{stem}-{t}.gguf" for t in types}
    existing = [p.name for p in targets.values() if p.exists()]
    if existing and not force:
        raise UsageError(f"{out}: {existing[0]} exists already (give --force to replace it)")
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gguf-staging-", dir=out))
    result = DiffusionResult(out, src.arch.name)
    ref = None
    try:
        staged = {t: staging / p.name for t, p in targets.items()}
        log(f"writing {', '.join(p.name for p in staged.values())}")
        diffusion.write(src, staged, stem)
        ref = diffusion_proof.Reference(src)
        if ref.output is not None:
            result.diffusers_class = ref.config["_class_name"]
        for t, path in staged.items():
            _prove(path, src, t, ref, result, log)
        for t in types:
            shutil.move(staged[t], targets[t])
            result.files.append(targets[t])
        (out / PROOF_FILE).write_text(json.dumps(result.to_json(), indent=1) + "\n")
    finally:
        if ref is not None:
            ref.close()
        shutil.rmtree(staging, ignore_errors=True)
    return result


def _prove(path: Path, src, type_name: str, ref, result: DiffusionResult, log: Callable[[str], None]) -> None:
    fp = diffusion_proof.prove(path, src, type_name, ref)
    for part in fp.parts:
        log(f"  {path.name} {part.name}: {part.verdict}: {part.detail}")
    result.proofs.append(fp)
    if not fp.passed:
        bad = next(p for p in fp.parts if not p.passed)
        raise VerificationFailed(f"{path.name}: {bad.name} proof failed: {bad.detail}; nothing was written", report=fp)
