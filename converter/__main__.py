"""`python -m converter` behaves exactly like the `converter` command."""

import sys

from converter.cli import main

sys.exit(main())
