"""Training checkpoints as merge bases: verl (FSDP rank files, Megatron dist_ckpt), Megatron-LM (legacy mp_rank
files, torch_dist), torchtitan (DCP step folders) and any PyTorch Distributed Checkpoint.

`locate` finds the shards from whatever folder of the run a user gives; each reader gives a `ShardedSource`
(names, dtypes, shapes, one tensor rebuilt from its shards on demand), renamed where the trainer uses its own
names (Megatron-Core, torchtitan); `view.TrainingCheckpoint` turns it into a `checkpoint.Checkpoint` (HF names, LoRA
inside fused, tied head dropped).
"""

from __future__ import annotations

import json
from pathlib import Path

from converter.engine.checkpoint import Checkpoint
from converter.engine.readers import BaseReader, register
from converter.errors import (
    BadInputError,
    CheckpointError,
    CheckpointNotFound,
    ConverterError,
    NoModelWeights,
    UsageError,
)
from converter.training.locate import Located, config_candidates, is_shard_file, locate
from converter.training.view import TrainingCheckpoint

__all__ = ["TrainingCheckpoint", "is_training_base", "is_training_checkpoint", "locate", "open_training"]


def is_training_checkpoint(path: Path) -> bool:
    """A folder (not a model folder) in which `locate` finds a training layout, or an ambiguous one."""
    path = Path(path)
    if is_shard_file(path):
        return True
    if not path.is_dir() or (path / "config.json").is_file() or (path / "model_index.json").is_file():
        return False
    try:
        locate(path)
    except CheckpointNotFound:
        return False
    except ConverterError:  # found, but which step or side needs the user: open_training says so
        return True
    return True


def is_training_base(base: str | None) -> bool:
    """`--base` needs no `--adapter`: a training checkpoint, or a local folder that is no model at all (opening it
    then says in one line which layouts were looked for and where, or that it is an adapter)."""
    if not base:
        return False
    path = Path(base)
    if is_training_checkpoint(path):
        return True
    if not path.is_dir():
        return False
    return not any((path / f).is_file() for f in ("config.json", "model_index.json"))


def find_config(located: Located, given: str | Path | None) -> Path:
    """The config.json describing the checkpoint: `--config` (a folder or the file), else verl's huggingface/."""
    if given is not None:
        path = Path(given)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise UsageError(f"--config {given}: no config.json there (give the base model's folder or file)")
        return file
    for folder in config_candidates(located):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    where = ", ".join(str(f) for f in config_candidates(located))
    raise CheckpointError(
        f"{located.weights}: a {located.layout} checkpoint without its Hugging Face config.json (looked in {where}); "
        "give --config with the base model's folder or its config.json",
        file=located.weights,
    )


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise BadInputError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})", file=path) from None


def open_training(
    path: Path, *, lora_alpha: float | None = None, allow_pickle: bool = False, config: str | Path | None = None
):
    """Open a training checkpoint from any folder of its run (see `locate`); `config` is `--config`."""
    located = locate(Path(path))
    config_file = find_config(located, config)
    cfg = read_json(config_file)
    folder = located.weights
    adapter = config_file.parent / "adapter" / "adapter_config.json"
    # Each reader imports torch, so only the one for the layout found is imported (a plain merge needs none).
    if located.layout == "Megatron mp_rank":
        from converter.training.legacy import LegacySource

        source = LegacySource(folder, cfg, allow_pickle=allow_pickle)
    elif located.layout == "DCP":
        from converter.training.dcp import DcpSource
        from converter.training.mcore_dist import TRAINING_STATE, MegatronDist, is_megatron_dist
        from converter.training.torchtitan import TorchtitanNames, has_torchtitan_names

        source = DcpSource(folder, allow_pickle=allow_pickle)
        if adapter.is_file():
            raise CheckpointError(
                f"{folder}: holds a LoRA adapter's training state only; its PEFT export is {adapter.parent}: merge it "
                "with --adapter that folder and --base the model the run started from",
                file=folder,
            )
        try:
            if not any(not n.startswith(TRAINING_STATE) for n in source.names()):
                raise NoModelWeights(f"{folder}: optimizer and training state only, no model weights", file=folder)
            if is_megatron_dist(source.names()):
                source = MegatronDist(source, cfg)
        except NoModelWeights as e:
            if not any(config_file.parent.glob("*.safetensors")):
                raise
            return _hf_export(config_file.parent, located, str(e))
        if has_torchtitan_names(source.names()):
            source = TorchtitanNames(source, cfg)
    else:
        from converter.training.fsdp import FsdpSource

        source = FsdpSource(folder, allow_pickle=allow_pickle)
    from converter.training.megatron import MegatronNames, has_megatron_names

    if has_megatron_names(source.names()):
        source = MegatronNames(source, cfg)
    return TrainingCheckpoint(located.side, source, lora_alpha=lora_alpha, config_file=config_file, notes=located.notes)


def _hf_export(folder: Path, located: Located, why: str):
    """verl with Megatron-Bridge saves the weights as a Hugging Face folder and only training state as shards."""
    ckpt = Checkpoint(folder)
    ckpt.notes = [*located.notes, f"weights read from {folder} (the shards in {located.weights} hold no model: {why})"]
    return ckpt


register(BaseReader("training checkpoint", owns=is_shard_file, whole=is_training_base, open=open_training))
