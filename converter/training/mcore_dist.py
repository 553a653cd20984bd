"""Megatron-Core torch_dist checkpoints (Megatron-LM `iter_N/`, verl's `dist_ckpt/`): the model's tensors, one layer
(and one expert) at a time.

Megatron saves a parameter under its sharded key. With homogeneous layers (verl's setting, Megatron's default) all
layers share one key with a leading layer axis: `decoder.layers.self_attention.linear_qkv.weight` is (L, rows, in),
grouped or sequential experts add an expert axis, `decoder.layers.mlp.experts.linear_fc1.weight` (L, E, rows, in).
Heterogeneous models key each layer (`decoder.layers.N.…`, experts (E, rows, in)), singleton shards each expert
(`decoder.layers.N.mlp.experts.E.…`). Tensor-parallel pieces are chunks of the global tensor, so the global layout
is the single-GPU one (gate then up, qkv interleaved per KV group). The optimizer (`optimizer.…`) shares the folder
and is left out. Names come out per layer and expert as the legacy layout spells them
(`decoder.layers.N.mlp.experts.linear_fc1.weightE`), for `megatron.MegatronNames` to rename; a vocabulary padded for
tensor parallelism is cut back to config.json's vocab_size.
"""

from __future__ import annotations

import re

import torch

from converter.errors import CheckpointError, NoModelWeights

STACKED = re.compile(r"decoder\.layers\.(?!\d)(?P<rest>.+)")
EXPERTS = re.compile(r"mlp\.experts\.(?P<fc>linear_fc[12])\.(?P<p>weight|bias)")
PER_LAYER_EXPERTS = re.compile(
    r"(?P<head>decoder\.layers\.\d+\.mlp\.experts)\.(?P<fc>linear_fc[12])\.(?P<p>weight|bias)"
)
SINGLETON_EXPERT = re.compile(
    r"(?P<head>decoder\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.(?P<p>weight|bias)"
)
# What trainers save beside the model in the same DCP folder (Megatron, torchtitan, torch's own app state).
TRAINING_STATE = (
    "optimizer.",
    "optim.",
    "rng_state",
    "lr_scheduler",
    "rerun_state_machine",
    "dataloader",
    "train_state",
)
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_megatron_dist(names: list[str]) -> bool:
    return any(n.startswith(("decoder.", "embedding.word_embeddings")) for n in names)


class MegatronDist:
    """A DcpSource of a Megatron torch_dist folder, seen per layer and expert (the reader interface)."""

    def __init__(self, source, config: dict):
        self.inner = source
        self.folder = source.folder
        self.files = source.files
        self.kind = "Megatron torch_dist"
        self.vocab = config.get("vocab_size")
        self._where: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.skipped = 0
        for key in source.names():
            if key.startswith(TRAINING_STATE):
                self.skipped += 1
                continue
            shape = source.shape(key)
            if m := STACKED.fullmatch(key):
                rest = m.group("rest")
                for n in range(shape[0]):
                    if e := EXPERTS.fullmatch(rest):
                        for x in range(shape[1]):
                            self._add(f"decoder.layers.{n}.mlp.experts.{e['fc']}.{e['p']}{x}", key, (n, x))
                    else:
                        self._add(f"decoder.layers.{n}.{rest}", key, (n,))
            elif (m := PER_LAYER_EXPERTS.fullmatch(key)) and len(shape) == 3:
                for x in range(shape[0]):
                    self._add(f"{m['head']}.{m['fc']}.{m['p']}{x}", key, (x,))
            elif m := SINGLETON_EXPERT.fullmatch(key):
                self._add(f"{m['head']}.{m['fc']}.{m['p']}{m['e']}", key, ())
            else:
                self._add(key, key, ())
        if not self._where:
            raise NoModelWeights(
                f"{self.folder}: a Megatron checkpoint without model weights ({self.skipped} optimizer / training "
                "state entries only): the weights are saved elsewhere (verl with mbridge writes them to huggingface/)",
                file=self.folder,
            )

    def _add(self, name: str, key: str, index: tuple[int, ...]) -> None:
        if name in self._where:
            raise CheckpointError(
                f"{self.folder}: {key} and {self._where[name][0]} both hold {name}", file=self.folder, tensor=name
            )
        self._where[name] = (key, index)

    def names(self) -> list[str]:
        return list(self._where)

    def dtype(self, name: str) -> torch.dtype:
        return self.inner.dtype(self._where[name][0])

    def shape(self, name: str) -> tuple[int, ...]:
        key, index = self._where[name]
        shape = tuple(self.inner.shape(key))[len(index) :]
        if name in VOCAB and self.vocab and shape[0] > self.vocab:
            return (self.vocab, *shape[1:])
        return shape

    def storage_of(self, name: str) -> tuple:
        key, index = self._where[name]
        return (self.inner.storage_of(key), index)

    def read(self, name: str) -> torch.Tensor:
        key, index = self._where[name]
        t = self.inner.read(key, index)
        if name in VOCAB and self.vocab and t.shape[0] > self.vocab:
            t = t[: self.vocab].clone()
        return t
