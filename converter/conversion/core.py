"""`convert()`: fetch the adapter, look its names up, write the target format atomically."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from converter.conversion.modules import LoraModule
from converter.conversion.names import BaseNames, base_names, collect
from converter.conversion.options import FILE_TARGETS, TARGETS, ConvertOptions
from converter.conversion.proof import Proof, prove, prove_on_base
from converter.conversion.writers import DOTTED_PREFIX, write
from converter.engine.family import identify
from converter.engine.writer import check_output_target
from converter.errors import BadInputError, OutputError, UsageError, VerificationFailed
from converter.formats import Adapter, load_adapter
from converter.hub.sources import HUB_SPEC, fetch
from converter.io.scratch import temp_folder


@dataclass
class ConvertResult:
    out: Path
    files: list[str]
    modules: int
    notes: list[str] = field(default_factory=list)
    svd_errors: dict[str, float] = field(default_factory=dict)
    read_back: Proof | None = None  # the output read back, its ΔW compared with the source's (None: verify=False)


def convert(
    adapter_spec: str,
    out: str | Path,
    options: ConvertOptions,
    *,
    token: str | None = None,
    log: Callable[[str], None] = print,
) -> ConvertResult:
    """Read the adapter at `adapter_spec` (local or Hub), convert it to format `options.to`, write `out`
    atomically; then (`options.verify`) read it back and prove each module's ΔW equals the source's
    (VerificationFailed if not: the wrong output is removed)."""
    o = options
    to, base = o.to, o.base
    if to not in TARGETS:
        raise UsageError(f"--to {to}: an adapter format is one of {', '.join(TARGETS)}")
    out = Path(out)
    check_output_path(out, to, o.force)
    fetched = fetch(adapter_spec, "adapter", token)
    adapter = load_adapter(fetched.local, allow_pickle=o.allow_pickle, lora_alpha=o.lora_alpha)
    if not base:
        _check_naming(adapter, to)
    with temp_folder("base-headers", log=log) as scratch:
        names = BaseNames(base_names(base, token, Path(scratch))) if base else None  # headers read here, kept
        base_view = names.naming_for(to) if names else None
        modules, svd = collect(adapter, base_view, to, rank=o.rank, component=o.component)
    if to == "peft" and names is not None:
        _check_peft_names(modules, names)
    notes = list(adapter.warnings)
    if svd:
        worst = max(svd, key=svd.get)
        notes.append(
            f"{len(svd)} modules (LoHa/LoKr/full/Tucker) approximated by SVD at rank {o.rank}: relative "
            f"reconstruction error ‖ΔW − ΔW_r‖/‖ΔW‖ max {svd[worst]:.3e} ({worst}), mean "
            f"{sum(svd.values()) / len(svd):.3e}"
        )
    source = {"converted_from": adapter.format, "source": fetched.pinned if fetched.sha else Path(adapter_spec).name}
    files = write(modules, to, out, force=o.force, source=source, base_model=_public_base(base, adapter), svd=svd,
                  components=base_view.components() if base_view else set(),
                  denoiser_prefix=_denoiser_prefix(adapter, names, to))  # fmt: skip
    for note in notes:
        log(f"note: {note}")
    log(f"wrote {out}: {len(modules)} LoRA modules as {to} ({', '.join(files)})")
    proof = _prove(adapter, out, svd, log, names) if o.verify else None
    return ConvertResult(out, files, len(modules), notes, svd, proof)


def _denoiser_prefix(adapter: Adapter, names: BaseNames | None, to: str) -> str:
    """What a ComfyUI file puts before the denoiser's names: the family keymap's target spelling (the base's
    family, else the adapter's), ComfyUI's own `diffusion_model.` by default."""
    keymap = names.keymap if names is not None else getattr(identify(adapter), "family", None)
    kind, _ = keymap.target(to) if keymap is not None else (None, None)
    return DOTTED_PREFIX.get(kind or "comfyui", "diffusion_model.")


def _check_peft_names(modules: list[LoraModule], names: BaseNames) -> None:
    """A PEFT folder loads onto diffusers' model of the family: refuse the original checkpoint's names where they
    differ from diffusers' (a single-file base of a family whose keymap writes PEFT files in the base's naming)."""
    original = next((m for m in modules if m.component == "denoiser"), None)
    if original is not None and not names.keymap.one_naming:
        raise BadInputError(
            f"{original.source}: on this single file it is {original.name}, the original {names.keymap.title} "
            "checkpoint's name, which diffusers' model (what a PEFT folder loads onto) does not have: give --base as "
            "a diffusers pipeline folder so each module is looked up under diffusers' names",
            tensor=original.source,
        )


def _check_naming(adapter: Adapter, to: str) -> None:
    """Without a base, names are kept as they are: refuse when the target reads the family's other naming."""
    identity = identify(adapter)
    if identity is None or identity.family is None or identity.naming is None:
        return
    _, wanted = identity.family.target(to)
    if wanted is not None and wanted != identity.naming:
        raise BadInputError(
            f"{adapter.path}: its modules have {identity.family.title}'s {identity.naming} names and a {to} file "
            f"names them as the {wanted} checkpoint does; give --base (the model: a diffusers folder or a single "
            "file) so each module is looked up there",
            file=adapter.path,
        )


def _prove(adapter: Adapter, out: Path, svd: dict[str, float], log: Callable[[str], None], base=None) -> Proof:
    """Read `out` back and compare its ΔW with the source's: on the base's tensors when there is a base (any names,
    fused or split), else module by module."""
    import shutil

    try:
        proof = prove(adapter, out, svd) if base is None else prove_on_base(adapter, out, base, svd)
        log(proof.summary())
        return proof
    except VerificationFailed as e:
        shutil.rmtree(out) if out.is_dir() else out.unlink(missing_ok=True)
        raise VerificationFailed(f"{e} (removed {out})", report=e.report) from None


def _public_base(base: str | None, adapter: Adapter) -> str | None:
    """The base to record in adapter_config.json: a Hub id, never a local path (outputs may be published)."""
    for spec in (base, adapter.base_model):
        if spec and not Path(spec).expanduser().exists() and (m := HUB_SPEC.match(spec)):
            return m["repo"]
    return None


def check_output_path(out: Path, to: str, force: bool) -> None:
    """Refuse an `--out` that does not suit the target format (a file or a folder), before any work is done."""
    if to in FILE_TARGETS and out.suffix != ".safetensors":
        raise OutputError(f"--out {out}: a {to} LoRA is one file; give a path ending in .safetensors", path=out)
    if to not in FILE_TARGETS and out.suffix == ".safetensors":
        raise OutputError(f"--out {out}: {to} output is a folder; give a folder path", path=out)
    check_output_target(out, force)
