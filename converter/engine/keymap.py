"""Where an adapter's module names land in a checkpoint, driven by the data in `keymaps/*.yaml`.

Lookup is structure-aware: every spelling a keymap allows is tried against the base's real key set, and
more than one hit is an error, never a guess.
"""

from __future__ import annotations

import ast
import itertools
import operator
import re
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from converter.engine.keymap_schema import KeymapError, validate
from converter.errors import BadInputError, CheckpointError, ConverterError


@dataclass(frozen=True)
class Placement:
    """A patch's destination: a checkpoint key, optionally a row slice of it (fused projections)."""

    key: str
    rows: tuple[int, int] | None = None
    # Rows of the adapter's delta that land here: a fused adapter module (BFL qkv) split over separate base
    # tensors (diffusers to_q/to_k/to_v).
    src: tuple[int, int] | None = None
    # Fused MoE experts (E, out, in): `expert` is the index into the base tensor's first dim that `rows` are rows
    # of (a per-expert LoRA on a fused base); `src_expert` the expert of a fused delta whose `src` rows land
    # here (a LoRA on fused experts, a base that stores each expert's weights apart).
    expert: int | None = None
    src_expert: int | None = None

    def __str__(self) -> str:
        where = self.key if self.expert is None else f"{self.key}[{self.expert}]"
        where = where if self.rows is None else f"{where}[{self.rows[0]}:{self.rows[1]}]"
        if self.src is None:
            return where
        return (
            f"{where} <- "
            + ("" if self.src_expert is None else f"expert {self.src_expert} ")
            + (f"rows {self.src[0]}:{self.src[1]}")
        )


@dataclass
class FusedRule:
    module: re.Pattern
    into: str
    parts: dict[str, str]  # part name -> row count expression, in row order


@dataclass
class AliasRule:
    """Another spelling of a base key (diffusers name of an LDM key, q/k/v rows of a fused in_proj ...)."""

    pattern: re.Pattern
    # (key template, (start, size) of the rows of the base key it covers, (start, size) of the adapter delta's
    # rows that land on the whole base key), row expressions or None
    to: list[tuple[str, tuple[str, str] | None, tuple[str, str] | None]]
    when: str | None = None  # an expression over rows/cols/captures/config that must hold (e.g. 'rows != 2 * cols')


@dataclass
class RenameRule:
    """A training checkpoint's name (Megatron-Core) -> transformers key(s); `rows` split a fused tensor."""

    pattern: re.Pattern
    to: list[str]  # key templates, `{group}` filled from the pattern's named groups
    groups: str = "1"  # row blocks (KV groups of an interleaved qkv)
    rows: list[str] | None = None  # rows of each part within a block, in `to` order
    parallel: str = "replicated"  # legacy tensor-parallel shards: "column" (dim 0), "row" (dim 1), "replicated"
    rope: str | None = None  # heads whose rotary pairs are adjacent rows (torchtitan's Llama), not two halves


@dataclass
class ExpertRule:
    """One fused MoE expert tensor (E, out, in) and the per-expert 2-D weights it stacks, as key templates over
    `{layer}` and `{expert}`; `split` lists the weights whose rows it concatenates, in order (gate then up)."""

    fused: str
    split: list[str]

    def patterns(self) -> tuple[re.Pattern, list[re.Pattern]]:
        return _template(self.fused), [_template(t) for t in self.split]


def _template(template: str) -> re.Pattern:
    body = re.escape(template).replace(r"\{layer\}", "(?P<layer>.+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(body)


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
    # Diffusion families: how to recognise a base, where each component lives, and other spellings of its keys.
    pipelines: list[str] = field(default_factory=list)
    detect: list[re.Pattern] = field(default_factory=list)
    components: dict[str, list[str]] = field(default_factory=dict)  # component -> key prefixes in a single file
    component_aliases: dict[str, list[str]] = field(default_factory=dict)  # adapter's component -> base's
    aliases: dict[str, list[AliasRule]] = field(default_factory=dict)  # per component
    tables: dict[str, dict[str, str]] = field(default_factory=dict)
    renames: list[RenameRule] = field(default_factory=list)  # training checkpoint names (converter.training)
    # Other spellings of a module path: (regex, replacement); transformers 5 calls Mixtral's `block_sparse_moe` `mlp`.
    spellings: list[tuple[re.Pattern, str]] = field(default_factory=list)
    experts: list[ExpertRule] = field(default_factory=list)  # fused MoE expert tensors <-> per-expert weights
    # transformers class -> the key prefix its checkpoints may spell and the model it loads lacks (a CLIPTextModel
    # saved by transformers 4: text_model.); an adapter for the loaded model names its modules without it
    loaded_without: dict[str, str] = field(default_factory=dict)
    # Diffusion families, the adapter side: a display name, diffusers' classes, how adapter module names look in
    # each naming (original checkpoint / diffusers), shape rules that tell apart families with the same names,
    # which tools load which spelling as it is (a LoRA; a LoKr), the spelling each convert target writes, and (for
    # a family diffusers lists that is not reached here) why not.
    title: str = ""
    diffusers: dict = field(default_factory=dict)
    names: dict[str, list[re.Pattern]] = field(default_factory=dict)
    shapes: list[tuple[re.Pattern, str]] = field(default_factory=list)
    loaders: dict[str, list[str]] = field(default_factory=dict)
    lokr_loaders: dict[str, list[str]] = field(default_factory=dict)  # the same for LyCORIS LoKr files
    targets: dict[str, str] = field(default_factory=dict)
    unreached: str | None = None

    @classmethod
    def from_yaml(cls, data: dict) -> Keymap:
        aliases: dict[str, list[AliasRule]] = {}
        for component, rules in (data.get("aliases") or {}).items():
            for rule in rules:
                targets = rule["to"] if isinstance(rule["to"], list) else [rule["to"]]
                to = [
                    (t, None, None)
                    if isinstance(t, str)
                    else (
                        t["key"],
                        (str(t["rows"][0]), str(t["rows"][1])) if "rows" in t else None,
                        (str(t["src"][0]), str(t["src"][1])) if "src" in t else None,
                    )
                    for t in targets
                ]
                aliases.setdefault(component, []).append(AliasRule(re.compile(rule["from"]), to, rule.get("when")))
        return cls(
            name=data["name"],
            model_types=data.get("model_types", []),
            prefixes=[tuple(p) for p in data.get("prefixes", [])],
            tied=data.get("tied", {}),
            stored_transposed=[re.compile(p) for p in data.get("stored_transposed", [])],
            fused=[
                FusedRule(re.compile(f["module"]), f["into"], {k: str(v) for k, v in f["parts"].items()})
                for f in data.get("fused", [])
            ],
            defaults={k: str(v) for k, v in (data.get("defaults") or {}).items()},
            unquantized=[re.compile(p) for p in data.get("unquantized", [])],
            pipelines=data.get("pipelines", []),
            detect=[re.compile(p) for p in data.get("detect", [])],
            components={k: list(v) for k, v in (data.get("components") or {}).items()},
            component_aliases=data.get("component_aliases") or {},
            aliases=aliases,
            tables=data.get("tables") or {},
            renames=[
                RenameRule(
                    re.compile(r["from"]),
                    r["to"] if isinstance(r["to"], list) else [r["to"]],
                    str(r.get("split", {}).get("groups", 1)),
                    [str(x) for x in r["split"]["rows"]] if "split" in r else None,
                    r.get("parallel", "replicated"),
                    str(r["rope"]) if "rope" in r else None,
                )
                for r in data.get("renames", [])
            ],
            spellings=[(re.compile(a), b) for a, b in data.get("spellings", [])],
            experts=[ExpertRule(e["fused"], list(e["split"])) for e in data.get("experts", [])],
            loaded_without=dict(data.get("loaded_without") or {}),
            title=data.get("title") or data["name"],
            diffusers=data.get("diffusers") or {},
            names={k: [re.compile(p) for p in v] for k, v in (data.get("names") or {}).items()},
            shapes=[(re.compile(r["module"]), r["when"]) for r in data.get("shapes", [])],
            loaders={k: list(v) for k, v in (data.get("loaders") or {}).items()},
            lokr_loaders={k: list(v) for k, v in (data.get("lokr_loaders") or {}).items()},
            targets=dict(data.get("targets") or {}),
            unreached=data.get("unreached"),
        )

    @property
    def is_diffusion(self) -> bool:
        return bool(self.pipelines or self.detect or self.unreached)

    def target(self, to: str) -> tuple[str | None, str | None]:
        """(prefix kind, naming) a `convert --to` target writes for this family (both None: not said)."""
        kind, _, naming = self.targets.get(to, "").partition("/")
        return kind or None, naming or None

    @property
    def one_naming(self) -> bool:
        """Whether the original checkpoint and diffusers name this family's modules alike (no aliases between)."""
        return not any(self.aliases.get(c) for c in ("transformer", "unet"))

    def keeps_precision(self, key: str) -> bool:
        """Whether a 4-bit output stores `key` unquantized, as transformers' load_in_4bit leaves it."""
        return key in self.tied or key in self.tied.values() or any(p.fullmatch(key) for p in self.unquantized)

    def is_stored_transposed(self, key: str) -> bool | None:
        """True/False where this keymap knows the layout; None where it says nothing about layouts."""
        if not self.stored_transposed:
            return None
        return any(p.fullmatch(key) for p in self.stored_transposed)


def keymap_folder() -> Traversable:
    """The shipped keymaps: `converter/keymaps` in an installed wheel or a deployed Space (pyproject maps the
    repository's top-level `keymaps/` there), the top-level `keymaps/` itself in a source checkout."""
    packaged = resources.files("converter") / "keymaps"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / "keymaps"
    if not checkout.is_dir():
        raise ConverterError(f"no keymaps found (neither {packaged} nor {checkout}); reinstall converter")
    return checkout


# libyaml's safe loader when pyyaml has it: the same data, parsed faster than by the pure-Python one
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_keymap(name: str, raw: str) -> Keymap:
    """Parse and validate one keymap file's text; every mistake is a ConverterError naming the file and key."""
    try:
        data = yaml.load(raw, Loader=_LOADER)  # a safe loader (see _LOADER)
    except yaml.YAMLError as e:
        raise KeymapError(f"keymap {name}: not valid YAML ({str(e).splitlines()[0]})", file=name) from None
    try:
        validate(data)
    except KeymapError as e:
        raise KeymapError(f"keymap {name}: {e}", file=name) from None
    stem = name.rsplit("/", 1)[-1].removesuffix(".yaml")
    if data["name"] != stem:
        raise KeymapError(
            f"keymap {name}: name {data['name']!r} differs from the file name (call it {stem!r})", file=name
        )
    return Keymap.from_yaml(data)


@cache
def all_keymaps() -> tuple[Keymap, ...]:
    files = sorted((f for f in keymap_folder().iterdir() if f.name.endswith(".yaml")), key=lambda p: p.name)
    return tuple(load_keymap(f"keymaps/{f.name}", f.read_text()) for f in files)


def loaded_name(classes: list[str] | None, name: str) -> str:
    """A module's path in the model transformers builds as one of `classes`, given its checkpoint key's path: the
    keymaps' `loaded_without` prefix dropped where it applies."""
    for cls in classes or ():
        for km in all_keymaps():
            prefix = km.loaded_without.get(cls)
            if prefix and name.startswith(prefix):
                return name[len(prefix) :]
    return name


def keymap_for(config: dict) -> Keymap:
    """The keymap whose model_types names this config's model_type (or the diffusion family a diffusion base
    was recognised as); the generic one otherwise."""
    by_name = {k.name: k for k in all_keymaps()}
    if config.get("_keymap") in by_name:
        return by_name[config["_keymap"]]
    model_type = config.get("model_type")
    for km in all_keymaps():
        if model_type in km.model_types:
            return km
    return by_name["generic"]


def diffusion_family(pipeline: str | None, keys: list[str], denoiser: str | None = None) -> Keymap | None:
    """The diffusion keymap for a diffusers pipeline class name (else its denoiser's class, from model_index.json),
    or for a single file's keys (its `detect` patterns, first family whose every pattern matches some key)."""
    for km in all_keymaps():
        if pipeline and pipeline in km.pipelines:
            return km
    for km in all_keymaps():
        if denoiser and denoiser in km.diffusers.get("transformer", ()):
            return km
    if pipeline or denoiser:
        return None
    for km in all_keymaps():
        if km.detect and all(any(p.match(k) for k in keys) for p in km.detect):
            return km
    return None


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne}


def eval_expr(expr: str, config: dict, defaults: dict[str, str]) -> int:
    """Evaluate a keymap size expression like 'num_key_value_heads * head_dim' over config values."""

    def value(name: str) -> int:
        if config.get(name) is not None:
            return int(config[name])
        if name in defaults:
            return eval_expr(defaults[name], config, {})
        raise CheckpointError(f"config.json has no {name!r}, needed to locate fused projections", file="config.json")

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return value(node.id)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
            return int(_COMPARE[type(node.ops[0])](walk(node.left), walk(node.comparators[0])))
        raise ValueError(f"unsupported keymap expression: {expr}")

    return walk(ast.parse(expr, mode="eval"))


# transformers' task classes that have no language-model head to tie to the embedding (by its naming convention)
HEADLESS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice")


class Resolver:
    """Maps native (module, param) names onto checkpoint keys of one base model."""

    def __init__(self, keymap: Keymap, config: dict, keys: set[str], shapes: dict[str, tuple[int, ...]] | None = None):
        """`shapes` (key -> shape) is needed only to place LoRAs across the two layouts of MoE experts."""
        self.keymap = keymap
        self.config = config
        self.keys = keys
        self.experts = expert_table(keymap.experts, shapes) if keymap.experts and shapes else {}
        # Heads that are absent because they share the embedding's storage.
        self.tied_heads = {
            head: emb for head, emb in keymap.tied.items() if head not in keys and emb in keys and self._ties()
        }

    def _ties(self) -> bool:
        if any(a.endswith(HEADLESS) for a in self.config.get("architectures") or []):
            return False  # a task model without the language-model head (its own head is a plain tensor)
        cfg = self.config.get("text_config") if "tie_word_embeddings" not in self.config else self.config
        return bool((cfg or {}).get("tie_word_embeddings", True))

    def _spellings(self, module: str) -> list[str]:
        out = [module]
        for strip, add in self.keymap.prefixes:
            if module.startswith(strip):
                out.append(add + module[len(strip) :])
        for pattern, replacement in self.keymap.spellings:
            out += [m.expand(replacement) for s in list(out) if (m := pattern.fullmatch(s))]
        return list(dict.fromkeys(out))

    def resolve_all(self, module: str, param: str, component: str | None = None, flat: bool = False) -> list[Placement]:
        """`resolve`, or for the other layout of MoE experts every placement of the patch: a per-expert LoRA on
        a slice of a fused tensor, or a LoRA on a fused tensor split over every expert's weights."""
        place = self.resolve(module, param, component, flat)
        if place is not None or flat or not self.experts:
            return [] if place is None else [place]
        hits = [self.experts[k] for s in self._spellings(module) if (k := f"{s}.{param}") in self.experts]
        hits = [h for i, h in enumerate(hits) if h not in hits[:i]]
        if len(hits) > 1:
            raise BadInputError(
                f"adapter module {module!r} matches several expert tensors ({hits[0][0].key}, {hits[1][0].key})",
                tensor=module,
            )
        return hits[0] if hits else []

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

    def resolve(self, module: str, param: str, component: str | None = None, flat: bool = False) -> Placement | None:
        if flat:  # a kohya-style flattened name: look it up among the base's keys flattened the same way
            if not hasattr(self, "_flat"):
                self._flat: dict[str, set[str]] = {}
                for key in self.keys:
                    self._flat.setdefault(flatten(key), set()).add(key)
            found = set()
            spellings = [module] + [
                flatten(add) + module[len(flatten(strip)) :]
                for strip, add in self.keymap.prefixes
                if module.startswith(flatten(strip))
            ]
            for spelling in spellings:
                found |= self._flat.get(flatten(f"{spelling}.{param}"), set())
            if len(found) > 1:
                raise BadInputError(
                    f"adapter module {module!r} matches several base tensors ({sorted(found)})", tensor=module
                )
            return Placement(found.pop()) if found else None
        hits: list[Placement] = []
        for spelling in self._spellings(module):
            key = f"{spelling}.{param}"
            if key in self.keys or key in self.tied_heads:
                hits.append(Placement(key))
            elif (fused := self._fused(spelling, param)) is not None:
                hits.append(fused)
        hits = list(dict.fromkeys(hits))
        if len(hits) > 1:
            raise BadInputError(
                f"adapter module {module!r} matches several base tensors ({', '.join(map(str, hits))}); "
                "restrict the adapter with include/exclude patterns in a recipe",
                tensor=module,
            )
        return hits[0] if hits else None


def expert_table(rules: list[ExpertRule], shapes: dict[str, tuple[int, ...]]) -> dict[str, list[Placement]]:
    """Names of the layout the base does not have -> where they land in the one it has. A fused base (E, out, in)
    answers each per-expert name with its expert's row block; a per-expert base answers the fused name with every
    expert's weights, each taking its rows of the fused delta. Sizes come from the base's own shapes."""
    table: dict[str, list[Placement]] = {}
    for rule in rules:
        fused, split = rule.patterns()
        parts: dict[str, dict[int, dict[int, str]]] = {}  # layer -> expert -> part -> key
        for key, shape in shapes.items():
            if (m := fused.fullmatch(key)) and len(shape) == 3 and shape[1] % len(split) == 0:
                size = shape[1] // len(split)
                for e in range(shape[0]):
                    for k, template in enumerate(rule.split):
                        name = template.format(layer=m.group("layer"), expert=e)
                        rows = None if len(split) == 1 else (k * size, (k + 1) * size)
                        table[name] = [Placement(key, rows, expert=e)]
                continue
            for k, pattern in enumerate(split):
                if (m := pattern.fullmatch(key)) and len(shape) == 2:
                    parts.setdefault(m.group("layer"), {}).setdefault(int(m.group("expert")), {})[k] = key
        for layer, experts in parts.items():
            if sorted(experts) != list(range(len(experts))) or any(len(p) != len(split) for p in experts.values()):
                continue  # not a complete set of experts: nothing is placed there, so the plan reports it unmatched
            places = []
            for e in sorted(experts):
                start = 0
                for k in range(len(split)):
                    rows = shapes[experts[e][k]][0]
                    places.append(Placement(experts[e][k], src=(start, start + rows), src_expert=e))
                    start += rows
            table[rule.fused.format(layer=layer)] = places
    return table


def flatten(name: str) -> str:
    """kohya's flattening: every '.' becomes '_' (sd-scripts lora.py create_modules; docs/FORMATS.md §1)."""
    return name.replace(".", "_")


_FIELD = re.compile(r"\{([^{}]+)\}")


def _render(template: str, groups: dict[str, str], env: dict, keymap: Keymap) -> str | None:
    """Fill `{name}` (a capture), `{name@table}` (a capture looked up in a keymap table) and `{expr}` (arithmetic
    over integer captures and config values). None when a table has no entry: the rule does not apply."""
    missing = False

    def field(m: re.Match) -> str:
        nonlocal missing
        body = m.group(1)
        if "@" in body:
            name, table = body.split("@", 1)
            value = keymap.tables.get(table, {}).get(groups.get(name, ""))
            if value is None:
                missing = True
                return ""
            return value
        if body in groups and not body.isdigit():
            return groups[body]
        ints = {k: int(v) for k, v in groups.items() if v is not None and v.isdigit()}
        return str(eval_expr(body, {**env, **ints}, keymap.defaults))

    out = _FIELD.sub(field, template)
    return None if missing else out


class DiffusionResolver:
    """Maps adapter modules (component + dotted or kohya-flattened name) onto the keys of a diffusion base.

    For every base key the keymap's alias rules add other spellings (diffusers names of LDM keys, LDM names of
    diffusers keys, q/k/v row slices of fused projections). Flattened names are looked up by flattening every
    spelling the same way kohya does; two different tensors under one flattened name is an error, never a guess.
    """

    def __init__(self, keymap: Keymap, parts: dict[str, tuple[str, dict]], keys: dict[str, tuple[int, ...]]):
        """`parts`: component -> (key prefix in the checkpoint, its config); `keys`: key -> shape."""
        self.keymap = keymap
        self.keys = keys
        self.tied_heads: dict[str, str] = {}
        self.dotted: dict[str, dict[str, set[Placement]]] = {}
        self.flat: dict[str, dict[str, set[Placement]]] = {}
        for component, (prefix, config) in parts.items():
            dotted = self.dotted.setdefault(component, {})
            for key, shape in keys.items():
                if not key.startswith(prefix):
                    continue
                local = key[len(prefix) :]
                dotted.setdefault(local, set()).add(Placement(key))
                env = {**config, "rows": shape[0] if shape else 0, "cols": shape[1] if len(shape) > 1 else 0}
                for rule in keymap.aliases.get(component, []):
                    m = rule.pattern.fullmatch(local)
                    if not m:
                        continue
                    groups = {k: v for k, v in m.groupdict().items() if v is not None}
                    if rule.when and not self._span((rule.when, "0"), groups, env)[0]:
                        continue
                    for template, rows, src in rule.to:
                        alias = _render(template, groups, env, keymap)
                        if alias is None:
                            continue
                        span, source = (self._span(e, groups, env) if e else None for e in (rows, src))
                        dotted.setdefault(alias, set()).add(Placement(key, span, source))
            flat = self.flat.setdefault(component, {})
            for name, places in dotted.items():
                flat.setdefault(flatten(name), set()).update(places)

    def _span(self, exprs: tuple[str, str], groups: dict[str, str], env: dict) -> tuple[int, int]:
        values = {**env, **{k: int(v) for k, v in groups.items() if v.isdigit()}}
        start, size = (
            eval_expr(_render(e, groups, env, self.keymap) or "0", values, self.keymap.defaults) for e in exprs
        )
        return start, start + size

    def components_for(self, component: str | None) -> list[str]:
        if component is None:
            return list(self.dotted)
        default = ["unet", "transformer"] if component == "denoiser" else [component]
        names = self.keymap.component_aliases.get(component, default)
        return [c for c in names if c in self.dotted]

    def resolve_all(self, module: str, param: str, component: str | None = None, flat: bool = False) -> list[Placement]:
        """Where the module lands: one placement, or a fused module split into row ranges over several base
        tensors (every placement then says which rows of the delta it takes, and together they tile it)."""
        hits: set[Placement] = set()
        for comp in self.components_for(component):
            table = self.flat[comp] if flat else self.dotted[comp]
            hits |= table.get(flatten(f"{module}.{param}") if flat else f"{module}.{param}", set())
        ordered = sorted(hits, key=lambda p: (p.src or (0, 0), p.key))
        split = len(hits) > 1 and all(p.src is not None for p in hits)
        if split and all(a.src[1] == b.src[0] for a, b in itertools.pairwise(ordered)) and ordered[0].src[0] == 0:
            return ordered
        if len(hits) > 1:
            raise BadInputError(
                f"adapter module {module!r} matches several base tensors "
                f"({', '.join(sorted(map(str, hits)))}); restrict the adapter with include/exclude patterns",
                tensor=module,
            )
        return ordered

    def resolve(self, module: str, param: str, component: str | None = None, flat: bool = False) -> Placement | None:
        hits = self.resolve_all(module, param, component, flat)
        if len(hits) > 1:
            raise BadInputError(f"adapter module {module!r} is split over {len(hits)} base tensors here", tensor=module)
        return hits[0] if hits else None
