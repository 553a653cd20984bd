"""The records converter writes next to a merged model, and how to read them back.

merge writes them, verify and the card read them: keeping their names and readers here lets those three
modules depend on this one instead of on each other. (The recorded recipe is read by converter.engine.recipe.)
"""

from __future__ import annotations

import json
from pathlib import Path

from converter.errors import BadInputError

RECIPE_FILE = "converter_recipe.yaml"  # the recipe, sources pinned to the commits used
PROVENANCE_FILE = "converter_provenance.json"  # what was merged, exactly: files, hashes, settings, tensors changed
REPORT_FILE = "verification.json"  # the verification report


def read_provenance(folder: str | Path) -> dict:
    """The folder's provenance record; a clear error when the folder was not written by converter merge."""
    path = Path(folder) / PROVENANCE_FILE
    if not path.is_file():
        raise BadInputError(f"{folder}: no {PROVENANCE_FILE}; it was not written by converter merge", file=folder)
    return json.loads(path.read_text())


def read_report(folder: str | Path) -> dict | None:
    """The folder's verification report, or None when it was not verified."""
    path = Path(folder) / REPORT_FILE
    return json.loads(path.read_text()) if path.is_file() else None
