"""`MergePlan`: every output tensor with the patches it gets, coverage, config changes. Touches no weight bytes.

Everything that can be wrong with the inputs is found here, before any output exists: unmatched adapter
tensors, shape mismatches, ambiguous names, inconsistent vocab sizes.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from converter.engine.bnb4 import Quant4, parse_output, quantized_names
from converter.engine.checkpoint import Checkpoint
from converter.engine.keymap import Keymap, Placement, Resolver, keymap_for
from converter.engine.model_class import Converted, LoadedNames
from converter.engine.recipe import AdapterSpec, Recipe
from converter.engine.task_head import TaskHead, plan_head
from converter.engine.writer import OutSpec
from converter.errors import BadInputError, UsageError
from converter.formats import Adapter
from converter.formats.adapter import AdapterPatch
from converter.formats.patches import DeltaPatch, DoRA, LowRank, Replace, Requantize, RowReplace, rows_of
from converter.hub.sources import same_hub_model
from converter.io.dtypes import FLOATING, parse_user_dtype
from converter.io.safetensors_file import TensorInfo
from converter.io.units import human_bytes

ROLE_ORDER = {Replace: 0, RowReplace: 2}  # whole-tensor replacements first, row edits last, deltas between


@dataclass
class PlannedPatch:
    adapter: int
    patch: object
    rows: tuple[int, int] | None
    transposed: bool
    expert: int | None = None  # rows (or the whole patch) apply to this index of a fused expert tensor's dim 0


@dataclass
class OutputTensor:
    name: str
    source: TensorInfo | None  # the base tensor read (for an untied head: the embedding; None: a head the base lacks)
    dtype: str
    shape: tuple[int, ...]
    patches: list[PlannedPatch] = field(default_factory=list)

    @property
    def spec(self) -> OutSpec:
        return OutSpec(self.name, self.dtype, self.shape)

    @property
    def byte_copy(self) -> bool:
        return not self.patches and self.source is not None and self.dtype == self.source.dtype


@dataclass
class Coverage:
    adapter: str
    total: int
    used: int
    excluded: int
    unmatched: list[str]


@dataclass
class MergePlan:
    outputs: list[OutputTensor]
    coverage: list[Coverage]
    config_updates: dict
    tokenizer_from: Path | None
    notes: list[str]
    task_merge: object | None = None  # TIES/DARE instead of the sum (converter.engine.taskmerge), set by merge
    task_head: TaskHead | None = None  # a classifier written from a causal LM's checkpoint (engine.task_head)

    @property
    def changed(self) -> list[OutputTensor]:
        return [o for o in self.outputs if o.patches]

    @property
    def bytes_to_write(self) -> int:
        return sum(o.spec.nbytes for o in self.outputs)

    def describe(self, limit: int = 20) -> str:
        lines = []
        for c in self.coverage:
            extra = f", {c.excluded} excluded by include/exclude" if c.excluded else ""
            lines.append(f"adapter {c.adapter}: {c.used}/{c.total} tensors land on the base{extra}")
            for name in c.unmatched[:5]:
                lines.append(f"  unmatched: {name}")
        changed = self.changed
        lines.append(
            f"tensors: {len(self.outputs)} out, {len(changed)} changed, {len(self.outputs) - len(changed)} unchanged"
        )
        for o in changed[:limit]:
            kinds = ", ".join(
                f"{type(p.patch).__name__}"
                + (f"[{p.expert}]" if p.expert is not None else "")
                + (f"[{p.rows[0]}:{p.rows[1]}]" if p.rows else "")
                for p in o.patches
            )
            lines.append(f"  {o.name} {list(o.shape)} {o.dtype}: {kinds}")
        if len(changed) > limit:
            lines.append(f"  ... and {len(changed) - limit} more")
        lines.append(f"bytes to write: {human_bytes(self.bytes_to_write)}")
        if self.config_updates:
            lines.append(f"config changes: {self.config_updates}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _shape_after(shape: tuple[int, ...], planned: PlannedPatch) -> tuple[int, ...]:
    return planned.patch.value.shape if isinstance(planned.patch, Replace) else shape


def build_plan(
    checkpoint: Checkpoint,
    adapters: list[tuple[Adapter, AdapterSpec]],
    keymap: Keymap,
    out_dtype: str | None,
    allow_unmatched: bool = False,
    requantize: Requantize | None = None,
) -> MergePlan:
    keys = checkpoint.names()
    resolver = checkpoint.make_resolver(keymap) if hasattr(checkpoint, "make_resolver") else None
    placing = _Placing(checkpoint, keymap, resolver or Resolver(keymap, checkpoint.config, set(keys)), keys)
    coverage = [
        _place_adapter(placing, i, adapter, spec, allow_unmatched) for i, (adapter, spec) in enumerate(adapters)
    ]
    _order_patches(placing.by_key, keymap, requantize)
    head = placing.head
    dropped = set(head.dropped) if head else set()
    outputs = [_output(key, checkpoint.info(key), placing.by_key.get(key, []), out_dtype, adapters)
               for key in keys if key not in dropped]  # fmt: skip
    outputs += _added_outputs(placing, out_dtype)
    config_updates: dict = dict(head.config) if head else {}
    if head is None:  # a classifier has no language-model head to tie or untie
        _untie_heads(placing, outputs, out_dtype, adapters, config_updates)
    tokenizer_from = _resized_vocab(placing, outputs, adapters, config_updates)
    if out_dtype is not None:
        config_updates["dtype"] = out_dtype
    return MergePlan(outputs, coverage, config_updates, tokenizer_from, placing.notes, task_head=head)


@dataclass
class _Placing:
    """What placing the adapters on the base builds up: each base key's planned patches, and notes for the user."""

    checkpoint: Checkpoint
    keymap: Keymap
    resolver: Resolver
    keys: list[str]
    by_key: dict[str, list[PlannedPatch]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    head: TaskHead | None = None  # the classifier an adapter was trained as, where the base lacks its head
    asked: bool = False  # whether `head` has been asked for

    def add(self, key: str, planned: PlannedPatch) -> None:
        self.by_key.setdefault(key, []).append(planned)

    def task_head(self, adapter: Adapter) -> TaskHead | None:
        """The classifier (engine.task_head) that the first adapter saving a head the base lacks was trained as."""
        if not self.asked:
            self.asked = True
            dtypes = {k: self.checkpoint.info(k).dtype for k in self.keys}
            self.head = plan_head(self.checkpoint.config, self.keys, dtypes, self.checkpoint.folder, adapter)
            self.notes.extend(self.head.notes if self.head else [])
        return self.head


def _place_adapter(placing: _Placing, i: int, adapter: Adapter, spec: AdapterSpec, allow_unmatched: bool) -> Coverage:
    """Every patch of adapter `i` onto the base keys it lands on (include/exclude applied); its coverage."""
    checkpoint = placing.checkpoint
    total = sum(len(ap.patch.sources) for ap in adapter.patches)
    used = excluded = 0
    unmatched: list[str] = []
    whole: list[str] = []  # modules the adapter saves whole that the base lacks
    loaded = LoadedNames(checkpoint.config, placing.keys, adapter.config.get("task_type"),
                         {ap.module for ap in adapter.patches if not ap.flat})  # fmt: skip
    for ap in adapter.patches:
        ap = _chosen(placing, checkpoint, ap, spec) if ap.either else ap
        places = _places(placing.resolver, ap, spec) or _loaded_places(loaded, placing.resolver, ap, spec)
        places = places or _head_places(placing, adapter, ap)
        if not places:
            unmatched.extend(ap.patch.sources)
            whole.extend([ap.module] if isinstance(ap.patch, Replace) else [])
            continue
        if not all(spec.admits(place.key) for place in places):
            excluded += len(ap.patch.sources)
            continue
        _place_patch(placing, i, ap, spec, places)
        used += len(ap.patch.sources)
    if (
        isinstance(spec.weight, int | float)
        and spec.weight != 1.0  # per-component dict weights are checked in AdapterSpec
        and any(isinstance(ap.patch, Replace | RowReplace) for ap in adapter.patches)
    ):
        placing.notes.append(f"{spec.source}: weight {spec.weight} does not apply to its full replacement tensors")
    _check_unmatched(placing, spec, unmatched, whole, allow_unmatched)
    return Coverage(spec.source, total, used, excluded, unmatched)


def _place_patch(placing: _Placing, i: int, ap: AdapterPatch, spec: AdapterSpec, places: list) -> None:
    """One adapter patch, weighted, on each of its places (as stored: transposed or not; a fused module's rows);
    a patch that follows a tie lands on the tied head too."""
    ap.patch.set_weight(spec.weight_for(_component_of(places[0].key, ap.component)))
    for place in places:
        layout = placing.keymap.is_stored_transposed(place.key)
        transposed = bool(ap.stored_transposed) if layout is None else layout
        patch = ap.patch if place.src is None else rows_of(ap.patch, *place.src, place.src_expert)
        planned = PlannedPatch(i, patch, place.rows, transposed, place.expert)
        placing.add(place.key, planned)
        if ap.follows_tie:
            for head, emb in placing.resolver.tied_heads.items():
                if emb == place.key:
                    placing.add(head, planned)


def _check_unmatched(
    placing: _Placing, spec: AdapterSpec, unmatched: list[str], whole: list[str], allow_unmatched: bool
) -> None:
    """Adapter tensors that land on no base tensor fail the plan (another base?), unless allowed: then a note."""
    if unmatched and not allow_unmatched and len(whole) == len(unmatched):  # only whole tensors are missing
        saved_as = ", ".join(placing.checkpoint.config.get("architectures") or []) or "another model"
        raise BadInputError(
            f"{spec.source}: the adapter saves {', '.join(sorted(set(whole)))} whole (modules_to_save, such as "
            f"a task head), but the base has no such tensor: it was saved as {saved_as}; merge onto a base "
            "saved with that head (PEFT's own merge would add it)",
            file=spec.source,
            tensor=unmatched[0],
        )
    if unmatched and not allow_unmatched:
        raise BadInputError(
            f"{spec.source}: {len(unmatched)} adapter tensors land on no base tensor, e.g. {unmatched[0]} "
            "(wrong base model? use --allow-unmatched to merge the rest anyway)",
            file=spec.source,
            tensor=unmatched[0],
        )
    if unmatched:
        placing.notes.append(f"{spec.source}: {len(unmatched)} unmatched adapter tensors ignored (--allow-unmatched)")


def _order_patches(by_key: dict[str, list[PlannedPatch]], keymap: Keymap, requantize: Requantize | None) -> None:
    """Each key's patches in adapter order, replacements before deltas before row edits; a QLoRA merge into the
    dequantized base rounds a quantized weight through 4 bits before its first delta."""
    for key, planned in by_key.items():
        planned.sort(key=lambda p: (p.adapter, ROLE_ORDER.get(type(p.patch), 1)))
        if requantize is not None and _quantized_in_training(key, planned, keymap):
            first_delta = next(i for i, p in enumerate(planned) if not isinstance(p.patch, Replace))
            planned.insert(first_delta, PlannedPatch(planned[first_delta].adapter, requantize, None, False))


def _untie_heads(
    placing: _Placing,
    outputs: list[OutputTensor],
    out_dtype: str | None,
    adapters: list[tuple[Adapter, AdapterSpec]],
    config_updates: dict,
) -> None:
    """Tied heads: keep the tie when the head would get exactly what the embedding gets; else write the head."""
    for head, emb in placing.resolver.tied_heads.items():
        head_patches = placing.by_key.get(head, [])
        emb_out = next(o for o in outputs if o.name == emb)
        follows = [p for p in emb_out.patches if any(p is q for q in head_patches)]
        own = [p for p in head_patches if not any(p is q for q in emb_out.patches)]
        resized = emb_out.shape != emb_out.source.shape
        if own or (emb_out.patches and len(follows) != len(emb_out.patches) and not resized):
            outputs.append(_output(head, placing.checkpoint.info(emb), head_patches, out_dtype, adapters))
            config_updates["tie_word_embeddings"] = False
            placing.notes.append(f"{head} written untied from {emb} (the adapter changes one side of the tie)")
        elif resized and emb_out.patches:
            placing.notes.append(f"{head} stays tied to the resized {emb}")


def _resized_vocab(
    placing: _Placing, outputs: list[OutputTensor], adapters: list[tuple[Adapter, AdapterSpec]], config_updates: dict
) -> Path | None:
    """Resized vocabulary: the embedding (and an untied head) carry the new row count, and the tokenizer comes
    from the adapter that resized it. Returns that tokenizer's folder (None: the base's)."""
    tokenizer_from: Path | None = None
    for head, emb in placing.keymap.tied.items():
        out = {o.name: o for o in outputs}
        if emb in out and out[emb].shape[0] != out[emb].source.shape[0]:
            rows = out[emb].shape[0]
            resizers = [p.adapter for p in out[emb].patches if isinstance(p.patch, Replace)]
            if head in out and out[head].shape[0] != rows:
                raise BadInputError(
                    f"adapter resizes {emb} to {rows} rows but {head} keeps {out[head].shape[0]}; "
                    f"the adapter must carry {head} too (modules_to_save)",
                    file=adapters[resizers[0]][1].source if resizers else None,
                    tensor=head,
                )
            config_updates["vocab_size"] = rows
            for i in set(resizers):
                tokenizer_from = adapters[i][0].tokenizer_dir or tokenizer_from
            placing.notes.append(
                f"vocabulary resized to {rows} rows"
                + (
                    f"; tokenizer taken from {tokenizer_from}"
                    if tokenizer_from
                    else "; the adapter has no tokenizer files"
                )
            )
    return tokenizer_from


def _chosen(placing: _Placing, checkpoint: Checkpoint, ap: AdapterPatch, spec: AdapterSpec) -> AdapterPatch:
    """The one (param, patch) candidate of a PEFT target_parameters wrapper that the base's shapes fit (as the
    keymap says the base stores it: GPT-OSS keeps its experts (E, in, out))."""
    fits, found = [], False
    for param, patch in ap.either:
        candidate = replace(ap, param=param, patch=patch, either=())
        places = _places(placing.resolver, candidate, spec, check=False)
        found = found or bool(places)
        stored = [bool(placing.keymap.is_stored_transposed(place.key)) for place in places]
        fit = all(_fits(checkpoint, candidate.patch, p, t) for p, t in zip(places, stored, strict=True))
        if places and fit and _every_expert(candidate, places):
            fits.append(candidate)
    if len(fits) == 1:
        return fits[0]
    params = ", ".join(f"{ap.module}.{p}" for p, _ in ap.either)
    if fits:
        raise BadInputError(
            f"{spec.source}: LoRA {ap.patch.sources[0]} fits several base tensors ({params})",
            file=spec.source,
            tensor=ap.patch.sources[0],
        )
    if found:
        shapes = ", ".join(f"{p} {list(c.natural_shape())}" for p, c in ap.either)
        raise BadInputError(
            f"{spec.source}: LoRA {ap.patch.sources[0]} fits none of {params} in this base (as (experts, out, in) it "
            f"would be {shapes}; another model size or expert count?)",
            file=spec.source,
            tensor=ap.patch.sources[0],
        )
    return replace(ap, either=())  # nowhere to land: reported as unmatched, like any adapter tensor


def _every_expert(ap: AdapterPatch, places: list) -> bool:
    """Fused experts placed on every expert's own tensors: the patch holds as many experts as the base (a nested
    wrapper read with the other parameter's rank holds another count, and its rows may fit each expert's)."""
    experts = {p.src_expert for p in places if p.src_expert is not None}
    return not experts or experts == set(range(ap.patch.natural_shape()[0]))


def _fits(checkpoint: Checkpoint, patch, place, transposed: bool = False) -> bool:
    shape = checkpoint.info(place.key).shape
    if place.src is not None:
        patch = rows_of(patch, *place.src, place.src_expert)
        if place.src_expert is not None and place.src_expert >= patch.inner.natural_shape()[0]:
            return False
    if place.expert is not None:
        shape = shape[1:] if place.expert < shape[0] else ()
    if place.rows is not None:
        shape = (place.rows[1] - place.rows[0], *shape[1:])
    return bool(shape) and patch.fits(shape, transposed)


def _places(resolver, ap, spec: AdapterSpec, check: bool = True) -> list:
    """Where an adapter patch lands: [] (nowhere), one placement, or row ranges of a fused module split over
    several base tensors (they must tile the patch's rows exactly)."""
    if hasattr(resolver, "resolve_all"):
        places = resolver.resolve_all(ap.module, ap.param, ap.component, ap.flat)
    else:
        place = resolver.resolve(ap.module, ap.param, ap.component, ap.flat)
        places = [] if place is None else [place]
    if not places and ap.param == "bias" and _places(resolver, replace(ap, param="weight"), spec):
        raise BadInputError(
            f"{spec.source}: {ap.patch.sources[0]} is a bias delta but base module {ap.module} has no bias "
            "(PEFT cannot merge it either; retrain without lora_bias or use a base with biases)",
            file=spec.source,
            tensor=ap.patch.sources[0],
        )
    if not check:
        return places
    if any(p.src_expert is not None for p in places):  # a fused expert delta over every expert's own tensors
        experts, rows = ap.patch.natural_shape()[:2]
        ends = {(p.src_expert, p.src[1]) for p in places}
        if {e for e, _ in ends} != set(range(experts)) or {e for e, end in ends if end == rows} != set(range(experts)):
            raise BadInputError(
                f"{spec.source}: {ap.patch.sources[0]} holds {experts} experts of {rows} rows but the base's "
                f"{places[0].key} ... {places[-1].key} hold {len({e for e, _ in ends})} (another model size?)",
                file=spec.source,
                tensor=ap.patch.sources[0],
            )
        return places
    if any(p.src is not None for p in places):
        if not isinstance(ap.patch, DeltaPatch) and not (isinstance(ap.patch, DoRA) and ap.patch.per_output_row()):
            raise BadInputError(
                f"{spec.source}: {ap.patch.sources[0]} ({type(ap.patch).__name__}) is on a fused module that this "
                "base keeps as separate tensors; only plain deltas and DoRA with one magnitude per output row "
                "can be split by rows",
                file=spec.source,
                tensor=ap.patch.sources[0],
            )
        rows = getattr(ap.patch, "lora", ap.patch).natural_shape()[0]  # a DoRA's: its delta's
        if places[-1].src[1] != rows:
            raise BadInputError(
                f"{spec.source}: {ap.patch.sources[0]} has {rows} output rows but the base's "
                f"{', '.join(p.key for p in places)} have {places[-1].src[1]} together (another model size?)",
                file=spec.source,
                tensor=ap.patch.sources[0],
            )
    return places


def _loaded_places(loaded: LoadedNames, resolver, ap, spec: AdapterSpec) -> list:
    """Where a module named as transformers names it once loaded (ViT's `layers.N.attention.q_proj` in
    transformers 5) lands: on the checkpoint key transformers loads it from (model_class.LoadedNames)."""
    if ap.flat or ap.component:
        return []
    try:
        key = loaded.key(f"{ap.module}.{ap.param}")
    except Converted:
        raise BadInputError(
            f"{spec.source}: {ap.patch.sources[0]} is on {ap.module}.{ap.param}, which transformers builds when it "
            "loads the model from checkpoint tensors by more than a rename (fused or split); converter cannot place "
            "it on the checkpoint's tensors",
            file=spec.source,
            tensor=ap.patch.sources[0],
        ) from None
    if key is None:
        return []
    module, _, param = key.rpartition(".")
    return _places(resolver, replace(ap, module=module, param=param), spec)


def _head_places(placing: _Placing, adapter: Adapter, ap: AdapterPatch) -> list:
    """A tensor the adapter saves whole that lands nowhere in the base: the head of the classifier it was trained
    as, when it was made from this causal LM's checkpoint (engine.task_head); written as it is."""
    if not isinstance(ap.patch, Replace) or ap.flat or ap.component:
        return []
    head = placing.task_head(adapter)
    return [Placement(ap.name)] if head is not None and ap.name in head.added else []


def _added_outputs(placing: _Placing, out_dtype: str | None) -> list[OutputTensor]:
    """The head's tensors, from the adapters alone (no base tensor to start from), in the base's dtype."""
    head = placing.head
    if head is None:
        return []
    dtype = out_dtype or head.dtype
    return [OutputTensor(name, None, dtype, shape, placing.by_key[name])
            for name, shape in head.added.items() if name in placing.by_key]  # fmt: skip


def _component_of(key: str, component: str | None) -> str | None:
    """The base component a key belongs to (diffusers subfolder), else the adapter's own component name."""
    return key.split("/", 1)[0] if "/" in key else component


def _quantized_in_training(key: str, planned: list[PlannedPatch], keymap: Keymap) -> bool:
    """A weight that load_in_4bit quantizes: a linear layer's weight that LoRA targets (not the output head,
    which transformers keeps in full precision, and not embeddings)."""
    return key not in keymap.tied and any(
        isinstance(p.patch, LowRank | DoRA) and p.rows is None and not _lowrank(p.patch).flip for p in planned
    )


def _lowrank(patch) -> LowRank:
    return patch.lora if isinstance(patch, DoRA) else patch


def _output(
    name: str,
    info: TensorInfo,
    patches: list[PlannedPatch],
    out_dtype: str | None,
    adapters: list[tuple[Adapter, AdapterSpec]],
) -> OutputTensor:
    if patches and info.dtype not in FLOATING:
        raise BadInputError(
            f"base tensor {name} is {info.dtype}; adapters can only change floating-point tensors", tensor=name
        )
    shape = info.shape
    for p in patches:
        expected = p.patch.target_shape(p.transposed)
        inner = shape if p.expert is None else shape[1:]
        if p.expert is not None and p.expert >= shape[0]:
            raise BadInputError(
                f"base tensor {name} holds {shape[0]} experts; a LoRA is for expert {p.expert}",
                file=adapters[p.adapter][1].source,
                tensor=name,
            )
        target = inner if p.rows is None else (p.rows[1] - p.rows[0], *inner[1:])
        if p.rows is not None and p.rows[1] > inner[0]:
            raise BadInputError(
                f"base tensor {name} has {inner[0]} rows; the keymap places a slice at {p.rows}", tensor=name
            )
        if expected is not None and not p.patch.fits(target, p.transposed):
            where = name if p.expert is None else f"{name}[{p.expert}]"
            where = where if p.rows is None else f"{where}[{p.rows[0]}:{p.rows[1]}]"
            raise BadInputError(
                f"{adapters[p.adapter][1].source}: tensor {p.patch.sources[0]} implies shape {list(expected)} "
                f"but base tensor {where} has shape {list(target)} (adapter trained on a different model size?)",
                file=adapters[p.adapter][1].source,
                tensor=p.patch.sources[0],
            )
        shape = _shape_after(shape, p)
    dtype = out_dtype if (out_dtype and info.dtype in FLOATING) else info.dtype
    return OutputTensor(name, info, dtype, tuple(shape), list(patches))


# Config keys whose mismatch between an adapter's recorded config.json and the base means another base.
SANITY_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
)


def sanity_warnings(adapter: Adapter, checkpoint: Checkpoint, base_id: str | None = None) -> list[str]:
    """Say so before merging when the adapter looks trained on another base (`base_id`: a Hub base's pinned id)."""
    out = []
    trained_on = adapter.base_model
    declared = str(adapter.config.get("revision") or "") or None
    same = same_hub_model(trained_on, declared, base_id) if trained_on and base_id else None
    if same is not None:
        if not same:
            at = f"@{declared}" if declared and "@" not in trained_on else ""
            out.append(f"{adapter.path}: adapter was trained on {trained_on + at!r}, merging into {base_id!r}")
        trained_on = None  # decided by the pinned ids; the folder name of a Hub base is only a cache entry
    base_names = {checkpoint.folder.name.lower(), str(checkpoint.config.get("_name_or_path", "")).lower()}
    if getattr(checkpoint, "path", None) is not None:  # a single-file base: kohya records the file it trained on
        base_names |= {checkpoint.path.name.lower(), checkpoint.path.stem.lower()}
    if base_id:  # a Hub base is named by its repo, not by its cache folder (the commit sha)
        base_names.add(base_id.split("@")[0].lower())
    if trained_on and trained_on.rstrip("/").split("/")[-1].lower() not in {n.split("/")[-1] for n in base_names}:
        where = base_id or checkpoint.folder.name
        out.append(f"{adapter.path}: adapter was trained on {trained_on!r}, merging into {where!r}")
    if adapter.model_config:
        for key in SANITY_KEYS:
            theirs, ours = adapter.model_config.get(key), checkpoint.config.get(key)
            if theirs is not None and ours is not None and theirs != ours:
                out.append(f"{adapter.path}: its config.json has {key}={theirs!r}, the base has {ours!r}")
    return out


QLORA_SIGNS = re.compile(r"qlora|load_in_4bit|bnb_4bit|bitsandbytes|\b4-?bit\b", re.I)


def qlora_hint(adapter: Adapter, card: str | None) -> str | None:
    """QLoRA adapters are not marked in adapter_config.json; their cards, training configs and declared bases
    (`unsloth/...-bnb-4bit`, or a local base folder whose config has a 4-bit quantization_config) usually say so."""
    config = adapter.model_config or {}
    trained_on = adapter.base_model or ""
    declared = Path(trained_on) / "config.json"
    quantization: dict = {}
    if trained_on and declared.is_file():  # a local base: its config says, not the wording of its path
        with contextlib.suppress(ValueError, OSError):
            quantization = json.loads(declared.read_text()).get("quantization_config") or {}
        base_quantized = bool(quantization.get("load_in_4bit"))
    else:  # a Hub id: 4-bit repos say so in their names (unsloth/...-bnb-4bit)
        base_quantized = bool(QLORA_SIGNS.search(trained_on.split("/")[-1]))
    if (
        QLORA_SIGNS.search(card or "")
        or base_quantized
        or (config.get("quantization_config") or {}).get("load_in_4bit")
    ):
        return (
            f"{adapter.path}: this looks like a QLoRA adapter (trained on a 4-bit base); merging into the original "
            "weights (the default). --qlora-base dequantized merges into the 4-bit weights it saw in training"
        )
    return None


def plan_merge(
    recipe: Recipe,
    checkpoint: Checkpoint,
    adapters: list[tuple[Adapter, AdapterSpec]],
    cards: list[str | None],
    original: Checkpoint | None = None,
    base_id: str | None = None,
) -> tuple[MergePlan, list[str], set[str]]:
    """What a merge decides before writing anything: warnings, the plan, and which tensors a 4-bit output
    quantizes. Shared by `merge` and the Space's Check, so the Check shows exactly what the job will do."""
    quant = parse_output(recipe.dtype)
    warnings = [w for a, _ in adapters for w in (*a.warnings, *sanity_warnings(a, original or checkpoint, base_id))]
    if recipe.qlora_base == "original":
        warnings += [w for (a, _), card in zip(adapters, cards, strict=True) if (w := qlora_hint(a, card))]
    keymap = keymap_for(checkpoint.config)
    requantize = None
    if recipe.qlora_base == "dequantized":
        requantize = Requantize(recipe.qlora_quant, recipe.qlora_blocksize, recipe.qlora_double_quant)
    out_dtype = None if quant else parse_user_dtype(recipe.dtype)
    plan = build_plan(checkpoint, adapters, keymap, out_dtype, recipe.allow_unmatched, requantize)
    quantized = plan_4bit(plan, keymap, quant) if quant else set()
    return plan, warnings, quantized


def plan_4bit(plan: MergePlan, keymap: Keymap, quant: Quant4) -> set[str]:
    """The tensors a 4-bit output stores quantized; records quantization_config for config.json."""
    if keymap.stored_transposed:
        raise UsageError(
            f"--dtype bnb-{quant.quant_type}: {keymap.name} models store linear weights transposed (Conv1D), which "
            "transformers' 4-bit loader does not take from a checkpoint; use a float dtype"
        )
    specs = [o.spec for o in plan.outputs]
    quantized = quantized_names(specs, keymap.keeps_precision)
    if not quantized:
        raise UsageError(f"--dtype bnb-{quant.quant_type}: the base has no linear weights to quantize")
    kept = {s.name for s in specs if len(s.shape) == 2 and s.name not in quantized} | set(keymap.tied)
    dtypes = [s.dtype for s in specs if s.name in quantized]
    compute = max(set(dtypes), key=dtypes.count)
    plan.config_updates["quantization_config"] = quant.config(compute, sorted(n.removesuffix(".weight") for n in kept))
    plan.notes.append(
        f"{len(quantized)} linear weights stored as bitsandbytes {quant.quant_type.upper()} 4-bit (block size "
        f"{quant.blocksize}, double quantization {'on' if quant.double_quant else 'off'}), after merging in float32"
    )
    return quantized
