"""torchtitan checkpoints (`checkpoint/step-N/`, a DCP folder): torchtitan's parameter names seen as transformers names.

torchtitan flattens the model's state dict to the top of the checkpoint, under its own names (`tok_embeddings`,
`layers.N.attention.wq`, `feed_forward.w1`...), beside `optimizer.…`, `lr_scheduler`, `dataloader` and
`train_state`, which are left out. `keymaps/torchtitan.yaml` renames them as torchtitan's own `to_hf` export does.
Llama 3 rotates adjacent pairs of each head's rows (complex RoPE) where transformers rotates the two halves: the q
and k rows are reordered per head (`rope` in the keymap); Qwen3 rotates halves already. torchtitan saves no Hugging
Face config, so `--config` gives it; other model types (MoE experts among them) are refused by name.
"""

from __future__ import annotations

import torch

from converter.engine.keymap import Keymap, all_keymaps, eval_expr
from converter.errors import CheckpointError
from converter.training.mcore_dist import TRAINING_STATE
from converter.training.megatron import rule_for

NAME = "torchtitan"
ADJACENT_PAIRS = {"llama": True, "qwen3": False}  # how each model type's torchtitan attention pairs rotary dims


def torchtitan_keymap() -> Keymap:
    return next(k for k in all_keymaps() if k.name == NAME)


def has_torchtitan_names(names: list[str]) -> bool:
    return "tok_embeddings.weight" in names or any(n.startswith("layers.0.attention.") for n in names)


class TorchtitanNames:
    """Wraps a DcpSource of a torchtitan step folder; same interface, transformers names."""

    def __init__(self, source, config: dict):
        self.inner = source
        self.folder = source.folder
        self.files = source.files
        self.kind = "torchtitan DCP"
        model_type = config.get("model_type")
        if model_type not in ADJACENT_PAIRS:
            raise CheckpointError(
                f"{self.folder}: a torchtitan checkpoint of model_type {model_type!r} (from the config); its names "
                f"are mapped for {', '.join(sorted(ADJACENT_PAIRS))} only",
                file=self.folder,
            )
        keymap = torchtitan_keymap()
        self._map: dict[str, tuple[str, int | None]] = {}
        for key in source.names():
            if key.startswith(TRAINING_STATE):
                continue
            rule = rule_for(keymap, key)
            if rule is None:
                raise CheckpointError(
                    f"{self.folder}: tensor {key} has no torchtitan -> transformers rule (keymaps/torchtitan.yaml); "
                    "torchtitan MoE checkpoints are not supported",
                    file=self.folder,
                    tensor=key,
                )
            name = rule.to[0].format(**rule.pattern.fullmatch(key).groupdict())  # type: ignore[union-attr]
            heads = eval_expr(rule.rope, config, keymap.defaults) if rule.rope and ADJACENT_PAIRS[model_type] else None
            self._map[name] = (key, heads)

    def names(self) -> list[str]:
        return list(self._map)

    def dtype(self, name: str) -> torch.dtype:
        return self.inner.dtype(self._map[name][0])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(self._map[name][0])

    def storage_of(self, name: str) -> tuple:
        return self.inner.storage_of(self._map[name][0])

    def read(self, name: str) -> torch.Tensor:
        key, heads = self._map[name]
        t = self.inner.read(key)
        if heads is None:
            return t
        rows, cols = t.shape
        if rows % (2 * heads):
            raise CheckpointError(
                f"{self.folder}: tensor {key} has {rows} rows, not {heads} heads of pairs", file=self.folder, tensor=key
            )
        # per head: rows (d0 re, d0 im, d1 re, d1 im ...) -> (d0 re, d1 re, ... , d0 im, d1 im ...)
        return t.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()
