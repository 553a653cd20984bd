"""Typed records <-> plain JSON values, by their dataclasses' type hints: what verification.json is written from
and read back into, so that every part of the report is a dataclass in memory and plain JSON on disk.

Strict JSON has no infinities or NaN: such floats are written as text ("inf", "nan") and read back as floats.
Reading is lenient about age: a key the file lacks takes the field's default, else an empty value of its type
(reports written by older versions had fewer fields), and keys the types do not know are ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing

# field(metadata=OMIT_NONE): left out of the JSON while None (a key that only some reports carry)
OMIT_NONE = {"omit_none": True}


def to_plain(value: object) -> object:
    """A JSON-ready copy of `value`: dataclasses as dicts (field order), tuples as lists, paths as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (f.metadata.get("omit_none") and getattr(value, f.name) is None)
        }
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)


def from_plain(kind: object, data: object) -> object:
    """`data` (JSON values) as `kind`: a dataclass, list[...], dict[str, ...], an optional, or a plain type."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # one type besides None (a choice is the caller's)
        return from_plain(inner, data)
    if dataclasses.is_dataclass(kind):
        hints = _hints(kind)
        values = {}
        for f in dataclasses.fields(kind):
            if f.name in data:
                values[f.name] = from_plain(hints[f.name], data[f.name])
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                values[f.name] = _empty(hints[f.name])
        return kind(**values)
    if origin is list:
        return [from_plain(args[0], v) for v in data] if args else list(data)
    if origin is dict:
        return {k: from_plain(args[1], v) for k, v in data.items()} if args else dict(data)
    if kind is float and data is not None:
        return float(data)  # "inf", "nan", and whole numbers JSON wrote without a point
    return data


def _empty(kind: object) -> object:
    """The value of a field an older report did not have."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind):
        return None
    if origin in (list, dict):
        return origin()
    if dataclasses.is_dataclass(kind):
        return from_plain(kind, {})
    return {str: "", int: 0, float: math.nan, bool: False, list: [], dict: {}}.get(kind)


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)
