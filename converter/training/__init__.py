"""Training checkpoints as merge bases: verl FSDP rank files and PyTorch Distributed Checkpoints (DCP).

Each reader gives a `ShardedSource` (names, dtypes, shapes, one tensor rebuilt from its shards on demand);
`view.TrainingCheckpoint` turns it into a `checkpoint.Checkpoint` (HF names, LoRA inside fused, tied head dropped).
"""

from __future__ import annotations

from pathlib import Path

from converter.training.view import TrainingCheckpoint, actor_folder, is_training_checkpoint

__all__ = ["TrainingCheckpoint", "actor_folder", "is_training_checkpoint", "open_training"]


def open_training(path: Path, *, lora_alpha: float | None = None, allow_pickle: bool = False) -> TrainingCheckpoint:
    """Open a verl `actor/` (or `critic/`, or the `global_step_N/` above them) or a DCP folder as a base."""
    folder = actor_folder(Path(path))
    if any(folder.glob("mp_rank_*/model_optim_rng.pt")):
        from converter.training.legacy import LegacySource

        source = LegacySource(folder, TrainingCheckpoint.read_config(folder), allow_pickle=allow_pickle)
    elif (folder / ".metadata").is_file():
        from converter.training.dcp import DcpSource

        source = DcpSource(folder, allow_pickle=allow_pickle)
    else:
        from converter.training.fsdp import FsdpSource

        source = FsdpSource(folder, allow_pickle=allow_pickle)
    from converter.training.megatron import MegatronNames, has_megatron_names

    if has_megatron_names(source.names()):
        source = MegatronNames(source, TrainingCheckpoint.read_config(folder))
    return TrainingCheckpoint(folder, source, lora_alpha=lora_alpha)
