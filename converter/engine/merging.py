"""Execute a merge: stream every base tensor once, patch in float32, round once, write, rename into place."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from converter import __version__
from converter.engine import npmath, npmerge
from converter.engine.base_reader import open_base
from converter.engine.bnb4 import Quant4, Quantizing4bitWriter, dequantize_folder, parse_output, prequantized
from converter.engine.checkpoint import Checkpoint
from converter.engine.keymap import keymap_for
from converter.engine.plan import MergePlan, OutputTensor, plan_merge
from converter.engine.recipe import Recipe
from converter.engine.taskmerge import TaskMerge
from converter.engine.writer import OutSpec, Shard, ShardedWriter, atomic_folder, check_output_target
from converter.errors import BadInputError, OutputError, UsageError
from converter.formats import Adapter, load_adapter
from converter.formats.patches import Replace, Requantize, all_finite
from converter.hub.card import INHERITED, card_metadata, write_card
from converter.hub.sources import TOKENIZER_FILES, Fetched, fetch
from converter.io import dtypes
from converter.io.dtypes import CONFIG_NAME, parse_user_dtype
from converter.io.lazy import torch
from converter.io.progress import Progress
from converter.io.readahead import Job, ReadAhead
from converter.io.records import PROVENANCE_FILE, RECIPE_FILE
from converter.io.safetensors_file import SequentialReader, file_sha256
from converter.io.scratch import temp_folder
from converter.io.units import human_bytes, parse_size

# Files of a base folder that are not carried over: weights (rewritten), the card (describes another model).
SKIP_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".onnx",
    ".msgpack",
    ".h5",
    ".ckpt",
    ".index.json",
)
SKIP_NAMES = {"README.md", RECIPE_FILE, PROVENANCE_FILE}
DEFAULT_MAX_SHARD = "5GB"  # as transformers' save_pretrained
READ_AHEAD = 64 * 2**20  # base bytes read ahead of the math (converter.io.readahead)


class TensorTee(Protocol):
    """Sees the merged model as it is written, to write another format in the same pass (`merge --gguf`)."""

    def start(self, folder: Path, specs: list[OutSpec]) -> None:
        """Before the first tensor: `folder` holds the output's config.json and tokenizer, `specs` every tensor."""

    def put(self, spec: OutSpec, chunks: list) -> None:
        """One merged tensor as written, its bytes in `chunks` (which never change afterwards)."""


@dataclass
class MergeResult:
    out: Path | None
    plan: MergePlan
    files: list[str]
    warnings: list[str]


def merge(
    recipe: Recipe,
    *,
    dry_run: bool = False,
    force: bool = False,
    token: str | None = None,
    log: Callable[[str], None] = print,
    base: Fetched | None = None,
    on_shard: Callable[[Shard], None] | None = None,
    tee: TensorTee | None = None,
    on_planned: Callable[[], object] | None = None,
    disk: int | None = None,
) -> MergeResult:
    """Merge `recipe.adapters` into `recipe.base` and write `recipe.out` (atomically).

    `token` is used for Hub sources only (None: huggingface_hub's own lookup, HF_TOKEN then the cached login);
    it is never written anywhere. `base`: the base already made local (converter.jobs.streaming: its weights may
    still be arriving); `on_shard`: called with each output shard once it is durable (see ShardedWriter); `tee`:
    also given each merged tensor (its `start` and `put`; the caller finishes or discards what it wrote);
    `on_planned`: called once the inputs are found and planned, before anything is written (so work begun there,
    such as verification's imports, is never spent on input that fails); `disk`: the most bytes of weights the
    output folder holds at once (a push deletes each shard once uploaded), checked against its free space before
    anything is written (default: all of them).
    """
    quant = parse_output(recipe.dtype)
    if quant and tee is not None:
        raise UsageError(f"--dtype {recipe.dtype}: GGUF files are made from a float merge (give float16 or bfloat16)")
    if not quant:
        parse_user_dtype(recipe.dtype)  # a bad --dtype fails before anything is fetched
    max_shard = parse_size(recipe.max_shard_size or DEFAULT_MAX_SHARD)

    task_merge = TaskMerge.from_recipe(recipe)  # a bad --method/--density fails before anything is fetched
    if not dry_run:
        if not recipe.out:
            raise UsageError("no output folder: give --out (or 'out:' in the recipe), or use --dry-run")
        check_output_target(Path(recipe.out), force)

    base = base or fetch(recipe.base, "model", token)
    fetched = [fetch(s.source, "adapter", token) for s in recipe.adapters]
    with temp_folder("dequantized", log=log) as scratch:
        return _merge(
            recipe,
            base,
            fetched,
            Path(scratch),
            quant,
            max_shard,
            dry_run,
            force,
            log,
            task_merge,
            on_shard,
            tee,
            on_planned,
            disk,
        )


def _merge(
    recipe: Recipe,
    base: Fetched,
    fetched: list[Fetched],
    scratch: Path,
    quant: Quant4 | None,
    max_shard: int,
    dry_run: bool,
    force: bool,
    log: Callable[[str], None],
    task_merge=None,
    on_shard: Callable[[Shard], None] | None = None,
    tee: TensorTee | None = None,
    on_planned: Callable[[], object] | None = None,
    disk: int | None = None,
) -> MergeResult:
    original = _open_arriving_base(recipe, base)
    if quant and original.diffusion:
        raise UsageError(
            f"--dtype {recipe.dtype}: bitsandbytes 4-bit outputs are for transformers models; "
            "a diffusion base takes float32, float16 or bfloat16"
        )
    warnings: list[str] = []
    checkpoint, prequant = _dequantized_if_4bit(recipe, base, original, scratch, warnings)
    adapters = [
        (load_adapter(f.local, allow_pickle=recipe.allow_pickle, lora_alpha=s.lora_alpha), s)
        for f, s in zip(fetched, recipe.adapters, strict=True)
    ]
    plan, quantized = _planned(recipe, base, fetched, original, checkpoint, prequant, adapters, warnings, log)
    plan.task_merge = task_merge
    check_finite(adapters)
    if dry_run:
        log(plan.describe())
        return MergeResult(None, plan, [], warnings)

    for note in plan.notes:
        log(f"note: {note}")
    out = Path(recipe.out)
    _check_disk_space(out, min(plan.bytes_to_write, disk or plan.bytes_to_write))
    if on_planned is not None:
        on_planned()
    log(
        f"merging {len(adapters)} adapter(s) into {recipe.base} ({keymap_for(checkpoint.config).name} keymap): "
        f"{len(plan.changed)} of {len(plan.outputs)} tensors change"
    )
    with atomic_folder(out, force, needs=plan.bytes_to_write, log=log) as tmp:
        write_side_files(checkpoint, plan, tmp)  # first: a tee writes its header from config.json and tokenizer
        if tee is not None:
            tee.start(tmp, [o.spec for o in plan.outputs])
        known = hub_hashes(base) if original is checkpoint else {}
        hashes = write_weights(checkpoint, plan, tmp, max_shard, log, quant, quantized, known, on_shard, tee)
        if original is not checkpoint:  # provenance names the files that were downloaded, not our scratch copy
            known = hub_hashes(base)
            hashes = {f.path.name: known.get(f.path.name) or file_sha256(f.path) for f in original.files}
        _write_records(tmp, out.name, recipe, base, fetched, original, adapters, plan, hashes)
        files = sorted(p.name for p in tmp.iterdir())
    log(f"wrote {out} ({human_bytes(plan.bytes_to_write)} of weights)")
    return MergeResult(out, plan, files, warnings)


def _open_arriving_base(recipe: Recipe, base: Fetched) -> Checkpoint:
    """The base checkpoint; for a base still arriving (converter.jobs.streaming), reads wait for their bytes and
    say when a file is no longer needed."""
    checkpoint = open_base(
        base.local, lora_alpha=recipe.base_lora_alpha, allow_pickle=recipe.allow_pickle, config=recipe.base_config
    )
    for f in checkpoint.files:
        if (stream := base.streams.get(f.path)) is not None:
            f.arrival, f.release = functools.partial(stream.wait, f.path), functools.partial(stream.release, f.path)
    return checkpoint


def _dequantized_if_4bit(
    recipe: Recipe, base: Fetched, checkpoint: Checkpoint, scratch: Path, warnings: list[str]
) -> tuple[Checkpoint, Quant4 | None]:
    """A bitsandbytes 4-bit base is merged into its dequantization (written to `scratch`), with a warning that
    the full-precision original would be better: (the checkpoint to merge into, its 4-bit settings or None)."""
    if not (prequant := prequantized(checkpoint.config)):
        return checkpoint, prequant
    where = card_metadata(base.card).get("base_model")
    warnings.append(
        f"{recipe.base} is a bitsandbytes {prequant.quant_type.upper()} 4-bit checkpoint: dequantizing it to "
        "merge; the original full-precision weights would be better"
        + (f" (probably {where}, this checkpoint's base_model)" if where else "")
    )
    dequantize_folder(checkpoint, scratch)
    return Checkpoint(scratch), prequant


def _planned(
    recipe: Recipe,
    base: Fetched,
    fetched: list[Fetched],
    original: Checkpoint,
    checkpoint: Checkpoint,
    prequant: Quant4 | None,
    adapters: list,
    warnings: list[str],
    log: Callable[[str], None],
) -> tuple[MergePlan, set[str]]:
    """The plan and the tensors a 4-bit output quantizes; every warning is said now, before anything is written,
    and the plan's notes start with what reading the base did (a training checkpoint's LoRA fused ...)."""
    cards = [f.card for f in fetched]
    base_id = base.pinned if base.source.repo_id else None
    plan, more, quantized = plan_merge(recipe, checkpoint, adapters, cards, original, base_id)
    warnings += more
    plan.notes[:0] = getattr(checkpoint, "notes", [])
    for w in warnings:
        log(f"warning: {w}")
    if original is not checkpoint:
        plan.notes.append(
            f"the base was bitsandbytes {prequant.quant_type.upper()} 4-bit; merged into its dequantization"
        )
    return plan, quantized


def _check_disk_space(out: Path, needed: int) -> None:
    """Refuse before writing when the output's folder has not room for the weights."""
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < needed:
        raise OutputError(
            f"{out.parent}: not enough disk space: the output needs {human_bytes(needed)}, "
            f"{human_bytes(free)} free ({human_bytes(needed - free)} missing)",
            path=out.parent,
        )


def _write_records(
    folder: Path,
    name: str,
    recipe: Recipe,
    base: Fetched,
    fetched: list[Fetched],
    original: Checkpoint,
    adapters: list,
    plan: MergePlan,
    hashes: dict[str, str],
) -> None:
    """The recipe as run (pinned), the provenance record and the card, beside the merged weights (`name`: the
    output folder's final name, which the card loads from)."""
    (folder / RECIPE_FILE).write_text(pinned_recipe(recipe, base, fetched).to_yaml())
    provenance = build_provenance(recipe, base, fetched, original, adapters, plan, hashes)
    (folder / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    write_card(folder, load_name=f"./{name}")


def hub_hashes(fetched: Fetched) -> dict[str, str]:
    """sha256 of a Hub source's files by path in the repo (and by file name), from the Hub's LFS ids: what the
    provenance records, without hashing the files again. Empty for local sources (those are hashed on the way)."""
    if not fetched.sha:
        return {}
    known = {}
    for f in fetched.files:
        if f.get("sha256"):
            known[f["name"]] = known.setdefault(f["name"].rsplit("/", 1)[-1], f["sha256"])
    return known


def check_finite(adapters: list[tuple[Adapter, object]]) -> None:
    for adapter, _ in adapters:
        for ap in adapter.patches:
            for name in ap.patch.sources:
                if not _finite_source(adapter.tensors, name):
                    raise BadInputError(
                        f"{adapter.path}: tensor {name} contains NaN or Inf values (a broken training run?)",
                        file=adapter.path,
                        tensor=name,
                    )


def _finite_source(tensors, name: str) -> bool:
    """Finite check of one adapter tensor, on its bytes when it is a safetensors float (no torch needed)."""
    if npmerge.viewable(tensors, name):
        return npmath.finite(npmerge.raw(tensors, name, tensors.shape(name)), tensors.dtype(name))
    return all_finite(tensors.read(name))


def _patched(o: OutputTensor, t: torch.Tensor) -> torch.Tensor:
    """Apply the tensor's patches in float32. Replacements reset the base that weight-dependent deltas see."""
    w = t.to(torch.float32, copy=True)  # never in place: `t`'s buffer may still be being hashed
    keep_base = len(o.patches) > 1 and any(p.patch.reads_base for p in o.patches)
    base = None
    for p in o.patches:
        if isinstance(p.patch, Replace | Requantize):  # a new starting weight for the deltas
            w, base = p.patch.apply(w, p.transposed), None
            continue
        if keep_base and base is None:
            base = w.clone()
        if p.expert is None and p.rows is None:
            w = p.patch.apply(w, p.transposed, base)
            continue
        # a slice: rows of a fused projection, one expert of a fused MoE tensor, or rows of that expert
        index = (() if p.expert is None else (p.expert,)) + (() if p.rows is None else (slice(*p.rows),))
        w[index] = p.patch.apply(w[index], p.transposed, None if base is None else base[index])
    return w


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_weights(
    checkpoint: Checkpoint,
    plan: MergePlan,
    folder: Path,
    max_shard: int,
    log: Callable[[str], None],
    quant: Quant4 | None = None,
    quantized: set[str] = frozenset(),
    known: dict[str, str] | None = None,
    on_shard: Callable[[Shard], None] | None = None,
    tee: TensorTee | None = None,
) -> dict[str, str]:
    """Stream every output tensor into shards; returns sha256 of each base weight file (read exactly once, and
    not hashed at all when `known` gives it: a Hub file's LFS id). `on_shard`: see ShardedWriter; `tee`: given
    every tensor as it is written."""
    known = known or {}
    writers = []
    specs_by_name = {o.name: o.spec for o in plan.outputs} if tee is not None else {}
    for part in checkpoint.parts:  # diffusers components each go back to their own subfolder, same file names
        specs = [o.spec for o in plan.outputs if o.name.startswith(part.prefix)]
        specs = [OutSpec(s.name[len(part.prefix) :], s.dtype, s.shape) for s in specs]
        (folder / part.subfolder).mkdir(parents=True, exist_ok=True)
        hook = None if on_shard is None else _part_shards(on_shard, part)
        if quant:
            writer = Quantizing4bitWriter(folder / part.subfolder, specs, max_shard, quant, quantized, hook)
        else:
            limit = max_shard if part.single_file is None else float("inf")
            writer = ShardedWriter(
                folder / part.subfolder, specs, limit, part.stem, part.single_file, part.metadata, hook
            )
        if tee is not None:
            writer = _Teed(writer, tee, specs_by_name, part.prefix)
        writers.append((part, writer))
    # A training checkpoint's files bring their own reader (tensors rebuilt from shards, see converter.training).
    readers = {}
    for f in checkpoint.files:
        sha = known.get(_relative_name(checkpoint, f.path))
        readers[f.path] = f.reader() if hasattr(f, "reader") else SequentialReader(f, sha)
    # Tensors whose patches numpy covers skip torch (see converter.engine.npmerge); the rest, and every tensor of a
    # TIES/DARE merge, a 4-bit output or a training checkpoint (its own readers), go through torch.
    plain = all(isinstance(r, SequentialReader) for r in readers.values())
    use_numpy = plan.task_merge is None and quant is None and plain
    try:
        _stream(checkpoint, plan, writers, readers, log, use_numpy)
    except BaseException:
        for _, writer in writers:
            writer.abort()
        for reader in readers.values():
            reader.abort()
        raise
    for _, writer in writers:
        writer.close()
    return {_relative_name(checkpoint, path): r.finish() for path, r in readers.items()}


class _Teed:
    """A writer that also hands each tensor's bytes, as written, to a TensorTee."""

    def __init__(self, writer, tee: TensorTee, specs: dict[str, OutSpec], prefix: str):
        self._writer, self._tee, self._specs, self._prefix = writer, tee, specs, prefix

    def write(self, name: str, produce: Callable[[Callable[[bytes], None]], None]) -> None:
        chunks: list = []

        def both(sink: Callable[[bytes], None]) -> None:
            def each(chunk: bytes) -> None:
                chunks.append(chunk)
                sink(chunk)

            produce(each)

        self._writer.write(name, both)
        self._tee.put(self._specs[self._prefix + name], chunks)

    def close(self) -> list[str]:
        return self._writer.close()

    def abort(self) -> None:
        self._writer.abort()


def _part_shards(on_shard: Callable[[Shard], None], part) -> Callable[[Shard], None]:
    """A part's shards reported with the plan's tensor names and their path in the output folder (`unet/...`
    for a diffusers component)."""
    if not part.subfolder and not part.prefix:
        return on_shard
    where = f"{part.subfolder}/" if part.subfolder else ""
    return lambda s: on_shard(
        dataclasses.replace(s, name=where + s.name, tensors=tuple(part.prefix + n for n in s.tensors))
    )


def _relative_name(checkpoint: Checkpoint, path: Path) -> str:
    return str(path.relative_to(checkpoint.folder)) if checkpoint.diffusion == "diffusers" else path.name


def _stream(
    checkpoint: Checkpoint,
    plan: MergePlan,
    writers: list,
    readers: dict,
    log: Callable[[str], None],
    use_numpy: bool = False,
) -> None:
    # The math runs on one thread per core while this one reads and the writer and hasher threads do I/O.
    if use_numpy:
        npmerge.one_blas_thread()
    total = plan.bytes_to_write  # progress only for models where a merge takes a while
    progress = Progress(total, "merging", log) if total >= 256 * 2**20 else None
    with ThreadPoolExecutor(len(os.sched_getaffinity(0)), thread_name_prefix="converter-math") as pool:
        try:
            _stream_into(checkpoint, plan, writers, readers, use_numpy, pool, progress)
        finally:
            if progress is not None:
                progress.close()


def _stream_into(
    checkpoint: Checkpoint, plan: MergePlan, writers: list, readers: dict, use_numpy: bool, pool,
    progress: Progress | None,
) -> None:  # fmt: skip
    last_use = {checkpoint.where[o.source.name].path: o.name for o in plan.outputs if o.source is not None}
    ways = [_way(checkpoint, o, use_numpy) for o in plan.outputs]
    jobs = [_read_job(checkpoint, o, way, readers, last_use) for o, way in zip(plan.outputs, ways, strict=True)]
    ahead = ReadAhead(jobs, READ_AHEAD)
    try:
        _consume(checkpoint, plan, writers, ways, ahead, pool, last_use, progress)
    except BaseException:
        ahead.close(wait=False)  # its thread may be waiting for a download; it stops at its next piece
        raise
    ahead.close()


def _consume(
    checkpoint: Checkpoint, plan: MergePlan, writers: list, ways: list[str], ahead: ReadAhead, pool,
    last_use: dict, progress: Progress | None,
) -> None:  # fmt: skip
    """Merge and write each output from the pieces `ahead` reads for it, in the plan's order."""
    last_tensor_use = {o.source.name: o.name for o in plan.outputs if o.source is not None}
    for o, way in zip(plan.outputs, ways, strict=True):
        part, writer = next((p, w) for p, w in writers if o.name.startswith(p.prefix))
        name = o.name[len(part.prefix) :]
        if way == "copy":
            writer.write(name, lambda sink: _drain(ahead.pieces(), sink))
        elif way == "numpy":
            base = npmath.view(ahead.next(), o.source.dtype, o.source.shape)
            writer.write(name, lambda sink, o=o, base=base: _numpy_merged(o, base, sink, pool))
            del base
        else:
            t = ahead.next()
            merged = plan.task_merge or _patched
            result = (merged(o, t) if o.patches else t).to(dtypes.ST_TO_TORCH[o.dtype])
            if o.patches and not all_finite(result):
                raise BadInputError(
                    f"merged tensor {o.name} has NaN/Inf values in {o.dtype} (the adapter's delta overflows "
                    "this base; check its alpha/scale, or merge into a wider --dtype)",
                    tensor=o.name,
                )
            data = _as_bytes(result)
            del t, result
            writer.write(name, lambda sink, d=data: sink(d))
            del data
        source_file = checkpoint.where[o.source.name] if o.source is not None else None
        if getattr(source_file, "release", None) is not None:  # a file fetched for this job: what is read can go
            if last_tensor_use.get(o.source.name) == o.name:
                source_file.release(o.name, o.source.name)
            if last_use.get(source_file.path) == o.name:
                source_file.release(o.name)
        if progress is not None:
            progress.update(o.spec.nbytes)


def _drain(pieces, sink) -> None:
    for piece in pieces:
        sink(piece)


def _in_order(checkpoint: Checkpoint, o: OutputTensor) -> bool:
    """Whether `o` is a base tensor of its own name, its bytes met in file order (an untied head, made from the
    embedding, is read apart)."""
    return checkpoint.where.get(o.name) is not None


def _way(checkpoint: Checkpoint, o: OutputTensor, use_numpy: bool) -> str:
    """How output `o` is made: "copy" (the base's bytes as they are), "numpy" (converter.engine.npmerge) or "torch"
    (a head the base lacks too: its replacement, rounded to the output dtype)."""
    if o.byte_copy and _in_order(checkpoint, o):
        return "copy"
    return "numpy" if use_numpy and o.source is not None and npmerge.supports(o) else "torch"


def _read_job(checkpoint: Checkpoint, o: OutputTensor, way: str, readers: dict, last_use: dict) -> Job:
    """What the read-ahead thread does for output `o`: its base tensor's bytes (a tensor, for torch), or a byte
    copy's chunks; after a file's last tensor, the rest of the file is hashed and the file closed."""
    if o.source is None:  # a head the base lacks: nothing of the base to read
        return lambda put: put(torch.empty(0))
    source_file = checkpoint.where[o.source.name]
    reader = readers[source_file.path]
    in_order = _in_order(checkpoint, o)

    def job(put) -> None:
        if way == "copy":
            reader.copy(o.source, put)
        elif way == "numpy":
            put(reader.read_bytes(o.source) if in_order else checkpoint.read_bytes(o.source.name))
        else:
            put(reader.read(o.source) if in_order else checkpoint.read(o.source.name))
        if last_use.get(source_file.path) == o.name:
            reader.finish()

    return job


def _numpy_merged(o: OutputTensor, base, sink, pool) -> None:
    """Merge `o` (converter.engine.npmerge, its row blocks on `pool`'s threads) into `sink`, 8 MiB at a time."""
    for chunk in npmerge.merged_chunks(o, base, pool):
        sink(memoryview(chunk).cast("B"))


def write_side_files(checkpoint: Checkpoint, plan: MergePlan, folder: Path) -> None:
    """config.json (updated), generation config, tokenizer, licence, custom code: everything but weights."""
    if checkpoint.diffusion:
        _diffusion_side_files(checkpoint, folder)
        return
    for src in sorted(checkpoint.folder.iterdir()):
        if (
            src.is_file()
            and not src.name.startswith(".")
            and src.name not in SKIP_NAMES
            and not src.name.endswith(SKIP_SUFFIXES)
        ):
            shutil.copyfile(src, folder / src.name)
    if plan.tokenizer_from is not None:
        for src in sorted(plan.tokenizer_from.iterdir()):
            if src.is_file() and any(fnmatch.fnmatch(src.name, p) for p in TOKENIZER_FILES):
                shutil.copyfile(src, folder / src.name)
    config = dict(checkpoint.config)
    for key, value in plan.config_updates.items():
        if key == "dtype":
            config.pop("torch_dtype", None)
            config["dtype"] = CONFIG_NAME[value]
            continue
        config[key] = value
        if isinstance(config.get("text_config"), dict) and key in config["text_config"]:
            config["text_config"][key] = value
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _diffusion_side_files(checkpoint: Checkpoint, folder: Path) -> None:
    """A diffusers folder: every file but the weights we rewrote (configs, scheduler, tokenizers, model_index);
    a single file: nothing (its siblings are not part of it)."""
    if checkpoint.diffusion != "diffusers":
        return
    written = {p.subfolder for p in checkpoint.parts}
    for src in sorted(checkpoint.folder.rglob("*")):
        rel = src.relative_to(checkpoint.folder)
        if not src.is_file() or any(part.startswith(".") for part in rel.parts) or rel.name in SKIP_NAMES:
            continue
        if len(rel.parts) > 1 and rel.parts[0] in written and rel.name.endswith(SKIP_SUFFIXES):
            continue
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, folder / rel)


def pinned_recipe(recipe: Recipe, base: Fetched, adapters: list[Fetched]) -> Recipe:
    """The recipe as run: Hub sources pinned to the commits that were used, so a re-run gets the same bytes."""
    pinned = copy.deepcopy(recipe)
    pinned.base = base.pinned
    for spec, fetched in zip(pinned.adapters, adapters, strict=True):
        spec.source = fetched.pinned
    pinned.out = None
    return pinned


def _source_record(fetched: Fetched, card_keys: tuple[str, ...]) -> dict:
    meta = card_metadata(fetched.card)
    record: dict = {"source": fetched.source.spec, "card": {k: meta[k] for k in card_keys if k in meta}}
    if fetched.sha:
        record.update(repo_id=fetched.source.repo_id, revision=fetched.sha, path=fetched.source.path)
    return record


def build_provenance(  # no timestamp: the same inputs give the same bytes, so a re-push is a no-op
    recipe: Recipe,
    base: Fetched,
    fetched: list[Fetched],
    checkpoint: Checkpoint,
    adapters: list[tuple[Adapter, object]],
    plan: MergePlan,
    base_hashes: dict[str, str],
) -> dict:
    return {
        "tool": "converter",
        "version": __version__,
        "base": {
            **_source_record(base, (*INHERITED, "tags")),
            "model_type": checkpoint.config.get("model_type"),
            **_diffusion_record(checkpoint),
            "files": [
                {"name": (rel := _relative_name(checkpoint, f.path)), "size": f.size, "sha256": base_hashes[rel]}
                for f in checkpoint.files
            ],
        },
        "adapters": [
            {
                **_source_record(f, ("datasets", "tags")),
                "weight": spec.weight,
                "include": spec.include,
                "exclude": spec.exclude,
                "format": adapter.format,
                "base_model": adapter.base_model,
                "settings": adapter.summary,
                "files": [{"name": p.name, "size": p.stat().st_size, "sha256": file_sha256(p)} for p in adapter.files],
                "coverage": {
                    "tensors": cov.total,
                    "used": cov.used,
                    "excluded": cov.excluded,
                    "unmatched": len(cov.unmatched),
                },
            }
            for (adapter, spec), f, cov in zip(adapters, fetched, plan.coverage, strict=True)
        ],
        "dtype": recipe.dtype or "as base",
        "precision": "deltas computed in float32, each tensor rounded once to its output dtype; "
        "untouched tensors copied byte for byte"
        + (
            f"; targeted weights first rounded through {recipe.qlora_quant.upper()} 4-bit quantization "
            f"(block size {recipe.qlora_blocksize}, double quantization {'on' if recipe.qlora_double_quant else 'off'})"
            ", as the QLoRA adapters saw them in training"
            if recipe.qlora_base == "dequantized"
            else ""
        ),
        "config_updates": plan.config_updates,
        **({"task_head": plan.task_head.record()} if plan.task_head else {}),
        "tensors": {"total": len(plan.outputs), "changed": [o.name for o in plan.changed]},
        "notes": plan.notes,
    }


def _diffusion_record(checkpoint: Checkpoint) -> dict:
    """For a diffusion base: its layout, family and pipeline, so the card can say how to load the result."""
    if not checkpoint.diffusion:
        return {}

    keymap = keymap_for(checkpoint.config)
    record = {"layout": checkpoint.diffusion, "family": keymap.name}
    record["pipeline"] = checkpoint.config.get("_class_name") or (keymap.pipelines or [None])[0]
    if checkpoint.diffusion == "single_file":
        record["file"] = checkpoint.parts[0].single_file
    return record
