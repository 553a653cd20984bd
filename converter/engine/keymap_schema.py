"""The schema every keymap YAML file must follow, checked at load: a misspelt or misplaced key is an error.

Written out by hand rather than with pydantic: the merge path loads keymaps, and pydantic's import alone
costs several times what yaml does. Each check raises `KeymapError` with the path of the bad value
(`fused[0].parts`), and the loader prefixes the file name.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from types import UnionType

from converter.errors import KeymapError

Check = Callable[[object, str], None]


def _fail(where: str, why: str) -> KeymapError:
    return KeymapError(f"{where}: {why}" if where else why)


def _kind(value: object) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "true/false", type(None): "empty"}.get(
        type(value), type(value).__name__
    )


def text(value: object, where: str) -> None:
    if not isinstance(value, str):
        raise _fail(where, f"expected a string, got {_kind(value)} ({value!r})")


def expr(value: object, where: str) -> None:
    """A size expression over config values ('num_key_value_heads * head_dim') or a plain integer."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _fail(where, f"expected an expression (a string or an integer), got {_kind(value)} ({value!r})")


def regex(value: object, where: str) -> None:
    text(value, where)
    try:
        re.compile(value)  # type: ignore[arg-type]
    except re.error as e:
        raise _fail(where, f"not a valid regular expression ({e})") from None


def list_of(item: Check) -> Check:
    def check(value: object, where: str) -> None:
        if not isinstance(value, list):
            raise _fail(where, f"expected a list, got {_kind(value)} ({value!r})")
        for i, v in enumerate(value):
            item(v, f"{where}[{i}]")

    return check


def pair(item: Check) -> Check:
    def check(value: object, where: str) -> None:
        if not isinstance(value, list) or len(value) != 2:
            raise _fail(where, f"expected a list of two values, got {value!r}")
        for i, v in enumerate(value):
            item(v, f"{where}[{i}]")

    return check


def map_of(item: Check) -> Check:
    """A mapping with free-form string keys (component names, module names) and checked values."""

    def check(value: object, where: str) -> None:
        if not isinstance(value, dict):
            raise _fail(where, f"expected a mapping, got {_kind(value)} ({value!r})")
        for k, v in value.items():
            text(k, f"{where} key")
            item(v, f"{where}.{k}")

    return check


def record(fields: dict[str, Check], required: tuple[str, ...] = ()) -> Check:
    """A mapping with a fixed set of keys: unknown keys and missing required ones are errors."""

    def check(value: object, where: str) -> None:
        if not isinstance(value, dict):
            raise _fail(where, f"expected a mapping, got {_kind(value)} ({value!r})")
        for k, v in value.items():
            at = f"{where}.{k}" if where else str(k)
            if k not in fields:
                close = difflib.get_close_matches(str(k), fields, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise _fail(at, f"unknown key ({hint}allowed: {', '.join(fields)})")
            fields[k](v, at)
        for k in required:
            if k not in value:
                raise _fail(where, f"missing required key {k!r}")

    return check


def one_of(*checks: tuple[Check, type | UnionType], what: str) -> Check:
    """The first check whose type matches decides (a string, or a mapping, or a list of them)."""

    def check(value: object, where: str) -> None:
        for c, kind in checks:
            if isinstance(value, kind):
                return c(value, where)
        raise _fail(where, f"expected {what}, got {_kind(value)} ({value!r})")

    return check


_TARGET = record({"key": text, "rows": pair(expr), "src": pair(expr)}, required=("key",))
_ONE_TARGET = one_of((text, str), (_TARGET, dict), what="a key template or {key, rows, src}")
_ALIAS = record(
    {"from": regex, "to": one_of((_ONE_TARGET, str | dict), (list_of(_ONE_TARGET), list), what="a target or a list"),
     "when": text},
    required=("from", "to"),
)  # fmt: skip


def choice(*allowed: str) -> Check:
    def check(value: object, where: str) -> None:
        if value not in allowed:
            raise _fail(where, f"expected one of {', '.join(allowed)}, got {value!r}")

    return check


# Training-checkpoint names -> transformers names (Megatron-Core): one source tensor to one or several keys; a
# `split` cuts its rows into `groups` blocks of `rows` each, part i of every block going to `to[i]`. `parallel`
# says how tensor-parallel ranks of the legacy layout hold it: column (dim 0), row (dim 1), replicated. `rope`: the
# rows hold that many heads whose rotary pairs are adjacent (torchtitan's Llama), reordered to transformers' halves.
_SPLIT = record({"groups": expr, "rows": list_of(expr)}, required=("rows",))
_RENAME = record(
    {"from": regex, "to": one_of((text, str), (list_of(text), list), what="a key template or a list"),
     "split": _SPLIT, "parallel": choice("column", "row", "replicated"), "rope": expr},
    required=("from", "to"),
)  # fmt: skip
_FUSED = record({"module": regex, "into": text, "parts": map_of(expr)}, required=("module", "into", "parts"))


def spelling(value: object, where: str) -> None:
    """[regex, replacement]: another spelling of the module paths the regex matches (`\\1` etc. refer back)."""
    if not isinstance(value, list) or len(value) != 2:
        raise _fail(where, f"expected [regex, replacement], got {value!r}")
    regex(value[0], f"{where}[0]")
    text(value[1], f"{where}[1]")


def template(*fields: str) -> Check:
    """A key template that must name each of `fields` ({layer}, {expert}) and nothing else in braces."""

    def check(value: object, where: str) -> None:
        text(value, where)
        named = set(re.findall(r"\{([^{}]*)\}", value))  # type: ignore[arg-type]
        if named != set(fields):
            raise _fail(where, f"expected a template naming {', '.join('{' + f + '}' for f in fields)}, got {value!r}")

    return check


# Fused MoE experts: `fused` (E, out, in) stacks, per expert, the rows of the weights `split` names, in order.
_EXPERTS = record(
    {"fused": template("layer"), "split": list_of(template("layer", "expert"))}, required=("fused", "split")
)

# Diffusion families' adapter side. How a file spells the denoiser's module names: a prefix kind, and for a family
# whose original checkpoint and diffusers name modules differently, which of the two names it uses
# ("kohya/original", "comfyui/diffusers"; docs/FORMATS.md §12).
PREFIX_KINDS = ("kohya", "onetrainer", "lycoris", "comfyui", "diffusers", "peft", "bare")
NAMINGS = ("original", "diffusers")
TOOLS = ("diffusers", "comfyui", "kohya")


def spelling_id(value: object, where: str) -> None:
    text(value, where)
    kind, _, naming = str(value).partition("/")
    if kind not in PREFIX_KINDS or (naming and naming not in NAMINGS):
        raise _fail(where, f"expected a spelling like 'kohya' or 'comfyui/original' (prefix kinds: "
                    f"{', '.join(PREFIX_KINDS)}; namings: {', '.join(NAMINGS)}), got {value!r}")  # fmt: skip


def keys_of(*allowed: str, item: Check) -> Check:
    """A mapping whose keys come from a fixed set (tools, namings) and whose values `item` checks."""

    def check(value: object, where: str) -> None:
        map_of(item)(value, where)
        for k in value:  # type: ignore[union-attr]
            if k not in allowed:
                raise _fail(f"{where}.{k}", f"unknown key (allowed: {', '.join(allowed)})")

    return check


_SHAPE_RULE = record({"module": regex, "when": text}, required=("module", "when"))
# `also`: other families' loader mixins that read this family's files through its converters (SkyReels-V2's, Wan's);
# `text_encoder`, `text_encoder_2`: the classes diffusers loads a single file's text encoders as
_DIFFUSERS = record(
    {"loader": text, "also": list_of(text), "transformer": list_of(text), "single_file": text,
     "text_encoder": list_of(text), "text_encoder_2": list_of(text)}, required=("loader",)
)  # fmt: skip

KEYMAP = record(
    {
        "name": text,
        "title": text,
        "diffusers": _DIFFUSERS,
        "names": keys_of(*NAMINGS, item=list_of(regex)),
        "shapes": list_of(_SHAPE_RULE),
        "loaders": keys_of(*TOOLS, item=list_of(spelling_id)),
        "lokr_loaders": keys_of(*TOOLS, item=list_of(spelling_id)),
        "targets": keys_of("kohya", "comfyui", "diffusers", "peft", item=spelling_id),
        "unreached": text,
        "model_types": list_of(text),
        "prefixes": list_of(pair(text)),
        "tied": map_of(text),
        "stored_transposed": list_of(regex),
        "fused": list_of(_FUSED),
        "defaults": map_of(expr),
        "unquantized": list_of(regex),
        "pipelines": list_of(text),
        "detect": list_of(regex),
        "components": map_of(list_of(text)),
        "component_aliases": map_of(list_of(text)),
        "aliases": map_of(list_of(_ALIAS)),
        "tables": map_of(map_of(text)),
        "renames": list_of(_RENAME),
        "spellings": list_of(spelling),
        "experts": list_of(_EXPERTS),
        "loaded_without": map_of(text),
    },
    required=("name", "model_types"),
)


def validate(data: object) -> None:
    """Raise KeymapError naming the first value that does not follow the schema."""
    KEYMAP(data, "")
