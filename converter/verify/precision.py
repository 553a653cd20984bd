"""Compute in float32 while the weights stay in their own dtype: each layer is upcast on the fly and put back.

Why: a whole float32 copy of a bf16 model doubles verification's memory (and the time to make it), yet the verdict
needs float32 math only while a layer runs. Upcasting bf16/fp16 is exact and the original tensors are put back
untouched, so the results are those of a model loaded in float32, at the memory of one copy in the stored dtype
plus one layer in float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

LOW = ("bfloat16", "float16")


def _units(model) -> list:
    """Modules upcast as one: each block of the outermost layer stacks (nn.ModuleList), and every other module
    holding parameters itself (embeddings, final norm, head). A whole block at once keeps code that reads a
    weight outside its module's own forward (PEFT's DoRA reads the base layer's weight) in float32 too."""
    import torch

    units, inside = [], set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                units.append((block, True))
                inside.update(id(m) for m in block.modules())
            inside.add(id(module))
    for module in model.modules():
        if id(module) not in inside and any(True for _ in module.parameters(recurse=False)):
            units.append((module, False))  # its own tensors only: its children are units of their own
    return units


@contextmanager
def float32_compute(model) -> Iterator[None]:
    """Within this block every forward of `model` computes in float32; its bf16/fp16 weights are restored after
    each unit runs (the very tensors, so nothing is rounded twice). Tied weights are upcast once per use."""
    import torch

    saved: dict[int, tuple] = {}

    def tensors(unit, recurse):
        yield from unit.parameters(recurse=recurse)
        yield from unit.buffers(recurse=recurse)

    def up(unit, _args, recurse):
        for t in tensors(unit, recurse):
            if t.is_floating_point() and str(t.dtype).removeprefix("torch.") in LOW and id(t) not in saved:
                saved[id(t)] = (t, t.data)
                t.data = t.data.to(torch.float32)

    def down(unit, _args, _out, recurse):
        for t in tensors(unit, recurse):
            kept = saved.pop(id(t), None)
            if kept is not None:
                t.data = kept[1]

    hooks = []
    for unit, recurse in _units(model):
        hooks.append(unit.register_forward_pre_hook(partial(up, recurse=recurse)))
        hooks.append(unit.register_forward_hook(partial(down, recurse=recurse)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for t, data in saved.values():
            t.data = data


def has_low_precision(model) -> bool:
    return any(str(p.dtype).removeprefix("torch.") in LOW for p in model.parameters())
