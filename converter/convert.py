"""Convert an adapter between formats without merging: kohya ↔ PEFT ↔ diffusers.

Every format is read into `AdapterPatch`es (converter/formats/), turned here into plain LoRA modules
(down, up, alpha on a dotted module path), and written by one small writer per format. Facts about each format:
shared/reference/lora-formats.md (§1 kohya, §4 diffusers, §7 PEFT, §8 known bugs).

- Names: kohya names are flattened ('.' -> '_') and cannot be parsed back, so a kohya file becomes PEFT/diffusers
  only with `--base`: its modules are looked up among the base's real keys (the merge's resolver) and take the base's
  dotted names. kohya output names are made by flattening real dotted names, never by guessing.
- Alphas: each module keeps its own alpha. PEFT and diffusers outputs carry them as `rank_pattern`/`alpha_pattern`
  (nothing folded into the weights, so ΔW is bit-for-bit the same); kohya outputs carry a real `.alpha` per module
  (diffusers' own PEFT→kohya writes alpha = rank, which is wrong for lora_alpha != r, §4).
- Fused ↔ split (BFL qkv / linear1 vs diffusers to_q/to_k/to_v/proj_mlp): a fused module splits exactly by its up
  rows; the down matrix is split too only when the up matrix is block-diagonal (checked exactly: kohya's split_qkv
  layout, §8 mflux#423), else every part shares it. Separate modules fuse into a block-diagonal up and stacked down.
- LoHa / LoKr / full deltas / Tucker LoCon have no exact LoRA form: refused unless `--rank`, then an SVD with the
  reconstruction error reported.
- DoRA: PEFT's magnitude vector and LyCORIS' output-axis `dora_scale` are the same numbers (§3, §7); the old
  input-axis `dora_scale` has no PEFT form and is refused.
- A Hub `--base` is read from its configs and safetensors headers only: names need no weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from converter.errors import ConverterError
from converter.formats import Adapter, AdapterPatch, load_adapter
from converter.keymap import flatten
from converter.patches import DeltaPatch, DoRA, FullDelta, LoHa, LoKr, LowRank

TARGETS = ("peft", "diffusers", "kohya")
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
# kohya prefixes per output component (sd-scripts networks/lora.py, lora_flux.py; lora-formats.md §1)
# "denoiser" = a denoiser under its original (LDM, BFL, Wan ...) names; "transformer" = a DiT under diffusers' names,
# which kohya-style files spell lora_transformer_ (OneTrainer; read by ComfyUI and diffusers, §5, §6).
KOHYA_PREFIX = {"unet": "lora_unet_", "denoiser": "lora_unet_", "transformer": "lora_transformer_"}
# the component of a dotted source prefix (diffusers: `unet` in SD/SDXL, `transformer` in DiTs; ComfyUI's
# `diffusion_model.` keeps the original model's names)
NATIVE_COMPONENT = {"unet.": "unet", "transformer.": "transformer", "diffusion_model.": "denoiser"}
# kohya's CLIP text-encoder names come from transformers 4 module paths, which start with `text_model.`
# (lora_te_text_model_encoder_layers_0_..., the only spelling ComfyUI/A1111 look up; lora-formats.md §1, §5);
# transformers 5 checkpoints and modules drop it. T5 (`encoder.block.`) never had it.
KOHYA_TEXT_MODEL = re.compile(r"(encoder\.layers|embeddings|final_layer_norm)\.")


@dataclass
class LoraModule:
    """One LoRA module ready to write: ΔW = alpha / rank · up @ down (linear, or conv with down (r, in, *k))."""

    component: str | None  # "unet", "transformer", "text_encoder", ... ; None: a plain transformers model
    name: str  # dotted module path (flattened when `flat`)
    down: torch.Tensor
    up: torch.Tensor
    alpha: float
    source: str  # the module's name in the input file, for messages
    flat: bool = False
    prefix: str | None = None  # a flattened source's own kohya prefix (lora_unet_, lora_transformer_ ...), kept
    magnitude: torch.Tensor | None = None  # DoRA: the per-output-channel magnitude (out,)

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass
class ConvertResult:
    out: Path
    files: list[str]
    modules: int
    notes: list[str] = field(default_factory=list)
    svd_errors: dict[str, float] = field(default_factory=dict)


def convert(
    adapter_spec: str,
    to: str,
    out: str | Path,
    *,
    base: str | None = None,
    rank: int | None = None,
    component: str | None = None,
    force: bool = False,
    token: str | None = None,
    allow_pickle: bool = False,
    log: Callable[[str], None] = print,
    lora_alpha: float | None = None,
) -> ConvertResult:
    """Read the adapter at `adapter_spec` (local or Hub), convert it to format `to`, write `out` atomically."""
    from converter.sources import fetch

    if to not in TARGETS:
        raise ConverterError(f"--to {to}: choose one of {', '.join(TARGETS)}")
    out = Path(out)
    _check_out(out, to, force)
    fetched = fetch(adapter_spec, "adapter", token)
    adapter = load_adapter(fetched.local, allow_pickle=allow_pickle, lora_alpha=lora_alpha)
    with tempfile.TemporaryDirectory(prefix="converter-base-headers-") as scratch:
        base_view = _Base(base_names(base, token, Path(scratch))) if base else None
        modules, svd = collect(adapter, base_view, to, rank=rank, component=component)
    notes = list(adapter.warnings)
    if svd:
        worst = max(svd, key=svd.get)
        notes.append(
            f"{len(svd)} modules (LoHa/LoKr/full/Tucker) approximated by SVD at rank {rank}: relative "
            f"reconstruction error ‖ΔW − ΔW_r‖/‖ΔW‖ max {svd[worst]:.3e} ({worst}), mean "
            f"{sum(svd.values()) / len(svd):.3e}"
        )
    source = {"converted_from": adapter.format, "source": fetched.pinned if fetched.sha else Path(adapter_spec).name}
    files = write(modules, to, out, force=force, source=source, base_model=_public_base(base, adapter), svd=svd,
                  components=base_view.components() if base_view else set())  # fmt: skip
    for note in notes:
        log(f"note: {note}")
    log(f"wrote {out}: {len(modules)} LoRA modules as {to} ({', '.join(files)})")
    return ConvertResult(out, files, len(modules), notes, svd)


def _public_base(base: str | None, adapter: Adapter) -> str | None:
    """The base to record in adapter_config.json: a Hub id, never a local path (outputs may be published)."""
    from converter.sources import HUB_SPEC

    for spec in (base, adapter.base_model):
        if spec and not Path(spec).expanduser().exists() and (m := HUB_SPEC.match(spec)):
            return m["repo"]
    return None


def _check_out(out: Path, to: str, force: bool) -> None:
    if to == "kohya" and out.suffix != ".safetensors":
        raise ConverterError(f"--out {out}: a kohya LoRA is one file; give a path ending in .safetensors")
    if to != "kohya" and out.suffix == ".safetensors":
        raise ConverterError(f"--out {out}: {to} output is a folder; give a folder path")
    if out.exists() and not force and (out.is_file() or any(out.iterdir())):
        raise ConverterError(f"{out}: output already exists (use --force to replace it)")


def base_names(spec: str, token: str | None, workdir: Path) -> Path:
    """A base to look names up in. Local: the path itself. Hub: only its configs and safetensors *headers* (no
    weights): each weights file becomes a sparse stand-in in `workdir` with the real header and length, so a
    conversion against a 20 GB pipeline downloads a few kilobytes. A single file is `org/name[@rev]/file`."""
    from converter import hub
    from converter.sources import MODEL_FILES, diffusers_files, parse_source

    source = parse_source(spec)
    if source.local is not None:
        return source.local
    import fnmatch

    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi(token=token)
    repo, revision = source.repo_id, source.revision or "main"
    where = f"{repo}@{revision}"
    info = hub.call(where, lambda: api.model_info(repo, revision=revision))
    names = [s.rfilename for s in info.siblings or []]
    if source.path is not None:
        if not source.path.endswith(".safetensors") or source.path not in names:
            raise ConverterError(f"{where}: {source.path} is not a .safetensors file of the repo")
        wanted = [source.path]
    elif "model_index.json" in names:
        wanted = diffusers_files(names)
    else:
        wanted = [n for n in names if "/" not in n and any(fnmatch.fnmatch(n, p) for p in MODEL_FILES)]
        if "config.json" not in wanted:
            raise ConverterError(f"{where}: not a model repo (no config.json or model_index.json)")
    for name in wanted:
        target = workdir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".safetensors"):
            meta = hub.call(
                f"{where}/{name}", lambda n=name: api.parse_safetensors_file_metadata(repo, n, revision=info.sha)
            )
            _sparse_standin(target, meta)
        elif name.endswith((".json", ".txt")):
            path = hub.call(f"{where}/{name}", lambda n=name: hf_hub_download(repo, n, revision=info.sha, token=token))
            target.write_bytes(Path(path).read_bytes())
    return workdir / source.path if source.path else workdir


def _sparse_standin(path: Path, meta) -> None:
    """The file's real header and length with its data left a hole: names, shapes and byte ranges, no weights."""
    header: dict = {"__metadata__": meta.metadata} if meta.metadata else {}
    for name, t in meta.tensors.items():
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    end = max((t.data_offsets[1] for t in meta.tensors.values()), default=0)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + end)


class _Base:
    """The base model's names: a resolver over its real keys, and which component each key belongs to."""

    def __init__(self, path: Path):
        from converter.checkpoint import open_base
        from converter.keymap import keymap_for

        self.checkpoint = open_base(path)
        self.keymap = keymap_for(self.checkpoint.config)
        self.resolver = self.checkpoint.make_resolver(self.keymap)
        keys = self.checkpoint.names()
        # single files: the key prefix of each component the file uses (the keymap's `components`)
        self.prefixes: list[tuple[str, str]] = []
        if self.checkpoint.diffusion == "single_file":
            for comp, prefixes in self.keymap.components.items():
                used = next((p for p in prefixes if any(k.startswith(p) for k in keys)), None)
                if used is not None:
                    self.prefixes.append((used, comp))
            self.prefixes.sort(key=lambda p: -len(p[0]))

    def components(self) -> set[str]:
        if self.checkpoint.diffusion == "single_file":
            return {c for _, c in self.prefixes}
        return {p.subfolder for p in self.checkpoint.parts if p.subfolder}

    def places(self, ap: AdapterPatch) -> list:
        if hasattr(self.resolver, "resolve_all"):
            return self.resolver.resolve_all(ap.module, ap.param, ap.component, ap.flat)
        place = self.resolver.resolve(ap.module, ap.param, ap.component, ap.flat)
        return [] if place is None else [place]

    def split_key(self, key: str, param: str) -> tuple[str | None, str]:
        """(component, dotted module path) of a base key."""
        module = key[: -len(param) - 1] if key.endswith("." + param) else key
        if "/" in module:  # diffusers folder: <component>/<key>
            comp, module = module.split("/", 1)
            return comp, module
        for prefix, comp in self.prefixes:  # a single file keeps the original names: the denoiser is "denoiser"
            if module.startswith(prefix):
                return (comp if comp.startswith("text_encoder") else "denoiser"), module[len(prefix) :]
        return None, module

    def rows(self, key: str) -> int:
        return self.checkpoint.info(key).shape[0]


def collect(
    adapter: Adapter,
    base: _Base | None,
    to: str,
    *,
    rank: int | None = None,
    component: str | None = None,
) -> tuple[list[LoraModule], dict[str, float]]:
    """The adapter's patches as LoRA modules named for the output (fused/split on the base's layout)."""
    modules: list[LoraModule] = []
    fused: dict[str, list[tuple[tuple[int, int], LoraModule]]] = {}
    svd: dict[str, float] = {}
    for ap in adapter.patches:
        native = ap.native or ap.module
        if ap.param != "weight":
            raise ConverterError(
                f"{adapter.path}: {native} has a bias delta ({ap.patch.sources[0]}); converting bias deltas "
                "is not supported (a LoRA in kohya/PEFT/diffusers form has none)"
            )
        down, up, alpha, magnitude = _lowrank(adapter, ap, rank, svd, native)
        if base is None:
            modules.append(_unresolved(adapter, ap, down, up, alpha, to, component, native))
            modules[-1].magnitude = magnitude
            continue
        places = base.places(ap)
        if not places:
            raise ConverterError(
                f"{adapter.path}: module {native} lands on no tensor of the base (another model family or size?)"
            )
        if magnitude is not None and (len(places) > 1 or places[0].rows is not None):
            raise ConverterError(f"{adapter.path}: {native} is DoRA on a fused module that this base splits (or the "
                                 "reverse); a DoRA norm does not split by rows, so it is not converted")  # fmt: skip
        if len(places) > 1:  # a fused module onto separate base tensors: split by rows
            modules.extend(_split_modules(base, ap, places, down, up, alpha, native))
            continue
        place = places[0]
        comp, name = base.split_key(place.key, ap.param)
        comp = comp or _output_component(ap, component)
        module = LoraModule(comp, name, down, up, alpha, native, magnitude=magnitude)
        if place.rows is not None:  # a slice of a fused base tensor: fused with its siblings below
            fused.setdefault(place.key, []).append((place.rows, module))
        else:
            modules.append(module)
    for key, parts in fused.items():
        if not key.endswith(".weight"):  # OpenCLIP's in_proj_weight: no module of its own to name a LoRA after
            raise ConverterError(
                f"{adapter.path}: {parts[0][1].source} lands on rows of {key}, which has no module name a LoRA "
                "could be written under; give --base in diffusers layout (a pipeline folder) instead"
            )
        modules.append(_fuse(key, parts, base.rows(key)))  # type: ignore[union-attr]
    seen: dict[tuple, str] = {}
    for m in modules:
        ident = (m.component, m.name)
        if ident in seen:
            raise ConverterError(f"{adapter.path}: modules {seen[ident]} and {m.source} both land on {m.name}")
        seen[ident] = m.source
    return modules, svd


def _output_component(ap: AdapterPatch, component: str | None) -> str | None:
    return component or (None if ap.component in (None, "denoiser") and not ap.flat else ap.component)


def _unresolved(adapter, ap, down, up, alpha, to, component, native) -> LoraModule:
    """Without a base: dotted names are kept as they are; kohya's flattened names can only stay kohya."""
    if ap.flat and to != "kohya":
        raise ConverterError(
            f"{adapter.path}: kohya-style names are flattened ({native}) and cannot be turned back into module "
            "paths without the model: give --base (the model it was trained on) so they are looked up, not guessed"
        )
    comp = component
    if comp is None and ap.component is not None:
        comp = ap.component
        for prefix, name in NATIVE_COMPONENT.items():
            if (ap.native or "").startswith(prefix):
                comp = name
    prefix = native[: len(native) - len(ap.module)] if ap.flat and native.endswith(ap.module) else None
    return LoraModule(comp, ap.module, down, up, alpha, native, flat=ap.flat, prefix=prefix)


def _alpha(adapter: Adapter, ap: AdapterPatch, lora: LowRank) -> float:
    """The module's own alpha, such that scale = alpha / rank: the stored one, PEFT's (rank/alpha patterns),
    else scale · rank (diffusers metadata, rsLoRA; no alpha at all means alpha = rank)."""
    r = lora.rank
    if lora.alpha not in (None, 0.0):
        return float(lora.alpha)
    if adapter.format == "peft" and not adapter.config.get("use_rslora"):
        from converter.formats.peft import pattern_value

        alpha = adapter.config.get("lora_alpha", 8)
        return float(pattern_value(adapter.config.get("alpha_pattern") or {}, ap.module, alpha))
    meta = adapter.config.get("metadata", {}).get("lora_adapter_metadata")
    if meta and not ap.flat:  # diffusers' saved LoraConfig, per component prefix (§4)
        from converter.formats.peft import pattern_value

        config = json.loads(meta)
        prefix = (ap.native or "").split(".", 1)[0]
        get = lambda f: config.get(f"{prefix}.{f}", config.get(f))  # noqa: E731
        if get("lora_alpha") is not None and not get("use_rslora"):
            return float(pattern_value(get("alpha_pattern") or {}, ap.module, get("lora_alpha")))
    return float(r) if lora.scale == 1.0 else lora.scale * r


def _lowrank(adapter: Adapter, ap: AdapterPatch, rank: int | None, svd: dict, native: str):
    """(down, up, alpha, magnitude) of a patch: a LoRA as stored, or an SVD of any other delta when `rank` is
    given; `magnitude` is a DoRA module's per-output-channel magnitude (out,), else None."""
    patch = ap.patch
    if ap.stored_transposed:
        raise ConverterError(
            f"{adapter.path}: {native} is stored transposed (PEFT fan_in_fan_out, GPT-2 Conv1D); kohya and diffusers "
            "LoRAs have no such layout, so it is not converted"
        )
    magnitude = None
    if isinstance(patch, DoRA):
        magnitude = _magnitude(adapter, patch, native)
        patch = patch.lora
        if not (isinstance(patch, LowRank) and patch.mid is None and not patch.flip):
            raise ConverterError(f"{adapter.path}: {native} is DoRA on a {type(patch).__name__}; only DoRA on a plain "
                                 "LoRA is converted")  # fmt: skip
    if isinstance(patch, LowRank) and patch.flip:
        raise ConverterError(
            f"{adapter.path}: {native} is an embedding LoRA (lora_embedding_A/B), which has no kohya/diffusers form"
        )
    if isinstance(patch, LowRank) and patch.mid is None:
        return _raw(patch.down), _raw(patch.up), _alpha(adapter, ap, patch), magnitude
    if not isinstance(patch, DeltaPatch):
        raise ConverterError(
            f"{adapter.path}: {native} is a {type(patch).__name__} patch (a full replacement or token rows, e.g. "
            "PEFT modules_to_save / trainable tokens), not a low-rank delta; it has no LoRA form"
        )
    kind = {LoHa: "LoHa", LoKr: "LoKr", FullDelta: "a full delta", LowRank: "Tucker LoCon"}.get(
        type(patch), type(patch).__name__
    )
    if rank is None:
        raise ConverterError(
            f"{adapter.path}: {native} is {kind}, which has no exact LoRA form; pass --rank N to approximate every "
            "such module by an SVD of rank N (the reconstruction error is reported)"
        )
    down, up, error = svd_lowrank(patch.raw_delta().double(), rank)
    svd[native] = error
    return down, up, float(down.shape[0]), None  # alpha = rank: scale 1, the singular values live in up


def _raw(ref) -> torch.Tensor:
    """A tensor exactly as the file stores it (dtype included): conversion copies, it does not compute."""
    return ref.source.read(ref.name)


def _magnitude(adapter: Adapter, patch: DoRA, native: str) -> torch.Tensor:
    """A DoRA magnitude as PEFT's per-output-channel vector (out,). LyCORIS `dora_scale` (out, 1, ..) is the same
    numbers; the input-axis (1, in, ..) of older LyCORIS/OneTrainer files has no PEFT form (§3 DoRA, LyCORIS#216)."""
    out = patch.lora.natural_shape()[0]
    m = _raw(patch.magnitude)
    if patch.style == "lycoris" and m.dim() >= 2 and m.shape[0] == 1 and out != 1:
        raise ConverterError(
            f"{adapter.path}: {native} has an input-axis dora_scale {list(m.shape)} (older LyCORIS/OneTrainer DoRA); "
            "PEFT/diffusers/current LyCORIS DoRA is per output channel, so it cannot be converted exactly"
        )
    if m.numel() != out:
        raise ConverterError(f"{adapter.path}: {native}'s DoRA magnitude has shape {list(m.shape)}, expected {out}")
    return m.reshape(out)


def svd_lowrank(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Best rank-`rank` factors of ΔW (out, in, *k) by SVD of its (out, in·k) matrix, as sd-scripts'
    svd_merge_lora shapes them (§1), without its quantile clamp (it would add error): up = U·S, down = Vh.
    Returns (down, up, relative Frobenius error) with the error measured on the float32 factors."""
    shape = delta.shape
    mat = delta.reshape(shape[0], -1).double()
    r = max(1, min(rank, *mat.shape))
    u, s, vh = torch.linalg.svd(mat, full_matrices=False)
    up = (u[:, :r] * s[:r]).float()
    down = vh[:r].float()
    approx = up.double() @ down.double()
    norm = torch.linalg.norm(mat)
    error = float(torch.linalg.norm(mat - approx) / norm) if norm > 0 else 0.0
    if len(shape) > 2:
        down = down.reshape(r, *shape[1:])
        up = up.reshape(shape[0], r, *([1] * (len(shape) - 2)))
    return down.contiguous(), up.contiguous(), error


def _is_block_diagonal(up: torch.Tensor, rows: list[int]) -> bool:
    """Whether up (out, r) has part j's rows non-zero only in column block j (r / n columns each)."""
    n, r = len(rows), up.shape[1]
    if r % n:
        return False
    width, start = r // n, 0
    for j, size in enumerate(rows):
        block = up[start : start + size].flatten(1)
        if torch.count_nonzero(block[:, : j * width]) or torch.count_nonzero(block[:, (j + 1) * width :]):
            return False
        start += size
    return True


def _split_modules(base: _Base, ap, places, down, up, alpha, native) -> list[LoraModule]:
    """A fused module (BFL qkv, linear1) onto separate base tensors, ΔW unchanged: down split with the up when
    the up matrix is block-diagonal (kohya split_qkv), else shared by every part (lora-formats.md §4, §8)."""
    spans = [p.src for p in places]
    rows = [b - a for a, b in spans]
    block = _is_block_diagonal(up, rows)
    n, r = len(spans), down.shape[0]
    out = []
    for j, (place, (a, b)) in enumerate(zip(places, spans, strict=True)):
        comp, name = base.split_key(place.key, ap.param)
        if block:
            w = r // n
            d, u = down[j * w : (j + 1) * w], up[a:b, j * w : (j + 1) * w]
            part_alpha = alpha * w / r  # same scale alpha / r on a rank-w part
        else:
            d, u, part_alpha = down, up[a:b], alpha
        comp = comp or _output_component(ap, None)
        out.append(LoraModule(comp, name, d.clone(), u.clone(), part_alpha, f"{native}[{a}:{b}]"))
    return out


def _fuse(key: str, parts: list[tuple[tuple[int, int], LoraModule]], total_rows: int) -> LoraModule:
    """Separate modules (to_q/to_k/to_v) onto one fused base tensor (qkv): stacked downs and a block-diagonal up,
    ΔW unchanged. Equal scales stay in alpha; different ones are folded into each part's up block."""
    parts = sorted(parts, key=lambda p: p[0])
    first = parts[0][1]
    scales = {m.alpha / m.rank for _, m in parts}
    if len({tuple(m.down.shape[1:]) for _, m in parts}) != 1:
        raise ConverterError(f"modules {', '.join(m.source for _, m in parts)} onto {key} disagree in input shape")
    total = sum(m.rank for _, m in parts)
    # different scales are folded into float32 up blocks (folding in half precision would round twice)
    dtype = first.up.dtype if len(scales) == 1 and len({m.up.dtype for _, m in parts}) == 1 else torch.float32
    down = torch.cat([m.down.to(dtype) for _, m in parts])
    up = torch.zeros(total_rows, total, *first.up.shape[2:], dtype=dtype)
    col = 0
    for (a, b), m in parts:
        block = m.up.to(dtype) if len(scales) == 1 else m.up.float() * (m.alpha / m.rank)
        up[a:b, col : col + m.rank] = block
        col += m.rank
    alpha = scales.pop() * total if len(scales) == 1 else float(total)
    name = first.name
    return LoraModule(first.component, name, down, up, alpha, "+".join(m.source for _, m in parts))


# --- command line and pull requests -----------------------------------------------------------------------------


def run_cli(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    """`converter convert`: to --out, or (--push-pr) into a temp folder and a PR on the adapter's repo."""
    options = dict(base=args.base, rank=args.rank, component=args.component, token=args.token,
                   allow_pickle=args.allow_pickle, log=log, lora_alpha=args.lora_alpha)  # fmt: skip
    if args.rank is not None and args.rank < 1:
        raise ConverterError(f"--rank {args.rank}: give a positive rank")
    if args.push_pr and args.out:
        raise ConverterError("give --out or --push-pr, not both (--push-pr writes into a temporary folder)")
    if not args.push_pr:
        if not args.out:
            raise ConverterError("give --out (a folder, or a .safetensors file for --to kohya), or --push-pr")
        convert(args.adapter, args.to, args.out, force=args.force, **options)
        return 0
    result = push_pr(args.adapter, args.to, **options)
    if result is None:
        return 0
    print(f"pull request: {result}")
    return 0


PR_TITLE = "Add a {fmt} version of this adapter (converter)"
TARGET_NAMES = {"peft": "PEFT", "diffusers": "diffusers", "kohya": "kohya"}


def push_pr(
    adapter_spec: str,
    to: str,
    *,
    base: str | None = None,
    rank: int | None = None,
    component: str | None = None,
    token: str | None = None,
    allow_pickle: bool = False,
    log: Callable[[str], None] = print,
    lora_alpha: float | None = None,
) -> str | None:
    """Open a pull request on the adapter's own Hub repo adding the converted files, like the safetensors
    conversion bot (shared/reference/hub-protocol.md): our open PR with the same title is updated instead of
    opening another, and a repo that already has the target format gets none. Returns the PR's URL or None."""
    from converter import hub
    from converter.publish import _our_open_pr
    from converter.sources import parse_source

    source = parse_source(adapter_spec)
    if source.repo_id is None:
        raise ConverterError(f"--push-pr: {adapter_spec} is local; give the adapter as a Hub id org/name[/file]")
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    repo = source.repo_id
    me = hub.whoami(token)
    info = hub.call(repo, lambda: api.model_info(repo, revision=source.revision or "main"))
    names = [s.rfilename for s in info.siblings or []]
    folder = source.path.rsplit("/", 1)[0] + "/" if source.path and "/" in source.path else ""
    if (have := _has_format(api, repo, info.sha, names, to)) is not None:
        log(f"{repo} already has a {TARGET_NAMES[to]} version ({have}); no pull request opened")
        return None
    title = PR_TITLE.format(fmt=TARGET_NAMES[to])
    with tempfile.TemporaryDirectory(prefix="converter-convert-") as scratch:
        stem = Path(source.path).stem if source.path else "adapter"
        out = Path(scratch) / (f"{stem}_kohya.safetensors" if to == "kohya" else "out")
        result = convert(adapter_spec, to, out, base=base, rank=rank, component=component, token=token,
                         allow_pickle=allow_pickle, log=log, lora_alpha=lora_alpha)  # fmt: skip
        paths = [out] if out.is_file() else sorted(p for p in out.rglob("*") if p.is_file())
        ops = [
            CommitOperationAdd(
                path_in_repo=folder + (p.name if p == out else p.relative_to(out).as_posix()), path_or_fileobj=p
            )
            for p in paths
        ]
        description = _pr_description(adapter_spec, to, info.sha, result, base)
        open_pr = _our_open_pr(api, repo, me, title)
        if open_pr is not None:
            log(f"updating our open pull request #{open_pr.num}")
        commit = hub.call(
            repo,
            lambda: api.create_commit(
                repo,
                ops,
                commit_message=title,
                commit_description=description,
                revision=open_pr.git_reference if open_pr is not None else None,
                create_pr=open_pr is None,
            ),
        )
    endpoint = api.endpoint.rstrip("/")
    return commit.pr_url or f"{endpoint}/{repo}/discussions/{open_pr.num}"


def _pr_description(spec: str, to: str, sha: str, result: ConvertResult, base: str | None) -> str:
    alphas = "a real `.alpha` per module" if to == "kohya" else "`rank_pattern` / `alpha_pattern` (nothing folded)"
    lines = [
        f"This PR adds a {TARGET_NAMES[to]} version of `{spec}` (commit {sha[:10]}), converted by converter "
        "without merging.",
        "",
        f"- {result.modules} LoRA modules, each with its own rank and alpha ({alphas}).",
        f"- Files: {', '.join(result.files)}.",
    ]
    if base:
        lines.append(f"- Module names were looked up in `{base}`.")
    if result.svd_errors:
        lines.append(f"- Approximated by SVD: max relative error {max(result.svd_errors.values()):.2e}.")
    return "\n".join(lines) + "\n"


def _has_format(api, repo: str, sha: str, names: list[str], to: str) -> str | None:
    """The file that shows the repo already has format `to` (a PEFT adapter_config.json, or a safetensors file
    whose tensor names are kohya's or diffusers'), read from headers only."""
    from converter import hub

    if to == "peft":
        return next((n for n in names if n.rsplit("/", 1)[-1] == "adapter_config.json"), None)
    for name in [n for n in names if n.endswith(".safetensors")][:32]:
        meta = hub.call(name, lambda name=name: api.parse_safetensors_file_metadata(repo, name, revision=sha))
        keys = list(meta.tensor_info) if hasattr(meta, "tensor_info") else list(meta.tensors)
        if to == "kohya" and any(
            k.startswith(("lora_unet_", "lora_te")) and k.endswith(".lora_down.weight") for k in keys
        ):
            return name
        if to == "diffusers" and any(
            k.startswith(("unet.", "transformer.", "text_encoder")) and k.endswith(".lora_A.weight") for k in keys
        ):
            return name
    return None


# --- writers ----------------------------------------------------------------------------------------------------


def write(
    modules: list[LoraModule],
    to: str,
    out: Path,
    *,
    force: bool = False,
    source: dict | None = None,
    base_model: str | None = None,
    svd: dict[str, float] | None = None,
    components: set[str] | None = None,
) -> list[str]:
    """Write `modules` in format `to` at `out` (a file for kohya, a folder otherwise), atomically. `components`:
    the base's parts, so a kohya file for a two-encoder model says lora_te1_ even when only one is adapted."""
    if not modules:
        raise ConverterError("the adapter has no LoRA modules to convert")
    info = {**(source or {}), "tool": "converter"}
    if svd:
        info["svd_relative_errors"] = {k: round(v, 8) for k, v in sorted(svd.items())}
    if to == "kohya":
        tensors, meta = kohya_tensors(modules, info, components or set())
        _atomic_file(out, tensors, meta, force)
        return [out.name]
    from converter.writer import atomic_folder

    with atomic_folder(out, force) as tmp:
        writer = write_peft if to == "peft" else write_diffusers
        return writer(modules, tmp, info, base_model)


def _atomic_file(out: Path, tensors: dict, metadata: dict, force: bool) -> None:
    from safetensors.torch import save_file

    if out.exists() and not force:
        raise ConverterError(f"{out}: output already exists (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _most_common(values: list) -> object:
    return Counter(values).most_common(1)[0][0]


def kohya_prefix(component: str | None, components: set) -> str:
    """sd-scripts' prefixes: lora_unet for every denoiser, lora_te for a single text encoder, lora_te1/2/3 when
    there are several (lora-formats.md §1)."""
    if component in KOHYA_PREFIX:
        return KOHYA_PREFIX[component]
    if component == "text_encoder":
        return "lora_te1_" if components & {"text_encoder_2", "text_encoder_3"} else "lora_te_"
    if component and component.startswith("text_encoder_"):
        return f"lora_te{component.rsplit('_', 1)[1]}_"
    raise ConverterError(
        "cannot tell which part of the model the adapter is for (kohya names start with lora_unet_ or lora_te_): "
        "pass --component unet|transformer|text_encoder|text_encoder_2"
    )


def kohya_tensors(modules: list[LoraModule], info: dict, base_components: set[str] = frozenset()) -> tuple[dict, dict]:
    """`<prefix><flattened path>.lora_down.weight / .lora_up.weight / .alpha` with the module's real alpha."""
    components = {m.component for m in modules} | set(base_components)
    out: dict[str, torch.Tensor] = {}
    for m in modules:
        name = m.name
        if not m.flat and (m.component or "").startswith("text_encoder") and KOHYA_TEXT_MODEL.match(name):
            name = "text_model." + name
        name = name if m.flat else flatten(name)
        stem = (m.prefix or kohya_prefix(m.component, components)) + name
        if f"{stem}.lora_down.weight" in out:
            raise ConverterError(f"two modules flatten to the same kohya name {stem}")
        out[f"{stem}.lora_down.weight"] = m.down
        out[f"{stem}.lora_up.weight"] = m.up
        out[f"{stem}.alpha"] = torch.tensor(m.alpha, dtype=torch.float32)
        if m.magnitude is not None:  # LyCORIS dora_scale, output axis (out, 1, ..) as wd_on_out writes it (§3)
            out[f"{stem}.dora_scale"] = m.magnitude.reshape(-1, *([1] * (m.down.dim() - 1))).contiguous()
    meta = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(_most_common([m.rank for m in modules])),
        "ss_network_alpha": str(_most_common([m.alpha for m in modules])),
        "converter_alphas": "per module, in each .alpha tensor (scale = alpha / rank)",
        "converter": json.dumps(info, sort_keys=True),
    }
    return out, meta


def lora_config(modules: list[LoraModule]) -> dict:
    """PEFT LoraConfig fields for these modules: the most common rank and alpha, the others as patterns (full
    module paths; PEFT matches `(.*\\.)?(key)$`, §7)."""
    r = _most_common([m.rank for m in modules])
    alpha = _most_common([m.alpha for m in modules])
    rank_pattern = {m.name: m.rank for m in modules if m.rank != r}
    alpha_pattern = {m.name: m.alpha for m in modules if m.alpha != alpha}
    alpha = int(alpha) if float(alpha).is_integer() else alpha
    dora = {m.magnitude is not None for m in modules}
    if len(dora) > 1:
        raise ConverterError(
            "some modules are DoRA and some are not; PEFT's use_dora applies to every module, so this mix has no "
            "PEFT/diffusers form (convert to kohya instead)"
        )
    return {
        "r": r,
        "lora_alpha": alpha,
        "rank_pattern": rank_pattern,
        "alpha_pattern": {k: int(v) if float(v).is_integer() else v for k, v in alpha_pattern.items()},
        "target_modules": sorted(m.name for m in modules),
        "use_rslora": False,
        "use_dora": dora == {True},
        "lora_bias": False,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
    }


def peft_magnitude(m: LoraModule) -> torch.Tensor:
    """PEFT's layout of a DoRA magnitude: (out,) for a linear layer, (1, out, 1, 1) for a conv (§7)."""
    if m.down.dim() > 2:
        return m.magnitude.reshape(1, -1, *([1] * (m.down.dim() - 2))).contiguous()
    return m.magnitude.contiguous()


def write_peft(modules: list[LoraModule], folder: Path, info: dict, base_model: str | None) -> list[str]:
    """A PEFT folder per component (the folder itself when there is one): adapter_config.json + weights."""
    from safetensors.torch import save_file

    groups: dict[str | None, list[LoraModule]] = {}
    for m in modules:
        groups.setdefault(m.component, []).append(m)
    files = []
    for comp, mods in sorted(groups.items(), key=lambda g: str(g[0])):
        sub = folder if len(groups) == 1 else folder / str(comp)
        sub.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": "LORA",
            "task_type": None,
            "base_model_name_or_path": base_model,
            "inference_mode": True,
            **lora_config(mods),
            "modules_to_save": None,
        }
        (sub / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {}
        for m in mods:
            tensors[f"base_model.model.{m.name}.lora_A.weight"] = m.down.contiguous()
            tensors[f"base_model.model.{m.name}.lora_B.weight"] = m.up.contiguous()
            if m.magnitude is not None:
                # the key PEFT 0.21 itself saves (no `.weight`; its loader takes both, §7)
                tensors[f"base_model.model.{m.name}.lora_magnitude_vector"] = peft_magnitude(m)
        meta = {"format": "pt", "converter_alphas": "rank_pattern / alpha_pattern in adapter_config.json (not folded)",
                "converter": json.dumps(info, sort_keys=True)}  # fmt: skip
        save_file(tensors, sub / "adapter_model.safetensors", metadata=meta)
        prefix = "" if sub == folder else f"{comp}/"
        files += [f"{prefix}adapter_config.json", f"{prefix}adapter_model.safetensors"]
    return files


def write_diffusers(modules: list[LoraModule], folder: Path, info: dict, base_model: str | None = None) -> list[str]:
    """diffusers' own layout (what `save_lora_weights` writes): `<component>.<module>.lora_A/B.weight` and the
    LoraConfig of each component in `lora_adapter_metadata`, with per-module rank/alpha patterns (§4)."""
    from safetensors.torch import save_file

    groups: dict[str, list[LoraModule]] = {}
    for m in modules:
        if m.component is None:
            raise ConverterError(
                "diffusers LoRA keys start with the pipeline component (unet., transformer., text_encoder.): "
                "pass --component to say which one this adapter is for"
            )
        if m.component == "denoiser":
            raise ConverterError(
                f"{m.source}: these are the original model's module names (LDM/BFL/...), not diffusers': give --base "
                "as a diffusers pipeline folder so they are looked up under diffusers' names"
            )
        groups.setdefault(m.component, []).append(m)
    tensors, packed = {}, {}
    for comp, mods in groups.items():
        for m in mods:
            tensors[f"{comp}.{m.name}.lora_A.weight"] = m.down.contiguous()
            tensors[f"{comp}.{m.name}.lora_B.weight"] = m.up.contiguous()
            if m.magnitude is not None:
                tensors[f"{comp}.{m.name}.lora_magnitude_vector"] = peft_magnitude(m)
        packed.update({f"{comp}.{k}": v for k, v in lora_config(mods).items()})
    meta = {
        "format": "pt",
        "lora_adapter_metadata": json.dumps(packed, sort_keys=True),
        "converter_alphas": "rank_pattern / alpha_pattern in lora_adapter_metadata (not folded)",
        "converter": json.dumps(info, sort_keys=True),
    }
    save_file(tensors, folder / DIFFUSERS_FILE, metadata=meta)
    return [DIFFUSERS_FILE]


__all__ = ["TARGETS", "ConvertResult", "LoraModule", "collect", "convert", "svd_lowrank", "write"]
