"""The family table in docs/diffusion.md is generated from the keymaps (scripts/family_table.py): a keymap edited
without rerunning the script fails here, so the docs cannot drift from what the code uses."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("family_table", ROOT / "scripts" / "family_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_family_table_is_the_generated_one():
    script = _script()
    page = (ROOT / "docs" / "diffusion.md").read_text()
    assert script.render(page) == page, "the family table is stale: run python scripts/family_table.py"


def test_the_table_names_every_diffusion_keymap_and_what_diffusers_reads():
    from converter.engine.keymap import all_keymaps

    table = _script().table()
    for km in all_keymaps():
        if km.is_diffusion:
            assert f"(`{km.name}`)" in table
    row = next(line for line in table.splitlines() if "(`flux2`)" in line)
    assert "`kohya/original`" in row and "Flux2LoraLoaderMixin" in row


def test_a_changed_keymap_shows_in_the_table(monkeypatch):
    """The table is read from the keymaps, not written by hand: change a keymap and the row changes."""
    import converter.engine.keymap as keymap

    script = _script()
    before = script.table()
    flux2 = next(k for k in keymap.all_keymaps() if k.name == "flux2")
    monkeypatch.setattr(flux2, "loaders", {"diffusers": ["bare/original"]})
    assert script.table() != before and "`bare/original`" in script.table()
