"""The legacy Megatron layout: `mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt` (Megatron-LM's
`get_checkpoint_name`): tensor, pipeline and expert parallel.

Each file is a `torch.save` of `{"model": state dict with Megatron-Core names, "args": ..., ...}` (with virtual
pipeline stages `model0`, `model1`... instead of `model`) for one (tensor rank, pipeline stage, expert rank).
Stages and virtual stages number their layers from 0: each is shifted by the layers of those before it in the
interleaved order. Expert ranks number their experts from 0: each is shifted by the experts of the ranks before.
Tensor-parallel shards are joined the way `keymaps/megatron.yaml` says
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

from converter.engine.keymap import eval_expr
from converter.errors import CheckpointError
from converter.training.fsdp import Piece, load_meta, piece_of, read_piece
from converter.training.megatron import megatron_keymap, rule_for

RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
VOCAB = {"embedding.word_embeddings.weight", "output_layer.weight"}
# An expert's tensors, by the local index its rank gives it: TEGroupedMLP `linear_fc1.weight3`, SequentialMLP
# `local_experts.3.linear_fc1.weight`. Ranks of expert parallelism hold consecutive experts.
LOCAL_EXPERT = re.compile(
    r"(?P<head>.+\.mlp\.experts)\.(?:(?P<fc>linear_fc[12])\.(?P<p>weight|bias)(?P<i>\d+)"
    r"|local_experts\.(?P<j>\d+)\.(?P<fc2>linear_fc[12])\.(?P<p2>weight|bias))"
)


def _local_index(key: str) -> int:
    m = LOCAL_EXPERT.fullmatch(key)
    return int(m["i"] if m["i"] is not None else m["j"])


def rank_dirs(folder: Path) -> dict[tuple[int, str, str], Path]:
    """(tensor rank, 2nd field, 3rd field) -> model_optim_rng.pt; what the fields mean the files' `args` say."""
    found = {}
    for d in folder.iterdir():
        if (m := RANK_DIR.fullmatch(d.name)) and d.is_dir():
            found[(int(m.group(1)), m.group(2) or "", m.group(3) or "")] = d / "model_optim_rng.pt"
    if not found:
        raise CheckpointError(f"{folder}: no mp_rank_XX[_YYY]/ folders (not a legacy Megatron checkpoint)", file=folder)
    return found


def _grid(folder: Path, found: dict, args) -> dict[tuple[int, int, int], Path]:
    """(tensor, pipeline, expert) rank -> file. `mp_rank_XX_YYY` is a pipeline stage, or an expert-parallel rank
    when the run had expert but no pipeline parallelism (Megatron appends `_ZZZ` for experts only then)."""
    second_is_expert = (
        all(not z for _, _, z in found)
        and getattr(args, "pipeline_model_parallel_size", 1) == 1
        and getattr(args, "expert_model_parallel_size", 1) > 1
    )
    grid = {}
    for (t, y, z), path in found.items():
        p, e = (0, int(y or 0)) if second_is_expert else (int(y or 0), int(z or 0))
        grid[(t, p, e)] = path
    sizes = [1 + max(k[i] for k in grid) for i in range(3)]
    for t in range(sizes[0]):
        for p in range(sizes[1]):
            for e in range(sizes[2]):
                if (t, p, e) not in grid or not grid[(t, p, e)].is_file():
                    name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if sizes[1] > 1 else "") + (
                        f"_{e:03d}" if sizes[2] > 1 else "")  # fmt: skip
                    raise CheckpointError(
                        f"{folder}: {name}/model_optim_rng.pt is missing ({sizes[0]} tensor x {sizes[1]} pipeline"
                        + (f" x {sizes[2]} expert" if sizes[2] > 1 else "")
                        + " ranks expected)",
                        file=folder / name / "model_optim_rng.pt",
                    )
    return grid


class LegacySource:
    """Tensors of a legacy Megatron checkpoint under global Megatron-Core names, TP shards joined on demand.

    Pipeline stages and virtual stages (`model0`, `model1`... in each file, interleaved: chunk v of stage p holds
    the (v·pp + p)-th run of layers) are renumbered in that order; expert-parallel ranks' local experts get their
    global numbers (rank · local experts + index); the rest is the same on every expert rank and read from the first.
    """

    kind = "Megatron mp_rank"

    def __init__(self, folder: Path, config: dict, *, allow_pickle: bool = False):
        self.folder = Path(folder)
        found = rank_dirs(self.folder)
        first = self._load(next(iter(found.values())), allow_pickle)
        grid = _grid(self.folder, found, first.get("args"))
        self.tp, pp, ep = (1 + max(k[i] for k in grid) for i in range(3))
        args = first.get("args")
        etp = getattr(args, "expert_tensor_parallel_size", None)
        if ep > 1 and etp not in (None, self.tp):
            raise CheckpointError(
                f"{self.folder}: experts are split over {etp} tensor-parallel ranks, the rest over {self.tp}; "
                "a legacy checkpoint with expert tensor parallelism unlike the rest is not supported",
                file=self.folder,
            )
        self.files = [grid[(t, p, e)] for p in range(pp) for e in range(ep) for t in range(self.tp)]
        self.sizes = {f: f.stat().st_size for f in self.files}
        keymap = megatron_keymap()
        self.vocab = config.get("vocab_size")
        self.entries: dict[str, tuple[list[Piece], torch.dtype, object]] = {}
        models = {k: self._models(grid[k], allow_pickle) for k in grid}
        vpp = len(models[(0, 0, 0)])
        if any(len(m) != vpp for m in models.values()):
            raise CheckpointError(
                f"{self.folder}: files disagree on the number of virtual pipeline stages", file=self.folder
            )
        offset = 0
        for v in range(vpp):
            for p in range(pp):
                states = {(t, e): models[(t, p, e)][v] for t in range(self.tp) for e in range(ep)}
                layers = {int(m.group(1)) for k in states[(0, 0)] if (m := LAYER.match(k))}
                where = grid[(0, p, 0)]
                for e in range(ep):
                    local = [k for k in states[(0, e)] if LOCAL_EXPERT.fullmatch(k)]
                    count = 1 + max((_local_index(k) for k in local), default=-1)
                    for key in states[(0, e)] if e == 0 else local:
                        self._add(key, [states[(t, e)] for t in range(self.tp)], [grid[(t, p, e)] for t in range(
                            self.tp)], offset, e * count, where, config, keymap)  # fmt: skip
                offset += len(layers)
        if config.get("num_hidden_layers") not in (None, offset):
            raise CheckpointError(
                f"{self.folder}: the files hold {offset} layers; config.json says {config['num_hidden_layers']} "
                "(another model's config? or expert-parallel ranks mp_rank_XX_YYY read as pipeline stages because "
                "the files carry no args)",
                file=self.folder,
            )

    def _add(self, key, states, paths, offset, first_expert, where, config, keymap) -> None:
        value = states[0][key]
        if key.endswith("._extra_state") or not isinstance(value, torch.Tensor):
            return  # Transformer Engine's FP8 bookkeeping, not a weight
        name = LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", key)
        if m := LOCAL_EXPERT.fullmatch(name):
            fc, p = m["fc"] or m["fc2"], m["p"] or m["p2"]
            name = f"{m['head']}.{fc}.{p}{first_expert + _local_index(key)}"
        rule = rule_for(keymap, name)
        if rule is None:
            raise CheckpointError(
                f"{where}: tensor {key} has no Megatron-Core -> transformers rule (keymaps/megatron.yaml); add one",
                file=where,
                tensor=key,
            )
        if any(key not in s for s in states[1:]):
            raise CheckpointError(
                f"{self.folder}: tensor {key} is missing on some tensor-parallel ranks", file=self.folder, tensor=key
            )
        if name in self.entries:
            raise CheckpointError(
                f"{self.folder}: {name} is held by two pipeline or expert ranks (expert-parallel ranks mp_rank_XX_YYY "
                "read as pipeline stages? the files carry no args saying which they are)",
                file=self.folder,
                tensor=name,
            )
        split = None
        if rule.rows is not None:
            split = (eval_expr(rule.groups, config, keymap.defaults),
                     [eval_expr(e, config, keymap.defaults) for e in rule.rows])  # fmt: skip
        pieces = [piece_of(path, s[key]) for path, s in zip(paths, states, strict=True)]
        self.entries[name] = (pieces, value.dtype, (rule.parallel, split))

    @staticmethod
    def _load(path: Path, allow_pickle: bool) -> dict:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return load_meta(path, allow_pickle)

    def _models(self, path: Path, allow_pickle: bool) -> list[dict]:
        """The file's model state dicts: `model`, or one per virtual pipeline stage (`model0`, `model1`...)."""
        obj = self._load(path, allow_pickle)
        chunks = sorted((int(k[5:]), v) for k, v in obj.items() if k.startswith("model") and k[5:].isdigit())
        states = [v for _, v in chunks] if chunks else [obj.get("model", obj)]
        if chunks and [i for i, _ in chunks] != list(range(len(chunks))):
            raise CheckpointError(f"{path}: virtual pipeline stages {[i for i, _ in chunks]} are not 0..n-1", file=path)
        if not all(isinstance(s, dict) for s in states):
            raise CheckpointError(f"{path}: no 'model' state dict inside", file=path)
        return states

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
