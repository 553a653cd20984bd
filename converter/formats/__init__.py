"""Adapter formats: each module detects its files and parses them into `Adapter` patches."""

from __future__ import annotations

from pathlib import Path

from converter.errors import ConverterError
from converter.formats import peft
from converter.formats.base import Adapter, AdapterPatch

FORMATS = [peft]

__all__ = ["Adapter", "AdapterPatch", "load_adapter"]


def load_adapter(path: Path, *, allow_pickle: bool = False) -> Adapter:
    """Detect the format of the adapter at `path` and parse it."""
    path = Path(path)
    if not path.exists():
        raise ConverterError(f"{path}: adapter not found (give a folder with adapter_config.json or a file)")
    for fmt in FORMATS:
        if fmt.detect(path):
            return fmt.parse(path, allow_pickle=allow_pickle)
    raise ConverterError(
        f"{path}: not a recognised adapter; tried {', '.join(f.NAME for f in FORMATS)} "
        "(a PEFT adapter is a folder with adapter_config.json and adapter_model.safetensors)"
    )
