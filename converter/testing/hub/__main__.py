"""``python -m converter.testing.hub``: see ``cli.main``."""

from converter.testing.hub.cli import main

main()
