"""Megatron-Core names seen as transformers names, by the rules in `keymaps/megatron.yaml` (data, not code).

One source tensor can become several keys: `linear_qkv` is cut into q/k/v per KV group, `linear_fc1` into
gate/up; the row counts are config expressions in the keymap. The last source tensor read is kept, so q, k and v
(read one after another) cost one read of their fused tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from converter.engine.keymap import Keymap, RenameRule, all_keymaps, eval_expr
from converter.errors import CheckpointError, KeymapError

NAME = "megatron"


def megatron_keymap() -> Keymap:
    return next(k for k in all_keymaps() if k.name == NAME)


def rule_for(keymap: Keymap, key: str) -> RenameRule | None:
    return next((r for r in keymap.renames if r.pattern.fullmatch(key)), None)


def has_megatron_names(names: list[str]) -> bool:
    keymap = megatron_keymap()
    return not any(n.startswith("model.") for n in names) and any(rule_for(keymap, n) for n in names)


@dataclass(frozen=True)
class _Target:
    key: str
    part: int  # which part of each row block (0 without a split)
    groups: int
    rows: tuple[int, ...] | None


class MegatronNames:
    """Wraps a sharded source whose keys are Megatron-Core names; same interface, transformers names."""

    def __init__(self, source, config: dict):
        self.inner = source
        self.kind = f"{source.kind} (Megatron-Core names)"
        self.files = source.files
        keymap = megatron_keymap()
        self._targets: dict[str, _Target] = {}
        for key in source.names():
            rule = rule_for(keymap, key)
            if rule is None:
                raise CheckpointError(
                    f"{source.folder}: tensor {key} has no Megatron-Core -> transformers rule "
                    "(keymaps/megatron.yaml); add one",
                    file=source.folder,
                    tensor=key,
                )
            fields = rule.pattern.fullmatch(key).groupdict()  # type: ignore[union-attr]
            names = [t.format(**fields) for t in rule.to]
            rows = None
            groups = 1
            if rule.rows is not None:
                rows = tuple(eval_expr(e, config, keymap.defaults) for e in rule.rows)
                groups = eval_expr(rule.groups, config, keymap.defaults)
                first = source.shape(key)[0]
                if len(rows) != len(names) or groups * sum(rows) != first:
                    raise CheckpointError(
                        f"{source.folder}: tensor {key} has {first} rows; config.json implies {groups} x "
                        f"{' + '.join(map(str, rows))} for {', '.join(names)}: another model's config?",
                        file=source.folder,
                        tensor=key,
                    )
            elif len(names) != 1:
                raise KeymapError(
                    f"keymaps/megatron.yaml: the rule for {key} names several keys but no split",
                    file="keymaps/megatron.yaml",
                    tensor=key,
                )
            for i, name in enumerate(names):
                if name in self._targets:
                    raise CheckpointError(
                        f"{source.folder}: {key} and {self._targets[name].key} both map to {name}",
                        file=source.folder,
                        tensor=key,
                    )
                self._targets[name] = _Target(key, i, groups, rows)
        self._last: tuple[str, torch.Tensor] | None = None

    def names(self) -> list[str]:
        return list(self._targets)

    def dtype(self, name: str) -> torch.dtype:
        return self.inner.dtype(self._targets[name].key)

    def shape(self, name: str) -> tuple[int, ...]:
        t = self._targets[name]
        shape = tuple(self.inner.shape(t.key))
        return shape if t.rows is None else (t.groups * t.rows[t.part], *shape[1:])

    def storage_of(self, name: str) -> tuple:
        t = self._targets[name]
        return (self.inner.storage_of(t.key), t.part)

    def read(self, name: str) -> torch.Tensor:
        t = self._targets[name]
        if self._last is not None and self._last[0] == t.key:
            whole = self._last[1]
        else:
            whole = self.inner.read(t.key)
            self._last = (t.key, whole) if t.rows is not None else None
        if t.rows is None:
            return whole
        rest = whole.shape[1:]
        start = sum(t.rows[: t.part])
        blocks = whole.reshape(t.groups, sum(t.rows), *rest).narrow(1, start, t.rows[t.part])
        return blocks.reshape(-1, *rest).clone()
