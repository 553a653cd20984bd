"""Where weights come from. This issue's sources are local paths; Hub ids arrive through the same type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from converter.errors import ConverterError


@dataclass(frozen=True)
class Source:
    """A parsed source spec. `local` is set for paths on disk."""

    spec: str
    local: Path | None

    def __str__(self) -> str:
        return self.spec


def parse_source(spec: str) -> Source:
    path = Path(spec).expanduser()
    if path.exists():
        return Source(spec, path.resolve())
    if spec.startswith((".", "/", "~")) or path.suffix in (".safetensors", ".bin"):
        raise ConverterError(f"{spec}: no such file or folder")
    raise ConverterError(f"{spec}: not found on disk (Hugging Face Hub ids are not supported yet; download it first)")


def resolve_local(spec: str) -> Path:
    """The local path for a source, fetching it first when it lives elsewhere."""
    source = parse_source(spec)
    assert source.local is not None
    return source.local
