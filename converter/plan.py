"""`MergePlan`: every output tensor with the patches it gets, coverage, config changes. Touches no weight bytes.

Everything that can be wrong with the inputs is found here, before any output exists: unmatched adapter
tensors, shape mismatches, ambiguous names, inconsistent vocab sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from converter.checkpoint import Checkpoint, TensorInfo
from converter.dtypes import FLOATING
from converter.errors import ConverterError
from converter.formats import Adapter
from converter.keymap import Keymap, Resolver
from converter.patches import DeltaPatch, DoRA, LowRank, Replace, Requantize, RowReplace, RowsOf
from converter.recipe import AdapterSpec
from converter.units import human_bytes
from converter.writer import OutSpec

ROLE_ORDER = {Replace: 0, RowReplace: 2}  # whole-tensor replacements first, row edits last, deltas between


@dataclass
class PlannedPatch:
    adapter: int
    patch: object
    rows: tuple[int, int] | None
    transposed: bool


@dataclass
class OutputTensor:
    name: str
    source: TensorInfo  # the base tensor read (for an untied head: the embedding)
    dtype: str
    shape: tuple[int, ...]
    patches: list[PlannedPatch] = field(default_factory=list)

    @property
    def spec(self) -> OutSpec:
        return OutSpec(self.name, self.dtype, self.shape)

    @property
    def byte_copy(self) -> bool:
        return not self.patches and self.dtype == self.source.dtype


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
    task_merge: object | None = None  # TIES/DARE instead of the sum (converter.methods.taskmerge), set by merge

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
                f"{type(p.patch).__name__}" + (f"[{p.rows[0]}:{p.rows[1]}]" if p.rows else "") for p in o.patches
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
    resolver = resolver or Resolver(keymap, checkpoint.config, set(keys))
    by_key: dict[str, list[PlannedPatch]] = {}
    coverage: list[Coverage] = []
    notes: list[str] = []
    tokenizer_from: Path | None = None

    for i, (adapter, spec) in enumerate(adapters):
        total = sum(len(ap.patch.sources) for ap in adapter.patches)
        used = excluded = 0
        unmatched: list[str] = []
        for ap in adapter.patches:
            places = _places(resolver, ap, spec)
            if not places:
                unmatched.extend(ap.patch.sources)
                continue
            if not all(spec.admits(place.key) for place in places):
                excluded += len(ap.patch.sources)
                continue
            ap.patch.set_weight(spec.weight_for(_component_of(places[0].key, ap.component)))
            for place in places:
                layout = keymap.is_stored_transposed(place.key)
                transposed = bool(ap.stored_transposed) if layout is None else layout
                patch = ap.patch if place.src is None else RowsOf(ap.patch, *place.src)
                planned = PlannedPatch(i, patch, place.rows, transposed)
                by_key.setdefault(place.key, []).append(planned)
                if ap.follows_tie:
                    for head, emb in resolver.tied_heads.items():
                        if emb == place.key:
                            by_key.setdefault(head, []).append(planned)
            used += len(ap.patch.sources)
        if (
            isinstance(spec.weight, int | float)
            and spec.weight != 1.0  # per-component dict weights are checked in AdapterSpec
            and any(isinstance(ap.patch, Replace | RowReplace) for ap in adapter.patches)
        ):
            notes.append(f"{spec.source}: weight {spec.weight} does not apply to its full replacement tensors")
        coverage.append(Coverage(spec.source, total, used, excluded, unmatched))
        if unmatched and not allow_unmatched:
            raise ConverterError(
                f"{spec.source}: {len(unmatched)} adapter tensors land on no base tensor, e.g. {unmatched[0]} "
                "(wrong base model? use --allow-unmatched to merge the rest anyway)"
            )
        if unmatched:
            notes.append(f"{spec.source}: {len(unmatched)} unmatched adapter tensors ignored (--allow-unmatched)")

    for key, planned in by_key.items():
        planned.sort(key=lambda p: (p.adapter, ROLE_ORDER.get(type(p.patch), 1)))
        if requantize is not None and _quantized_in_training(key, planned, keymap):
            first_delta = next(i for i, p in enumerate(planned) if not isinstance(p.patch, Replace))
            planned.insert(first_delta, PlannedPatch(planned[first_delta].adapter, requantize, None, False))

    config_updates: dict = {}
    outputs: list[OutputTensor] = []
    for key in keys:
        info = checkpoint.info(key)
        outputs.append(_output(key, info, by_key.get(key, []), out_dtype, adapters))

    # Tied heads: keep the tie when the head would get exactly what the embedding gets; else write the head.
    for head, emb in resolver.tied_heads.items():
        head_patches = by_key.get(head, [])
        emb_out = next(o for o in outputs if o.name == emb)
        follows = [p for p in emb_out.patches if any(p is q for q in head_patches)]
        own = [p for p in head_patches if not any(p is q for q in emb_out.patches)]
        resized = emb_out.shape != emb_out.source.shape
        if own or (emb_out.patches and len(follows) != len(emb_out.patches) and not resized):
            outputs.append(_output(head, checkpoint.info(emb), head_patches, out_dtype, adapters))
            config_updates["tie_word_embeddings"] = False
            notes.append(f"{head} written untied from {emb} (the adapter changes one side of the tie)")
        elif resized and emb_out.patches:
            notes.append(f"{head} stays tied to the resized {emb}")

    # Resized vocabulary: the embedding (and an untied head) carry the new row count.
    for head, emb in keymap.tied.items():
        out = {o.name: o for o in outputs}
        if emb in out and out[emb].shape[0] != out[emb].source.shape[0]:
            rows = out[emb].shape[0]
            if head in out and out[head].shape[0] != rows:
                raise ConverterError(
                    f"adapter resizes {emb} to {rows} rows but {head} keeps {out[head].shape[0]}; "
                    f"the adapter must carry {head} too (modules_to_save)"
                )
            config_updates["vocab_size"] = rows
            for i in {p.adapter for p in out[emb].patches if isinstance(p.patch, Replace)}:
                tokenizer_from = adapters[i][0].tokenizer_dir or tokenizer_from
            notes.append(
                f"vocabulary resized to {rows} rows"
                + (
                    f"; tokenizer taken from {tokenizer_from}"
                    if tokenizer_from
                    else "; the adapter has no tokenizer files"
                )
            )
    if out_dtype is not None:
        config_updates["dtype"] = out_dtype
    return MergePlan(outputs, coverage, config_updates, tokenizer_from, notes)


def _places(resolver, ap, spec: AdapterSpec) -> list:
    """Where an adapter patch lands: [] (nowhere), one placement, or row ranges of a fused module split over
    several base tensors (they must tile the patch's rows exactly)."""
    if hasattr(resolver, "resolve_all"):
        places = resolver.resolve_all(ap.module, ap.param, ap.component, ap.flat)
    else:
        place = resolver.resolve(ap.module, ap.param, ap.component, ap.flat)
        places = [] if place is None else [place]
    if not places and ap.param == "bias" and _places(resolver, replace(ap, param="weight"), spec):
        raise ConverterError(
            f"{spec.source}: {ap.patch.sources[0]} is a bias delta but base module {ap.module} has no bias "
            "(PEFT cannot merge it either; retrain without lora_bias or use a base with biases)"
        )
    if any(p.src is not None for p in places):
        if not isinstance(ap.patch, DeltaPatch):
            raise ConverterError(
                f"{spec.source}: {ap.patch.sources[0]} ({type(ap.patch).__name__}) is on a fused module that this "
                "base keeps as separate tensors; only plain deltas can be split by rows"
            )
        rows = ap.patch.natural_shape()[0]
        if places[-1].src[1] != rows:
            raise ConverterError(
                f"{spec.source}: {ap.patch.sources[0]} has {rows} output rows but the base's "
                f"{', '.join(p.key for p in places)} have {places[-1].src[1]} together (another model size?)"
            )
    return places


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
        raise ConverterError(f"base tensor {name} is {info.dtype}; adapters can only change floating-point tensors")
    shape = info.shape
    for p in patches:
        expected = p.patch.target_shape(p.transposed)
        target = shape if p.rows is None else (p.rows[1] - p.rows[0], *shape[1:])
        if p.rows is not None and p.rows[1] > shape[0]:
            raise ConverterError(f"base tensor {name} has {shape[0]} rows; the keymap places a slice at {p.rows}")
        if expected is not None and not p.patch.fits(target, p.transposed):
            where = f"{name}" if p.rows is None else f"{name}[{p.rows[0]}:{p.rows[1]}]"
            raise ConverterError(
                f"{adapters[p.adapter][1].source}: tensor {p.patch.sources[0]} implies shape {list(expected)} "
                f"but base tensor {where} has shape {list(target)} (adapter trained on a different model size?)"
            )
        shape = _shape_after(shape, p)
    dtype = out_dtype if (out_dtype and info.dtype in FLOATING) else info.dtype
    return OutputTensor(name, info, dtype, tuple(shape), list(patches))
