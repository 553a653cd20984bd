"""`merge --mlx` / `push --mlx`: a merged model folder to proven MLX folders, one per type, all or nothing.

Why staged: each folder is written and proven in a staging folder beside its target; only when every requested
type has passed its proof are the folders moved into place, each with mlx-proof.json (the proof as data) and its
card. A failure leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from converter import outcome
from converter.errors import OutputError, UsageError, VerificationFailed
from converter.mlx import card, proof
from converter.mlx.layout import model_for, plan
from converter.mlx.types import MLXType, parse_types
from converter.mlx.write import write_folder

PROOF_FILE = "mlx-proof.json"


@dataclass
class MLXResult:
    folders: list[Path] = field(default_factory=list)
    proofs: list[proof.FolderProof] = field(default_factory=list)

    def as_proofs(self) -> outcome.Proofs:
        return outcome.Proofs(mlx=tuple(p.summary() for p in self.proofs))

    def files(self) -> list[str]:
        return [str(f) for f in self.folders]


def folder_for(merged: Path, mtype: MLXType) -> Path:
    """Beside the merged folder, named as mlx-community names its repos: OUT-4bit, OUT-8bit, OUT-bf16."""
    return merged.with_name(f"{merged.name}-{mtype.name}")


def check(text: str | None, base: str | None, token: str | None = None) -> list[MLXType] | None:
    """The types, the extra and the base (a language model mlx-lm runs: for a local base, its whole layout),
    checked before the merge starts, so a refusal costs nothing."""
    if not text:
        return None
    types = parse_types(text)
    from converter.hub.sources import is_diffusion_base

    if base and is_diffusion_base(base, token):
        raise UsageError(f"--mlx {text}: {base} is a diffusion model; MLX export is for the language models mlx-lm "
                         "runs (merge without --mlx)")  # fmt: skip
    folder = Path(base or "").expanduser()
    if base and (folder / "config.json").is_file():
        if any(folder.glob("*.safetensors")):
            plan(folder, types[0])  # names, shapes, architecture: headers only
        else:
            from converter.mlx import runtime

            model_for(folder, runtime.require("MLX export")[1].load_config(folder))
    else:
        from converter.mlx import runtime

        runtime.require("MLX export")
    return types


def export(source: str | Path, types: list[MLXType], targets: dict[str, Path], *, base_model: str | None = None,
           force: bool = False, log: Callable[[str], None] = print) -> MLXResult:  # fmt: skip
    """Write and prove each type of the merged folder `source` into `targets[type name]`."""
    source = Path(source)
    layouts = {t.name: plan(source, t) for t in types}  # every refusal before anything is written
    for t in types:
        target = targets[t.name]
        if target.exists() and any(target.iterdir()) and not force:
            raise OutputError(f"{target}: exists already and is not empty (give --force to replace it)", path=target)
    vocab = int(layouts[types[0].name].config.get("vocab_size") or 0) or _vocab_of(source)
    ids = proof.seeded_ids(vocab)
    log("MLX: the merged model's float32 logits (torch)")
    reference = proof.reference_logits(source, ids)
    parent = targets[types[0].name].parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".mlx-staging-", dir=parent))
    result = MLXResult()
    try:
        for t in types:
            stage = staging / targets[t.name].name
            stage.mkdir()
            log(f"{targets[t.name].name}: writing as mlx-lm does ({t.name})")
            write_folder(layouts[t.name], source, stage, log)
            fp = _prove(stage, source, layouts[t.name], ids, reference, log)
            result.proofs.append(fp)
            (stage / PROOF_FILE).write_text(json.dumps(fp.to_json(), indent=1) + "\n")
            (stage / "README.md").write_text(card.card(fp, base_model or source.name, targets[t.name].name))
        for t in types:
            target = targets[t.name]
            if target.exists():
                shutil.rmtree(target)
            (staging / target.name).rename(target)
            result.folders.append(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def _vocab_of(source: Path) -> int:
    config = json.loads((source / "config.json").read_text())
    return int((config.get("text_config") or {}).get("vocab_size") or 256)


def _prove(stage: Path, source: Path, layout, ids, reference, log) -> proof.FolderProof:
    fp = proof.FolderProof(stage.name, layout.type.name)
    fp.parts.append(proof.prove_config(stage, source, layout))
    if fp.passed:
        fp.parts.append(proof.prove_tensors(stage, layout))
    if fp.passed:
        fp.parts.append(proof.prove_behaviour(stage, ids, reference, layout.type.name))
    for part in fp.parts:
        log(f"  {part.name}: {part.verdict}: {part.detail}")
    if not fp.passed:
        bad = next(p for p in fp.parts if not p.passed)
        raise VerificationFailed(f"{stage.name}: MLX {bad.name} proof failed: {bad.detail}; nothing was written",
                                 report=fp)  # fmt: skip
    return fp
