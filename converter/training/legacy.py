"""The legacy Megatron layout: `mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`, tensor- and pipeline-parallel.

Each file is a `torch.save` of `{"model": state dict with Megatron-Core names, "args": ..., ...}` for one
(tensor-parallel rank, pipeline stage). Stages number their layers from 0: a stage's layers are shifted by the
layers of the stages before it. Tensor-parallel shards are joined the way `keymaps/megatron.yaml` says
(`parallel`: column → dim 0, row → dim 1, replicated → rank 0); a fused tensor split into parts (gate/up) is
split on every rank first, so the joined tensor has the single-GPU layout the renames expect. A vocabulary padded
for tensor parallelism is cut back to config.json's vocab_size. Files are indexed on the meta device like FSDP rank
files (weights-only, `argparse.Namespace` allowed for `args`), one tensor read at a time.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from converter.errors import ConverterError
from converter.keymap import eval_expr
from converter.training.fsdp import Piece, load_meta, piece_of, read_piece
from converter.training.megatron import megatron_keymap, rule_for

RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
VOCAB = {"embedding.word_embeddings.weight", "output_layer.weight"}


def rank_dirs(folder: Path) -> dict[tuple[int, int], Path]:
    found = {}
    for d in folder.iterdir():
        if (m := RANK_DIR.fullmatch(d.name)) and d.is_dir():
            found[(int(m.group(1)), int(m.group(2) or 0))] = d / "model_optim_rng.pt"
    if not found:
        raise ConverterError(f"{folder}: no mp_rank_XX[_YYY]/ folders (not a legacy Megatron checkpoint)")
    tp, pp = 1 + max(t for t, _ in found), 1 + max(p for _, p in found)
    for t in range(tp):
        for p in range(pp):
            if (t, p) not in found or not found[(t, p)].is_file():
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                raise ConverterError(
                    f"{folder}: {name}/model_optim_rng.pt is missing ({tp} tensor x {pp} pipeline ranks expected)"
                )
    return found


class LegacySource:
    """Tensors of a legacy Megatron checkpoint under global Megatron-Core names, TP shards joined on demand."""

    kind = "Megatron mp_rank"

    def __init__(self, folder: Path, config: dict, *, allow_pickle: bool = False):
        self.folder = Path(folder)
        found = rank_dirs(self.folder)
        self.tp = 1 + max(t for t, _ in found)
        pp = 1 + max(p for _, p in found)
        self.files = [found[(t, p)] for p in range(pp) for t in range(self.tp)]
        self.sizes = {f: f.stat().st_size for f in self.files}
        keymap = megatron_keymap()
        self.vocab = config.get("vocab_size")
        self.entries: dict[str, tuple[list[Piece], torch.dtype, object]] = {}
        offset = 0
        for p in range(pp):
            states = [self._model(found[(t, p)], allow_pickle) for t in range(self.tp)]
            layers = {int(m.group(1)) for k in states[0] if (m := LAYER.match(k))}
            for key in states[0]:
                value = states[0][key]
                if key.endswith("._extra_state") or not isinstance(value, torch.Tensor):
                    continue  # Transformer Engine's FP8 bookkeeping, not a weight
                name = LAYER.sub(lambda m, offset=offset: f"decoder.layers.{int(m.group(1)) + offset}.", key)
                rule = rule_for(keymap, name)
                if rule is None:
                    raise ConverterError(
                        f"{found[(0, p)]}: tensor {key} has no Megatron-Core -> transformers rule "
                        "(keymaps/megatron.yaml); add one"
                    )
                if any(key not in s for s in states[1:]):
                    raise ConverterError(f"{self.folder}: tensor {key} is missing on some tensor-parallel ranks")
                split = None
                if rule.rows is not None:
                    split = (eval_expr(rule.groups, config, keymap.defaults),
                             [eval_expr(e, config, keymap.defaults) for e in rule.rows])  # fmt: skip
                pieces = [piece_of(found[(t, p)], s[key]) for t, s in enumerate(states)]
                self.entries[name] = (pieces, value.dtype, (rule.parallel, split))
            offset += len(layers)

    def _model(self, path: Path, allow_pickle: bool) -> dict:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = load_meta(path, allow_pickle)
        if any(k.startswith("model") and k[5:].isdigit() for k in obj):
            raise ConverterError(f"{path}: virtual pipeline stages (model0, model1...) are not supported yet")
        state = obj.get("model", obj)
        if not isinstance(state, dict):
            raise ConverterError(f"{path}: no 'model' state dict inside")
        return state

    def names(self) -> list[str]:
        return list(self.entries)

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][1]

    def _joined(self, name: str) -> tuple[int, ...]:
        pieces, _, (parallel, _) = self.entries[name]
        shape = list(pieces[0].shape)
        if parallel == "column":
            shape[0] = sum(p.shape[0] for p in pieces)
        elif parallel == "row":
            shape[1] = sum(p.shape[1] for p in pieces)
        return tuple(shape)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._joined(name)
        if name in VOCAB and self.vocab and shape[0] > self.vocab:
            return (self.vocab, *shape[1:])
        return shape

    def storage_of(self, name: str) -> tuple:
        return tuple((p.path, p.offset, p.storage_offset) for p in self.entries[name][0])

    def read(self, name: str) -> torch.Tensor:
        pieces, dtype, (parallel, split) = self.entries[name]
        if parallel == "replicated":
            return read_piece(pieces[0], dtype, self.sizes[pieces[0].path], name)
        parts = [read_piece(p, dtype, self.sizes[p.path], name) for p in pieces]
        if parallel == "row":
            return torch.cat(parts, dim=1)
        if split is not None and not (split[0] > 1 and split[0] % self.tp == 0):
            # e.g. gate/up: every rank holds [gate shard; up shard]; join the gates, then the ups
            sizes = [n // self.tp for n in split[1]]
            chunks = [t.split(sizes, dim=0) for t in parts]
            whole = torch.cat([torch.cat([c[i] for c in chunks]) for i in range(len(sizes))])
        else:  # whole KV groups per rank (qkv): joining the ranks keeps the single-GPU interleave
            whole = torch.cat(parts, dim=0)
        if name in VOCAB and self.vocab and whole.shape[0] > self.vocab:
            whole = whole[: self.vocab].clone()
        return whole
