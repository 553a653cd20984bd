"""The Space's "Check" step: what a job would do (formats, coverage, bytes, warnings) before any weight is fetched.

A Hub base is planned from its safetensors headers alone (converter.hub.remote_headers: sparse stand-in files of the
real size), so the merge planner sees exactly the names, shapes and byte ranges it will see after the download,
while the disk holds only the headers. Adapters are small and are fetched. The same headers say what the job needs
(converter.jobs.fit): a job this Space's machine cannot hold is offered on Hugging Face Jobs instead.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from converter.engine.base_reader import open_base
from converter.engine.checkpoint import Checkpoint
from converter.engine.plan import plan_merge
from converter.engine.recipe import Recipe
from converter.errors import CheckpointError, UsageError
from converter.formats import load_adapter
from converter.hub.hf_jobs import hardware
from converter.hub.remote_headers import hub_base_headers
from converter.hub.remote_headers import write_standin as _sparse_standin  # noqa: F401 - the name tests/app/test_app_jobs.py uses
from converter.hub.sources import fetch, parse_source
from converter.io.units import human_bytes, parse_size
from converter.jobs import fit
from converter.jobs.fit import Estimate, Machine
from converter.jobs.shape import BaseHeaders, shape_of


def space_machine(workroot: str | Path | None = None) -> Machine:
    """This Space's machine as one job gets it: the free disk where jobs run (at most CONVERTER_APP_MAX_DISK), the
    memory available now and the cores, the disk and memory shared by the jobs that run at once
    (CONVERTER_APP_CONCURRENCY). What a job needs is estimated against this, not against fixed limits."""
    share = max(1, int(os.environ.get("CONVERTER_APP_CONCURRENCY", "1")))
    cap = os.environ.get("CONVERTER_APP_MAX_DISK")
    machine = fit.here(workroot, max_disk=parse_size(cap) if cap else None)
    return replace(machine, name="this Space", disk=machine.disk // share, memory=machine.memory // share)


@dataclass
class CheckReport:
    base: dict
    adapters: list[dict]
    bytes_to_download: int
    bytes_to_write: int
    changed_tensors: int
    total_tensors: int
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # diffusion bases: component -> tensors the adapters change in it (the VAE, untouched, is a byte copy)
    changed_by_component: dict[str, int] = field(default_factory=dict)
    fit: Estimate | None = None  # the job on this Space's machine
    jobs: Estimate | None = None  # where it does not fit: the cheapest Hugging Face Jobs flavor that does

    @property
    def fits(self) -> bool:
        return self.fit is None or self.fit.fits

    def markdown(self) -> str:
        b = self.base
        lines = [
            f"**Base** `{b['pinned']}`: {b['architecture']} ({b['model_type']}), "
            f"{b['parameters'] / 1e6:,.1f} M parameters, {human_bytes(b['size'])}",
            "",
        ]
        if b.get("family"):
            changed = ", ".join(f"{c} {self.changed_by_component.get(c, 0)}" for c in b["components"])
            lines += [f"**Diffusion family** `{b['family']}` · components (tensors changed): {changed}", ""]
        # One line per adapter, not an 8-column table: the plan sits in half the page's width, where such a
        # table squeezed each cell to a word per line.
        lines.append("**Adapters**")
        lines.append("")
        for i, a in enumerate(self.adapters, 1):
            lines.append(
                f"{i}. `{_short(a['pinned'])}`: weight {weight_text(a['weight'])} · {a['format']} · rank {a['rank']}"
                f" · alpha {'per module' if a['alpha'] is None else a['alpha']} · DoRA {'yes' if a['dora'] else 'no'}"
                f" · **{a['used']}/{a['tensors']}** tensors matched"
            )
        lines += [
            "",
            f"**Download** {human_bytes(self.bytes_to_download)} · **write** {human_bytes(self.bytes_to_write)} · "
            f"{self.changed_tensors} of {self.total_tensors} tensors change",
        ]
        lines += self._fit_lines()
        lines += [f"\n- ⚠️ warning: {w}" for w in self.warnings]
        lines += [f"\n- note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _fit_lines(self) -> list[str]:
        e = self.fit
        if e is None:
            return []
        needs = (
            f"disk {human_bytes(e.disk)} of {human_bytes(e.machine.disk)} free · memory "
            f"{human_bytes(e.memory)} of {human_bytes(e.machine.memory)} · about {fit.duration(e.seconds)}"
        )
        if e.fits:
            return ["", f"**Fits this Space** ({'streamed' if e.streamed else 'whole'}: {e.why}) · {needs}"]
        lines = ["", f"**Too big for this Space**: {e.short}"]
        if self.jobs is not None:
            j = self.jobs
            lines.append(
                f"\n**Run it on Hugging Face Jobs** with your account (PRO or an organization with credits): "
                f"`{j.machine.name}`, about {fit.duration(j.seconds)}, {fit.money(j.usd)} (tick *Run on Hugging "
                "Face Jobs*)"
            )
        return lines


def weight_text(weight) -> str:
    """0.8, or per component `unet=0.8, text_encoder=0.5` (as typed in the form)."""
    return ", ".join(f"{k}={v}" for k, v in weight.items()) if isinstance(weight, dict) else str(weight)


def _short(pinned: str) -> str:
    """`org/name@<40 hex>/file` -> `org/name@1234567/file`: tables stay readable; the full sha is in the card."""
    return re.sub(r"@([0-9a-f]{7})[0-9a-f]{33}", r"@\1", pinned)


def describe_base(spec: str, token: str | None, workdir: Path) -> dict:
    """A Hub base model from its config and safetensors headers: exists, architecture, size. No weights fetched."""
    source = parse_source(spec)
    if source.local is not None or (source.path is not None and not source.path.endswith(".safetensors")):
        raise UsageError(
            f"{spec}: give the base as a Hub repo id, org/name[@revision], or a single-file diffusion checkpoint "
            "org/name/file.safetensors"
        )
    base = hub_base_headers(source, token, workdir)
    checkpoint = open_base(base.path)  # a transformers folder, a diffusers pipeline or one single file
    config = checkpoint.config
    if config.get("quantization_config"):
        raise CheckpointError(
            f"{base.where}: a pre-quantized ({config['quantization_config'].get('quant_method', '?')}) checkpoint; "
            "use the original full-precision model it was made from (its card's base_model)",
            file=spec,
        )
    params = sum(checkpoint.info(n).numel for n in checkpoint.names())
    return {
        "pinned": base.pinned,
        "sha": base.sha,
        "architecture": config.get("_class_name") or (config.get("architectures") or ["?"])[0],
        "model_type": config.get("model_type") or config.get("_keymap"),
        "family": config.get("_keymap") if getattr(checkpoint, "diffusion", None) else None,
        "components": [p.subfolder or p.stem for p in getattr(checkpoint, "parts", ())],
        "parameters": params,
        "size": sum(base.sizes[n] for n in base.files if n.endswith(".safetensors")),
        "download": sum(base.sizes[n] for n in base.files),
        "checkpoint": checkpoint,
        "path": base.path,  # the stand-ins, which the estimate reads too
        "side": sum(base.sizes[n] for n in base.files if not n.endswith(".safetensors")),
    }


def describe_adapter(spec: str, token: str | None) -> dict:
    """Fetch an adapter (small) and say what it is: format, rank, alpha, DoRA, tensors, trained-on base."""
    fetched = fetch(spec, "adapter", token)
    adapter = load_adapter(fetched.local)
    s = adapter.summary
    ranks = s.get("ranks") or [s.get("r")]
    return {
        "pinned": fetched.pinned,
        "format": adapter.format,
        "rank": ", ".join(map(str, ranks)),
        "alpha": s.get("lora_alpha"),
        "dora": bool(s.get("use_dora")),
        "tensors": len(adapter.tensors.names()),
        "trained_on": adapter.base_model,
        "download": sum(f["size"] or 0 for f in fetched.files),
        "adapter": adapter,
        "card": fetched.card,
    }


def check(
    recipe: Recipe, token: str | None, workdir: Path, machine: Machine | None = None, verify: dict | None = None
) -> CheckReport:
    """Plan the job without fetching base weights; raise ConverterError for anything that would make it fail. Its
    disk, memory and time on `machine` (default: this Space's) say whether it fits here; where it does not, the
    report names the Hugging Face Jobs flavor that fits. `verify`: the job's verification settings (None: off)."""
    base = describe_base(recipe.base, token, workdir)
    adapters = [describe_adapter(spec.source, token) for spec in recipe.adapters]
    checkpoint: Checkpoint = base["checkpoint"]
    pairs = [(a["adapter"], spec) for a, spec in zip(adapters, recipe.adapters, strict=True)]
    plan, warnings, _ = plan_merge(recipe, checkpoint, pairs, [a["card"] for a in adapters], base_id=base["pinned"])
    download = base["download"] + sum(a["download"] for a in adapters)
    rows = []
    for a, spec, cov in zip(adapters, recipe.adapters, plan.coverage, strict=True):
        rows.append(
            {
                **{k: a[k] for k in ("pinned", "format", "rank", "alpha", "dora", "trained_on")},
                "weight": spec.weight,
                "tensors": cov.total,
                "used": cov.used,
            }
        )
    base_row = {k: v for k, v in base.items() if k not in ("checkpoint", "path", "side")}
    shape = shape_of(recipe, verify, token, workdir, BaseHeaders(base["path"], base["side"], True))
    here = fit.estimate(shape, machine or space_machine())
    jobs = None if here.fits else fit.best_flavor(fit.on_jobs(shape, hardware(token)))
    return CheckReport(
        base=base_row,
        adapters=rows,
        bytes_to_download=download,
        bytes_to_write=plan.bytes_to_write,
        changed_tensors=len(plan.changed),
        total_tensors=len(plan.outputs),
        warnings=warnings,
        notes=list(plan.notes),
        changed_by_component=_by_component(plan.changed, base_row["components"]) if base_row["family"] else {},
        fit=here,
        jobs=jobs,
    )


def _by_component(changed: list, components: list[str]) -> dict[str, int]:
    """Changed output tensors per component: `unet/...` keys of a pipeline; a single file counts as one part."""
    counts = dict.fromkeys(components, 0)
    for out in changed:
        head = out.name.split("/", 1)[0]
        head = head if head in counts else components[0]
        counts[head] += 1
    return counts
