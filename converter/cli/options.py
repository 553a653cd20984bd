"""A verb's options object from the parsed command line: each option's `dest` is the options field it sets, so
the command line lists no parameter twice (the parser defines them, the options class checks them)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import TypeVar

T = TypeVar("T")


def options_from(cls: type[T], args: argparse.Namespace, **others) -> T:
    """`cls` (a frozen options dataclass) from the parsed arguments named as its fields, and `others` (fields
    whose option says the opposite, such as --no-verify); its own defaults for the fields this command lacks."""
    given = {**vars(args), **others}
    return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})  # type: ignore[call-arg]
