"""Where an adapter's module names land in a checkpoint, driven by the data in `keymaps/*.yaml`.

Lookup is structure-aware: every spelling a keymap allows is tried against the base's real key set, and
more than one hit is an error, never a guess.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

import yaml

from converter.errors import ConverterError


@dataclass(frozen=True)
class Placement:
    """A patch's destination: a checkpoint key, optionally a row slice of it (fused projections)."""

    key: str
    rows: tuple[int, int] | None = None

    def __str__(self) -> str:
        return self.key if self.rows is None else f"{self.key}[{self.rows[0]}:{self.rows[1]}]"


@dataclass
class FusedRule:
    module: re.Pattern
    into: str
    parts: dict[str, str]  # part name -> row count expression, in row order


@dataclass
class Keymap:
    name: str
    model_types: list[str]
    prefixes: list[tuple[str, str]] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    stored_transposed: list[re.Pattern] = field(default_factory=list)
    fused: list[FusedRule] = field(default_factory=list)
    defaults: dict[str, str] = field(default_factory=dict)
    # 2-D weights that are not linear layers (embeddings, heads): kept in full precision in 4-bit outputs.
    unquantized: list[re.Pattern] = field(default_factory=list)

    @classmethod
    def from_yaml(cls, data: dict) -> Keymap:
        return cls(
            name=data["name"],
            model_types=data.get("model_types", []),
            prefixes=[tuple(p) for p in data.get("prefixes", [])],
            tied=data.get("tied", {}),
            stored_transposed=[re.compile(p) for p in data.get("stored_transposed", [])],
            fused=[FusedRule(re.compile(f["module"]), f["into"], f["parts"]) for f in data.get("fused", [])],
            defaults=data.get("defaults", {}),
            unquantized=[re.compile(p) for p in data.get("unquantized", [])],
        )

    def keeps_precision(self, key: str) -> bool:
        """Whether a 4-bit output stores `key` unquantized, as transformers' load_in_4bit leaves it."""
        return key in self.tied or key in self.tied.values() or any(p.fullmatch(key) for p in self.unquantized)

    def is_stored_transposed(self, key: str) -> bool | None:
        """True/False where this keymap knows the layout; None where it says nothing about layouts."""
        if not self.stored_transposed:
            return None
        return any(p.fullmatch(key) for p in self.stored_transposed)


@cache
def all_keymaps() -> tuple[Keymap, ...]:
    folder = resources.files("converter") / "keymaps"
    return tuple(
        Keymap.from_yaml(yaml.safe_load(f.read_text()))
        for f in sorted(folder.iterdir(), key=lambda p: p.name)
        if f.name.endswith(".yaml")
    )


def keymap_for(config: dict) -> Keymap:
    """The keymap whose model_types names this config's model_type; the generic one otherwise."""
    model_type = config.get("model_type")
    by_name = {k.name: k for k in all_keymaps()}
    for km in all_keymaps():
        if model_type in km.model_types:
            return km
    return by_name["generic"]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def eval_expr(expr: str, config: dict, defaults: dict[str, str]) -> int:
    """Evaluate a keymap size expression like 'num_key_value_heads * head_dim' over config values."""

    def value(name: str) -> int:
        if config.get(name) is not None:
            return int(config[name])
        if name in defaults:
            return eval_expr(defaults[name], config, {})
        raise ConverterError(f"config.json has no {name!r}, needed to locate fused projections")

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return value(node.id)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"unsupported keymap expression: {expr}")

    return walk(ast.parse(expr, mode="eval"))


class Resolver:
    """Maps native (module, param) names onto checkpoint keys of one base model."""

    def __init__(self, keymap: Keymap, config: dict, keys: set[str]):
        self.keymap = keymap
        self.config = config
        self.keys = keys
        # Heads that are absent because they share the embedding's storage.
        self.tied_heads = {
            head: emb for head, emb in keymap.tied.items() if head not in keys and emb in keys and self._ties()
        }

    def _ties(self) -> bool:
        cfg = self.config.get("text_config") if "tie_word_embeddings" not in self.config else self.config
        return bool((cfg or {}).get("tie_word_embeddings", True))

    def _spellings(self, module: str) -> list[str]:
        out = [module]
        for strip, add in self.keymap.prefixes:
            if module.startswith(strip):
                out.append(add + module[len(strip) :])
        return list(dict.fromkeys(out))

    def _fused(self, module: str, param: str) -> Placement | None:
        for rule in self.keymap.fused:
            m = rule.module.fullmatch(module)
            if not m:
                continue
            key = f"{rule.into.format(**m.groupdict())}.{param}"
            if key not in self.keys:
                continue
            start = 0
            for part, expr in rule.parts.items():
                size = eval_expr(expr, self.config, self.keymap.defaults)
                if part == m.group("part"):
                    return Placement(key, (start, start + size))
                start += size
        return None

    def resolve(self, module: str, param: str) -> Placement | None:
        hits: list[Placement] = []
        for spelling in self._spellings(module):
            key = f"{spelling}.{param}"
            if key in self.keys or key in self.tied_heads:
                hits.append(Placement(key))
            elif (fused := self._fused(spelling, param)) is not None:
                hits.append(fused)
        hits = list(dict.fromkeys(hits))
        if len(hits) > 1:
            raise ConverterError(
                f"adapter module {module!r} matches several base tensors ({', '.join(map(str, hits))}); "
                "restrict the adapter with include/exclude patterns in a recipe"
            )
        return hits[0] if hits else None
