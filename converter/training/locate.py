"""Where a training run keeps its weights, from whatever folder of it a user points `--base` at.

The writers lay their checkpoints out like this (from their own source):
  verl FSDP        <run>/global_step_N/{actor,critic}/model_world_size_W_rank_R.pt + huggingface/ (SFT: no actor/)
  verl Megatron    <run>/global_step_N/{actor,critic}/dist_ckpt/ + huggingface/             (before layout v2)
                   <run>/global_step_N/{actor,critic}/model/dist_ckpt/ + model/huggingface/ (layout v2)
  Megatron-LM      <run>/iter_NNNNNNN/mp_rank_XX[_YYY[_ZZZ]]/model_optim_rng.pt, or a torch_dist folder there
  torchtitan       <dump>/checkpoint/step-N/ (a DCP folder)
verl and Megatron-LM keep `latest_checkpointed_iteration.txt` (a step number, or `release`) in the run folder;
torchtitan keeps none and resumes from the highest `step-N`. Neither Megatron-LM nor torchtitan saves a Hugging
Face config: `--config` gives it. `locate` accepts the run folder, a step folder, `actor/` / `critic/`, the
`dist_ckpt/` folder or the shard folder itself, and says which step and side it took.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from converter.errors import CheckpointError, CheckpointNotFound

TRACKER = "latest_checkpointed_iteration.txt"
SIDES = ("actor", "critic")
STEP_DIR = re.compile(r"(?:global_step_|iter_|step-)(\d+)")
RANK_FILE = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")
RANK_DIR = re.compile(r"mp_rank_\d{2}(?:_\d{3}){0,2}")
SHARDS_BELOW = (".", "dist_ckpt", "model/dist_ckpt")  # where a side folder keeps its shards (verl Megatron)
TRIED = (
    "verl FSDP rank files (model_world_size_W_rank_R.pt), a DCP / torch_dist folder (.metadata), legacy Megatron "
    "mp_rank_XX[_YYY]/model_optim_rng.pt, in the folder, its actor/ or critic/, their dist_ckpt/ or model/dist_ckpt/, "
    f"and the step that {TRACKER} names (or the highest global_step_N / iter_N / step-N)"
)


@dataclass(frozen=True)
class Located:
    weights: Path  # the folder whose files hold the tensors
    layout: str  # "verl FSDP", "DCP" or "Megatron mp_rank"
    side: Path  # verl's actor/ or critic/ (or the step folder): lora_train_meta.json, huggingface/ live there
    notes: tuple[str, ...] = ()


def shard_layout(folder: Path) -> str | None:
    """The kind of shards directly in `folder`, or None."""
    if not folder.is_dir():
        return None
    if (folder / ".metadata").is_file():
        return "DCP"
    names = [p.name for p in folder.iterdir()]
    if any(RANK_FILE.fullmatch(n) for n in names):
        return "verl FSDP"
    if any(RANK_DIR.fullmatch(n) and (folder / n / "model_optim_rng.pt").is_file() for n in names):
        return "Megatron mp_rank"
    return None


def _shards_of(side: Path) -> tuple[Path, str] | None:
    for below in SHARDS_BELOW:
        folder = side / below if below != "." else side
        if layout := shard_layout(folder):
            return folder, layout
    return None


def _side_of(shards: Path) -> Path:
    """The side folder of a shard folder: `<side>/dist_ckpt`, `<side>/model/dist_ckpt`, or the folder itself."""
    side = shards.parent if shards.name == "dist_ckpt" else shards
    return side.parent if shards.name == "dist_ckpt" and side.name == "model" else side


def is_shard_file(path: Path) -> bool:
    """A file of a training checkpoint given instead of its folder."""
    path = Path(path)
    return path.is_file() and (
        path.name == ".metadata" or bool(RANK_FILE.fullmatch(path.name)) or path.name == "model_optim_rng.pt"
    )


def _from_file(path: Path) -> Path:
    """A file of the checkpoint given instead of its folder (`.metadata`, a rank file, model_optim_rng.pt)."""
    if path.name == "model_optim_rng.pt" and RANK_DIR.fullmatch(path.parent.name):
        return path.parent.parent
    return path.parent


def _latest_step(run: Path) -> tuple[Path, str] | None:
    """The step folder the tracker file names, else the highest numbered step folder."""
    tracker = run / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            names = ["release"]
        elif text.isdigit():
            names = [f"global_step_{int(text)}", f"iter_{int(text):07d}", f"step-{int(text)}"]
        else:
            raise CheckpointError(f"{tracker}: expected a step number or 'release', found {text[:40]!r}", file=tracker)
        for name in names:
            if (run / name).is_dir():
                steps = [p for p in run.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()]
                return run / name, f"step {name} taken: {TRACKER} names it ({len(steps)} steps saved)"
        raise CheckpointError(
            f"{tracker} names step {text} but {run} has no {' or '.join(n + '/' for n in names[:2])} "
            "(deleted or not copied?): pass the step folder you want",
            file=tracker,
        )
    steps = sorted(
        ((int(m.group(1)), p) for p in run.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()),
        key=lambda s: s[0],
    )
    if not steps:
        return None
    return steps[-1][1], f"step {steps[-1][1].name} taken: the highest of {len(steps)} (no {TRACKER})"


def locate(path: Path) -> Located:
    """The shards under `path` and the side folder they belong to; CheckpointNotFound (one line) when there are none."""
    path = Path(path)
    if path.is_file():
        path = _from_file(path)
    if not path.is_dir():
        raise CheckpointNotFound(f"{path}: no such folder", file=path)
    notes: list[str] = []
    bare = _shards_of(path) is None and not any((path / s).is_dir() for s in SIDES)
    if bare and (step := _latest_step(path)) is not None:
        path, note = step
        notes.append(note)
    if found := _shards_of(path):
        return Located(found[0], found[1], _side_of(found[0]), tuple(notes))
    sides = [(s, f) for s in SIDES if (f := _shards_of(path / s))]
    if len(sides) > 1:
        raise CheckpointError(
            f"{path}: holds both an actor/ and a critic/ checkpoint; pass {path / 'actor'} or {path / 'critic'}",
            file=path,
        )
    if sides:
        ((name, (folder, layout)),) = sides
        return Located(folder, layout, path / name, tuple(notes))
    raise CheckpointNotFound(f"{path}: no weights converter recognises; looked for {TRIED}", file=path)


def config_candidates(located: Located) -> list[Path]:
    """Folders that may hold the run's Hugging Face config.json, nearest first (verl's huggingface/ folders)."""
    w, side = located.weights, located.side
    found = [w / "huggingface", w.parent / "huggingface", side / "huggingface", side / "model" / "huggingface"]
    return list(dict.fromkeys(found))
