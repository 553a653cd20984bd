"""The readers of bases the engine does not read itself (a training run's checkpoint), so that it opens them without
importing their code: each such package registers its reader here when it is imported, and the top of the package
names them (`converter.BASE_READER_PACKAGES`), imported on first use. Nothing here imports a reader's library, so a
recipe alone stays light.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import converter

if TYPE_CHECKING:
    from converter.engine.checkpoint import Checkpoint


@dataclass(frozen=True)
class BaseReader:
    """One kind of base: `owns(path)` (a file or folder of it the engine would take for something else, such as a
    rank file), `whole(base)` (a `--base` that needs no `--adapter`) and `open(path, lora_alpha=, allow_pickle=,
    config=)`, which raises CheckpointNotFound where it finds none."""

    kind: str
    owns: Callable[[Path], bool]
    whole: Callable[[str | None], bool]
    open: Callable[..., Checkpoint]


_registered: list[BaseReader] = []


def register(reader: BaseReader) -> None:
    """Called by the package that defines `reader`, when it is imported."""
    if reader.kind not in {r.kind for r in _registered}:
        _registered.append(reader)


def base_readers() -> list[BaseReader]:
    """Every registered reader, their packages imported first (each registers itself)."""
    for package in converter.BASE_READER_PACKAGES:
        importlib.import_module(package)
    return list(_registered)
