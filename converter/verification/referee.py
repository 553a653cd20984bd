"""What a referee is: the independent source of what every changed tensor of a merge must hold.

A referee answers, per output tensor it changes, "given the base's rows, what must these rows be?", in float64,
together with what a correct merge's own float32 arithmetic may add to that (the compute allowance). Tensors a
referee does not name must be the base's, unchanged (or cast). The tensor proof (`verification/tensors.py`) asks the
questions and judges the answers; a referee never sees the merge's output, and the referees that carry the
proof's independence (PEFT, diffusers) never see the merge's plan, keymaps or file readers either.

Referees: PEFT (`peft_referee.py`, also for training checkpoints written unmerged and TIES/DARE merges),
diffusers' loader (`diffusers_referee.py`) and the published formula (`formula.py`, which shares the plan's name
lookup, and says so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class RefereeUnavailable(Exception):
    """This referee cannot judge this merge (the reason is said in the report); the next one is asked.
    `by_design`: the tensor proof is not the proof for this output (a 4-bit one is judged by its behaviour), so
    not running it leaves the merge verified by the other proof."""

    by_design = False


class JudgedByBehaviour(RefereeUnavailable):
    by_design = True


def could_not(what: str, error: BaseException) -> str:
    """One line on why `what` failed ("PEFT could not be built for this model"), from an error raised inside a
    library (transformers, PEFT, diffusers) or a referee's own code; the traceback goes to stderr, which the CLI
    shows only with -v."""
    import sys
    import traceback

    traceback.print_exception(error, file=sys.stderr)
    return f"{what} ({in_one_line(error)})"


def first_line(error: BaseException, width: int = 200) -> str:
    """The first line of an error's message, at most `width` characters ("..." where cut): what a library said,
    in one line of the report."""
    text = (str(error).strip().splitlines() or [""])[0]
    return text if len(text) <= width else text[: width - 3] + "..."


def in_one_line(error: BaseException, width: int = 200) -> str:
    """The error's class and the first line of its message ("ValueError: ...")."""
    first = first_line(error, width)
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


U32 = 2.0**-24
GAMMA_SLACK = 8  # roundings beside the longest inner product: scale, weight, the sum with the base, a division


def gamma(n: int) -> float:
    """The float32 error of a sum of n products, relative to the sum of their absolute values (γ_n), with room
    for GAMMA_SLACK more roundings."""
    return (n + GAMMA_SLACK) * U32


@dataclass
class Expected:
    """What a block of rows must hold: `value` (float64 torch tensor) and `allowance`: what a correct merge that
    computes in float32 may be off by on top of rounding its result (elementwise, or 0 where it computes
    nothing: copies, replacements), derived by the referee from what is computed: γ_n · Σ|terms|."""

    value: object
    allowance: object = 0.0


@dataclass
class Expectation:
    """One output tensor a referee changes.

    `module`: the referee's own name for what changes it (PEFT: `base_model.model.<path>`); `kind`: what the
    change is ("LoRA", "DoRA", "replacement", "trainable tokens", "TIES" ...); `rows(base, start, end)`: the
    expected rows start:end given the base's rows (float64); `row_blocks`: whether rows may be asked for a block
    at a time (else one call for the whole tensor); `base_name`: the base tensor it starts from when that is
    not the output's own name (a tied head written untied starts from the embedding), None for the same name;
    `added`: the base's files hold no such tensor (a classifier's head made from a checkpoint saved without one),
    the referee's value is the whole expectation."""

    module: str
    kind: str
    rows: Callable[[object, int, int], Expected]
    row_blocks: bool = False
    base_name: str | None = None
    shape: tuple[int, ...] | None = None  # the output's shape when the referee knows it (a resized vocabulary)
    added: bool = False


@dataclass
class RefereeInfo:
    """Who referees and why: `name` is what the card says ("PEFT", "diffusers", "published formula");
    `detail` one line on what it computed from; `independent`: it shares no file parsing and no name mapping
    with the merge."""

    name: str
    detail: str
    independent: bool = True
    notes: list[str] = field(default_factory=list)
    shared: str | None = None  # where not independent, what it shares with the merge (None: the keymap's placement)


class Referee(Protocol):
    """The interface every referee implements."""

    info: RefereeInfo

    def expectations(self) -> dict[str, Expectation]:
        """Every output tensor name this referee changes, with its rule. Names not here are untouched. A referee
        may also have `dropped`, base tensor names the output must leave out (known once this is asked)."""
        ...
