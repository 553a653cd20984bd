"""Progress of a long step: one updating tqdm bar on a terminal, plain lines everywhere else.

Why: a bar redrawn in place is what a person at a terminal wants (huggingface_hub's CLI does the same); a pipe, a
log file or the Space's log box wants a few whole lines instead of carriage returns. Only the command line knows
which it is: it sets `bar_file` (converter.io.quiet) to its terminal; the Python API and the app leave it None and
get lines through their `log`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

from converter.io.units import human_bytes

#: The terminal a bar is drawn on; None: report through `log` as lines.
bar_file: TextIO | None = None


class Progress:
    """`update(n)` as work is done. In lines, one per `every` of the total (0: one per update), through `log`."""

    def __init__(
        self, total: int, desc: str, log: Callable[[str], None], *, unit: str = "B", every: float = 0.1
    ) -> None:
        self.total, self.desc, self.log, self.unit, self.every = total, desc, log, unit, every
        self.done = 0
        self._next = every
        self._bar = None
        if bar_file is not None:
            from tqdm import tqdm

            scale = {"unit_scale": True} if unit == "B" else {}  # kB, MB as human_bytes
            self._bar = tqdm(total=total, desc=desc, unit=unit, file=bar_file, leave=False, disable=False,
                             dynamic_ncols=True, **scale)  # fmt: skip

    def update(self, n: int = 1, **postfix: object) -> None:
        self.done += n
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)
            return
        if self.total and self.done / self.total + 1e-9 >= self._next:
            self.log(f"  {self.desc}: {self._amount()}" + "".join(f", {k} {v}" for k, v in postfix.items()))
            while self._next <= self.done / self.total + 1e-9:
                self._next += self.every or 1 / self.total

    def write(self, line: str) -> None:
        """A line that must not be torn by the bar (a job that failed)."""
        if self._bar is not None:
            self._bar.write(line, file=bar_file)
        else:
            self.log(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _amount(self) -> str:
        share = f"{self.done / self.total:4.0%}"
        if self.unit == "B":
            return f"{share} {human_bytes(self.done)} / {human_bytes(self.total)}"
        return f"{share} {self.done}/{self.total} {self.unit}s"
