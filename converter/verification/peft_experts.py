"""PEFT's merge of fused MoE experts, judged on the per-expert tensors the base's files hold.

transformers 5 fuses experts when it loads a model (Mixtral's `experts.N.w1` / `w3`, Qwen-MoE's
`experts.N.gate_proj` / `up_proj` into one `experts.gate_up_proj` (experts, out, in)), and a PEFT
target_parameters LoRA wraps the fused parameter. The base's files, as save_pretrained writes them by default, hold
one tensor per expert and projection. Which rows of which expert each file tensor is, transformers itself says: its
save-direction conversion (`revert_weight_conversion`), run on a stand-in that numbers the fused parameter's rows.
PEFT's own merge computes the whole parameter once (onto zeros, as its merge adds the delta in place), kept while
that module's tensors are proven; each per-expert tensor is its base plus its rows of that. Nothing of converter's
keymaps is used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from converter.verification.referee import Expectation, Expected, RefereeUnavailable

# whole parameters kept at once: one module's gate_up and down, whose file tensors interleave in file order (each
# is PEFT's merge in the proof's precision and its allowance: 2 x 8 bytes an element; another module's recomputes)
KEEP = 2


def saved_pieces(model, name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, int, int]]:
    """The base file tensors a fused parameter is saved as: file name -> (expert, first row, end row), by
    transformers' own save direction on a stand-in (experts, rows, 1) holding each row's number."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    if len(shape) != 3:
        raise RefereeUnavailable(f"PEFT's parameter {name} has shape {list(shape)}, not (experts, out, in)")
    experts, rows = shape[0], shape[1]
    probe = torch.arange(experts * rows, dtype=torch.float64).reshape(experts, rows, 1)
    try:
        saved = revert_weight_conversion(model, {name: probe})
    except Exception as e:  # noqa: BLE001 - a conversion this stand-in cannot go through
        raise RefereeUnavailable(f"transformers' save direction of {name} could not be followed ({e})") from None
    out = {}
    for key, value in saved.items():
        value = value[0] if isinstance(value, list) else value
        numbers = value.reshape(-1)
        first = int(numbers[0].item()) if numbers.numel() else -1
        if value.dim() != 2 or value.shape[1] != 1 or first < 0:
            raise RefereeUnavailable(f"transformers saves {name} as {key}, which is not rows of one expert")
        expert, start = divmod(first, rows)
        want = torch.arange(first, first + numbers.numel(), dtype=torch.float64)
        if start + numbers.numel() > rows or not torch.equal(numbers, want):
            raise RefereeUnavailable(f"transformers saves {name} as {key}, which is not rows of one expert")
        out[key] = (expert, start, start + numbers.numel())
    return out


class WholeParameters:
    """PEFT's merge of whole fused parameters onto zeros (the delta) and its allowance, the last few kept: every
    per-expert tensor of a module reads its rows from one computation. Safe across the proof's worker threads."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._done: OrderedDict[tuple, Expected] = OrderedDict()
        self._lock = threading.Lock()
        self._computing: dict[tuple, threading.Lock] = {}

    def get(self, key: tuple, compute: Callable[[], Expected]) -> Expected:
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key]
            one = self._computing.setdefault(key, threading.Lock())
        with one:  # one thread computes a parameter; the others wait for it
            with self._lock:
                if key in self._done:
                    return self._done[key]
            value = compute()
            with self._lock:
                self._done[key] = value
                self._computing.pop(key, None)
                while len(self._done) > self.keep:
                    self._done.popitem(last=False)
            return value


def piece_expectations(
    pieces: dict[str, tuple[int, int, int]],
    module: str,
    adapters_of: Callable[[str], list[str]],
    merged: Callable[[list[str]], Callable],
    shape: tuple[int, ...],
    whole: WholeParameters,
    key: object,
) -> dict[str, Expectation]:
    """One expectation per file tensor of a fused parameter: its base plus its rows of PEFT's merge of the whole
    parameter (`merged(adapters)` is PEFT's merge as rows(base, start, end); `adapters_of(name)` the adapters the
    recipe applies to that tensor)."""
    out = {}
    for name, (expert, start, end) in pieces.items():
        adapters = adapters_of(name)
        if adapters:
            rule = _piece(merged(adapters), tuple(adapters), expert, start, end, shape, whole, key)
            out[name] = Expectation(module, "LoRA (target_parameters, one expert's rows)", rule)
    return out


def _piece(merge, adapters: tuple, expert: int, start: int, end: int, shape, whole: WholeParameters, key):
    def rows(base, _start: int, _end: int) -> Expected:
        import torch

        if tuple(base.shape[1:]) != tuple(shape[2:]) or base.shape[0] != end - start:
            raise RefereeUnavailable(f"the base tensor has shape {list(base.shape)}, not rows {start}:{end} of "
                                     f"expert {expert} of {list(shape)}")  # fmt: skip

        def compute() -> Expected:
            return merge(torch.zeros(shape, dtype=base.dtype), 0, shape[0])

        done = whole.get((key, adapters, base.dtype), compute)
        allowance = done.allowance
        if not isinstance(allowance, float | int):
            allowance = allowance[expert, start:end]
        return Expected(base + done.value[expert, start:end], allowance)

    return rows


def saved_one_by_one(model, names: list[str]) -> dict[str, str | None]:
    """saved_names where transformers' save direction cannot run on every weight at once (fused experts do not
    split on one-element stand-ins): each weight asked alone, on a two-element stand-in that a split of experts
    cuts; None where its conversion is more than a rename."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    out: dict[str, str | None] = {}
    stand_in = torch.tensor([0.0, 1.0])
    for name in names:
        try:
            saved = revert_weight_conversion(model, {name: stand_in})
        except Exception:  # noqa: BLE001 - converted (fused or split), not renamed
            out[name] = None
            continue
        (key, value), *more = saved.items() or [(name, None)]
        if more or value is None or isinstance(value, list) or not torch.equal(value, stand_in):
            out[name] = None
        elif key != name:
            out[name] = key
    return out
