"""`extract()`: a LoRA from a fine-tuned model, one base/tuned tensor pair at a time.

For every weight matrix (linear, or a conv kernel seen as (out, in·k·k)) that differs, ΔW = tuned − base is
factored by a float32 SVD, truncated to the rank the rule picks (converter.methods.ranks, capped by --rank), and
written as a LoRA with √S in both factors (mergekit-extract-lora's `--distribute-scale`) and scale 1
(alpha = rank; PEFT's `rank_pattern`/`alpha_pattern` where modules differ). Each module's relative error
‖ΔW − ΔW_r‖/‖ΔW‖ is measured on the float32 factors, with the energy ΣS²(kept)/ΣS² they retain.
Embeddings, norms, biases and tensors whose shape changed (a resized vocabulary) have no sensible low-rank form:
their modules are saved whole (PEFT `modules_to_save`, as mergekit does without `--embed-lora`), or refused.
Only one pair of tensors, its ΔW and its SVD are in memory at once; the output adapter is held until written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from converter.conversion.core import check_output_path
from converter.conversion.modules import LoraModule
from converter.conversion.writers import write, write_peft
from converter.engine.base_reader import open_base
from converter.engine.keymap import keymap_for
from converter.engine.writer import atomic_folder
from converter.errors import CheckpointError, UsageError
from converter.hub.sources import HUB_SPEC, fetch
from converter.methods.options import ExtractOptions
from converter.methods.ranks import choose_rank, retained_energy

# module names that are embeddings (a lookup table, not a linear map): token and position tables
EMBEDDING = re.compile(
    r"(^|\.)(embed_tokens|embed_positions|wte|wpe|shared|word_embeddings|position_embeddings|token_type_embeddings"
    r"|token_embedding|position_embedding|embeddings)$"
)


@dataclass
class ExtractResult:
    out: Path
    files: list[str]
    modules: int
    saved: list[str] = field(default_factory=list)  # modules saved whole (modules_to_save)
    report: dict = field(default_factory=dict)  # module -> {rank, relative_error, retained_energy}
    notes: list[str] = field(default_factory=list)


def extract_factors(
    delta: torch.Tensor, cap: int, rule: str = "fixed", param: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(down, up, facts) of ΔW (out, in, *k): √S in both factors, shaped for a (conv) LoRA; facts has the rank,
    the measured relative error of the float32 factors and the retained energy."""
    shape = delta.shape
    mat = delta.reshape(shape[0], -1).float()
    u, s, vh = torch.linalg.svd(mat, full_matrices=False)
    r = choose_rank(s, cap, rule, param)
    root = s[:r].sqrt()
    up, down = (u[:, :r] * root).contiguous(), (root[:, None] * vh[:r]).contiguous()
    exact = mat.double()
    norm = float(torch.linalg.norm(exact))
    error = float(torch.linalg.norm(exact - up.double() @ down.double())) / norm if norm > 0 else 0.0
    facts = {"rank": r, "relative_error": error, "retained_energy": retained_energy(s, r)}
    if len(shape) > 2:
        down = down.reshape(r, *shape[1:])
        up = up.reshape(shape[0], r, *([1] * (len(shape) - 2)))
    return down, up, facts


def extract(
    base: str,
    tuned: str,
    out: str | Path,
    options: ExtractOptions,
    *,
    token: str | None = None,
    log: Callable[[str], None] = print,
) -> ExtractResult:
    """Extract a LoRA adapter from `tuned` relative to `base` and write it at `out` as `options` say."""
    o = options
    keep = _filter(list(o.include), list(o.exclude))
    out = Path(out)
    check_output_path(out, o.to, o.force)
    fetched = {}
    for role, spec in (("base", base), ("tuned", tuned)):
        fetched[role] = fetch(spec, "model", token)
    b, t = open_base(fetched["base"].local), open_base(fetched["tuned"].local)
    keys = _compared_keys(b, t, tuned, keep)
    whole = _whole_modules(b, t, keys)
    if whole and (not o.modules_to_save or o.to != "peft"):
        first = next(iter(whole.values()))
        why = "--no-modules-to-save" if not o.modules_to_save else f"--to {o.to} has no form for them (use --to peft)"
        raise CheckpointError(
            f"{tuned}: {first} differs and has no low-rank form (an embedding, norm or bias); {len(whole)} such "
            f"module(s) would be saved whole, but {why}, or --exclude them",
            file=tuned,
        )
    modules, saved, report = _factored(b, t, keys, whole, o.rank, o.rule, o.param)
    if not modules:
        where = " (after --include/--exclude)" if o.include or o.exclude else ""
        raise CheckpointError(f"{tuned}: no weight matrix differs from the base{where}; nothing to extract", file=tuned)
    files = _write(modules, saved, o.to, out, o.force, fetched, report, base)
    notes = _summary(report, saved)
    for note in notes:
        log(f"note: {note}")
    log(f"wrote {out}: {len(modules)} LoRA modules extracted as {o.to} ({', '.join(files)})")
    names = [f"{c}/{m}" if c else m for c, m in saved]
    return ExtractResult(out, files, len(modules), names, report, notes)


def _compared_keys(b, t, tuned: str, keep: Callable[[str], bool]) -> list[str]:
    """The tuned model's keys to compare (those `keep` lets through); refused unless both models share a layout
    and the base holds every one of them."""
    if b.diffusion != t.diffusion:
        raise CheckpointError(
            f"{tuned}: is a {t.diffusion or 'transformers'} checkpoint, the base a {b.diffusion or 'transformers'} "
            "one; give both in the same layout",
            file=tuned,
        )
    base_keys = set(b.names())
    keys = [k for k in t.names() if keep(k)]
    missing = [k for k in keys if k not in base_keys]
    if missing:
        raise CheckpointError(
            f"{tuned}: tensor {missing[0]} is not in the base ({len(missing)} such): another architecture? "
            "(--exclude them if they are new layers you do not want)",
            file=tuned,
            tensor=missing[0],
        )
    _refuse_transposed(b, keys)
    return keys


def _factored(b, t, keys: list[str], whole: dict, rank: int, rule: str, param: float | None):
    """(the LoRA module of each changed weight, the tensors of modules saved whole, each weight's SVD facts)."""
    modules: list[LoraModule] = []
    saved: dict[tuple, dict[str, torch.Tensor]] = {}
    report: dict[str, dict] = {}
    for key in keys:
        comp, module, param_name = _split(key)
        if (comp, module) in whole:
            saved.setdefault((comp, module), {})[param_name] = t.read(key)
            continue
        if param_name != "weight":
            continue  # an unchanged bias (a changed one put the module in `whole`)
        delta = t.read(key).float() - b.read(key).float()
        if not torch.count_nonzero(delta):
            continue
        down, up, facts = extract_factors(delta, rank, rule, param)
        modules.append(LoraModule(comp, module, down, up, float(facts["rank"]), key))
        report[key] = facts
    return modules, saved, report


def _refuse_transposed(b, keys: list[str]) -> None:
    """Weights stored (in, out) (GPT-2's Conv1D) would need PEFT's fan_in_fan_out, which no writer produces."""
    if b.diffusion:
        return

    keymap = keymap_for(b.config)
    transposed = [k for k in keys if keymap.is_stored_transposed(k)]
    if transposed:
        raise CheckpointError(
            f"{transposed[0]} is stored transposed ({keymap.name} Conv1D, {len(transposed)} such): its LoRA would "
            "need PEFT's fan_in_fan_out layout, which is not written; --exclude them to extract the rest",
            tensor=transposed[0],
        )


def _filter(include: list[str], exclude: list[str]) -> Callable[[str], bool]:
    try:
        inc = [re.compile(p) for p in include]
        exc = [re.compile(p) for p in exclude]
    except re.error as e:
        raise UsageError(f"--include/--exclude {e.pattern!r}: not a valid regex ({e.msg})") from None
    return lambda k: (not inc or any(p.search(k) for p in inc)) and not any(p.search(k) for p in exc)


def _split(key: str) -> tuple[str | None, str, str]:
    """(component, module, param) of a checkpoint key; diffusers folders spell keys `<component>/<key>`."""
    comp, _, rest = key.rpartition("/")
    module, _, param = rest.rpartition(".")
    return comp or None, module, param


def _whole_modules(b, t, keys: list[str]) -> dict[tuple, str]:
    """Modules to save whole, with the tensor that decides it: an embedding, a norm or bias that differs, or a
    tensor whose shape changed. Decided before any LoRA is made, so a module is never both (1-D tensors are
    read here, a few kilobytes each; an embedding is read once more later)."""
    out: dict[tuple, str] = {}
    for key in keys:
        comp, module, _ = _split(key)
        bi, ti = b.info(key), t.info(key)
        if tuple(bi.shape) != tuple(ti.shape):
            out[(comp, module)] = f"{key} (shape {list(bi.shape)} -> {list(ti.shape)})"
            continue
        if len(ti.shape) >= 2 and not EMBEDDING.search(module):
            continue
        if not torch.equal(b.read(key), t.read(key)):
            out[(comp, module)] = key
    return out


def _write(modules, saved, to, out, force, fetched, report, base_spec) -> list[str]:
    source = {"extracted_from": {r: (f.pinned if f.sha else Path(f.local).name) for r, f in fetched.items()}}
    svd = {k: v["relative_error"] for k, v in report.items()}
    base_model = _public_base(base_spec)
    if not saved:
        return write(modules, to, out, force=force, source=source, base_model=base_model, svd=svd)
    info = {**source, "tool": "converter", "svd_relative_errors": {k: round(v, 8) for k, v in sorted(svd.items())}}
    with atomic_folder(out, force) as tmp:
        files = write_peft(modules, tmp, info, base_model)
        _add_saved(tmp, modules, saved)
    return files


def _public_base(spec: str) -> str | None:
    """The base to record in adapter_config.json: a Hub id, never a local path (outputs may be published)."""
    if not Path(spec).expanduser().exists() and (m := HUB_SPEC.match(spec)):
        return m["repo"]
    return None


def _add_saved(folder: Path, modules: list[LoraModule], saved: dict) -> None:
    """Add modules saved whole to the PEFT folder(s): their tensors under the module's own key, as PEFT saves
    modules_to_save, and their names in `modules_to_save`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    components = {m.component for m in modules}
    for comp, module in saved:
        if comp not in components:
            raise UsageError(
                f"{comp}/{module}: differs, but no other module of {comp} does; extract that component alone "
                "(--include) or --exclude it"
            )
    for comp in components:
        sub = folder if len(components) == 1 else folder / str(comp)
        extra = {f"base_model.model.{module}.{p}": v.contiguous()
                 for (c, module), params in saved.items() if c == comp for p, v in params.items()}  # fmt: skip
        if not extra:
            continue
        weights = sub / "adapter_model.safetensors"
        with safe_open(weights, "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        save_file({**tensors, **extra}, weights, metadata=meta)
        config_path = sub / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["modules_to_save"] = sorted(module for c, module in saved if c == comp)
        config_path.write_text(json.dumps(config, indent=2) + "\n")


def _summary(report: dict, saved: dict) -> list[str]:
    errors = {k: v["relative_error"] for k, v in report.items()}
    worst = max(errors, key=errors.get)
    ranks = sorted({v["rank"] for v in report.values()})
    notes = [f"{len(report)} modules at rank {ranks[0]}" + (f"..{ranks[-1]}" if len(ranks) > 1 else "") +
             f": relative error ‖ΔW − ΔW_r‖/‖ΔW‖ max {errors[worst]:.3e} ({worst}), mean "
             f"{sum(errors.values()) / len(errors):.3e}; retained energy min "
             f"{min(v['retained_energy'] for v in report.values()):.6f}"]  # fmt: skip
    if saved:
        names = ", ".join(f"{c}/{m}" if c else m for c, m in list(saved)[:4])
        notes.append(f"{len(saved)} modules differ but have no low-rank form, saved whole (modules_to_save): "
                     f"{names}{' ...' if len(saved) > 4 else ''}")  # fmt: skip
    return notes
