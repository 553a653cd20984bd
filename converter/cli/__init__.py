"""The `converter` command: argument parsing and output, no business logic (`python -m converter` runs `main`).

`commands` (the parser and the dispatch of every command), one module per command group with options of its own
(`convert`, `methods` for extract / resize / combine, `gguf`, `batch`), `quiet` (only converter's own lines
reach the terminal). Building the parser imports no heavy library: each command imports what it runs.
"""

from converter.cli.commands import main

__all__ = ["main"]
