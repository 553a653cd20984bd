"""Prove a diffusion merge: the merged pipeline must behave like the base with the adapters applied *unmerged* by
diffusers' own loader (`load_lora_weights` + `set_adapters`, per-component strengths honoured), never by our code.

Three models, one pipeline in memory at a time: the reference (base + adapters through diffusers), the bare base
(the same pipeline with its LoRA layers disabled: a merge that changed nothing fails) and the merged folder. Each
touched component is run on fixed seeded inputs: the denoiser (a UNet or a transformer; inputs from
converter.engine.denoiser_inputs) at a few timesteps across the schedule, the text encoders on fixed token ids. Its
relative error against the reference must stay within what rounding the merged weights to their dtype can explain,
and far below the adapter's own effect (base vs reference); hooks on every Linear/Conv name the first module that
disagrees (run only after a fail: both models once more on the first input, as the hooks cost about three forwards).
A few small images (fixed seed, few steps) are made by each model and saved next to the report with PSNR / max pixel
difference: shown, not judged (a few sampler steps amplify rounding unevenly; the components' check is the verdict).
Where diffusers cannot be the referee (it refuses or would misread the file, include/exclude, a base it cannot
load), `formula.py` is.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

from converter.engine import denoiser_inputs
from converter.engine.base_reader import open_base
from converter.engine.model_class import LoadingRulesUnreadable, loaded_names
from converter.engine.recipe import Recipe
from converter.io import dtypes
from converter.io.safetensors_file import SafetensorsFile
from converter.io.scratch import temp_folder
from converter.verification.diffusers_loader import (
    MESSAGE_WIDTH,
    MODEL_PARTS,
    LoaderRefused,
    Unbuildable,
    apply_adapters,
    diffusers_declines,
    is_complete,
    load_pipeline,
    load_single_file,
)
from converter.verification.diffusers_parts import load_parts
from converter.verification.judge import failing_components, judge_diffusion
from converter.verification.metrics import UNIT_ROUNDOFF, first_disagreement
from converter.verification.referee import RefereeUnavailable, in_one_line
from converter.verification.report import (
    Clock,
    ComponentComparison,
    DiffusionBehaviour,
    DiffusionInputs,
    DiffusionTolerance,
    Disagreement,
    ImageRow,
    OutputDifference,
    Skip,
)
from converter.verification.tensors import locations

IMAGE_DIR = "verification"
# A denoiser's output after ~20-60 layers: each merged weight carries one rounding of its dtype (relative error
# u); a right merge's output error is that rounding amplified by the network's depth, 8 u allowed (4 u per module).
# On top, float32 compute itself: W x + B (A x) (reference) and (W + B A) x (merged) round differently, measured
# up to 15 u_f32 at the tiny SD 1.5 UNet's output: 256 u_f32 allowed (64 per module).
OUTPUT_ROUNDING_FACTOR = 8.0
MODULE_ROUNDING_FACTOR = 4.0
COMPUTE_FLOOR = 256 * 2.0**-24
MODULE_COMPUTE_FLOOR = 64 * 2.0**-24
TIMESTEP_FRACTIONS = (0.9, 0.5, 0.1)
IMAGE_COUNT = 2
IMAGE_STEPS = 4


def is_diffusion(folder: Path) -> bool:
    return (Path(folder) / "model_index.json").is_file()


def tolerance(output_dtype: str) -> DiffusionTolerance:
    u = UNIT_ROUNDOFF.get(output_dtype, 2.0**-8)
    return DiffusionTolerance(
        output_rel_err=OUTPUT_ROUNDING_FACTOR * u + COMPUTE_FLOOR,
        module_rel_err=MODULE_ROUNDING_FACTOR * u + MODULE_COMPUTE_FLOOR,
    )


class DiffusionCheck:
    """One diffusion merge's behaviour against diffusers' unmerged loader, and the images shown beside it."""

    def __init__(self, merged: Path, recipe: Recipe, base: Path, adapters: list[Path], single_file_config: str | None,
                 log: Callable[[str], None], clock: Clock):  # fmt: skip
        self.merged, self.recipe, self.base, self.adapters = Path(merged), recipe, Path(base), adapters
        self.config, self.log, self.clock = single_file_config, log, clock
        self.single = not is_diffusion(self.base)
        self.made: tuple[list, list, list] | None = None  # reference, merged, bare images

    def load(self, which: Path):
        return load_single_file(which, self.config) if self.single else load_pipeline(which)

    def merged_path(self) -> Path:
        return self.merged / self.base.name if self.single else self.merged

    def run(self) -> tuple[DiffusionBehaviour, tuple[list[str], list[str]]]:
        if why := diffusers_declines(self.recipe, self.base, self.adapters):
            raise Skip(why)
        self.log(f"comparing behaviour: reference = base + {len(self.adapters)} adapter(s) through diffusers' "
                 "LoRA loader")  # fmt: skip
        pipe = self._reference_pipeline()
        touched = sorted(pipe.get_list_adapters())
        inputs = _inputs(pipe, touched)
        images_here = _can_make_images(pipe)
        ref, ref_images = _run(pipe, inputs, touched, hooks=False), _images(pipe) if images_here else []
        pipe.disable_lora()
        bare, bare_images = _run(pipe, inputs, touched, hooks=False), _images(pipe) if images_here else []
        self.clock.lap("run reference and bare base")
        del pipe
        gc.collect()
        pipe = self.load(self.merged_path())
        out, out_images = _run(pipe, inputs, touched, hooks=False), _images(pipe) if images_here else []
        del pipe
        gc.collect()
        self.clock.lap("run merged")
        self.made = (ref_images, out_images, bare_images)
        return self._judged(touched, inputs, ref, out, bare)

    def _reference_pipeline(self):
        """The base pipeline with the adapters applied unmerged by diffusers; Skip where it cannot be."""
        try:
            pipe = self.load(self.base)
        except (OSError, ValueError, Unbuildable) as e:  # offline, no config, a pipeline it cannot build
            how = "from_single_file" if self.single else "from_pretrained"
            raise Skip(f"diffusers' {how} cannot load the base here ({in_one_line(e, MESSAGE_WIDTH)})") from None
        try:
            wrong = apply_adapters(pipe, self.recipe, self.adapters)
        except LoaderRefused as e:
            why = in_one_line(e, MESSAGE_WIDTH)
            raise Skip(f"diffusers cannot apply the adapters to this base unmerged ({why})") from None
        if wrong:
            del pipe
            pipe = self._parts_apart(wrong)
        self.clock.lap("load reference")
        denoiser = _denoiser_name(pipe)
        if denoiser is None or type(getattr(pipe, denoiser)).__name__ not in denoiser_inputs.INPUTS:
            kind = type(getattr(pipe, denoiser or "unet", None)).__name__
            raise Skip(f"the behaviour check has no seeded inputs for a {kind} yet")
        return pipe

    def _parts_apart(self, wrong: str):
        """The base pipeline with each part of the adapter files diffusers reads right loaded apart (as the
        tensor proof's referee loads them: diffusers_parts), where its loader misreads the files whole (kohya's
        per-module alphas); Skip where a part is still misread, or read by no diffusers code."""
        pipe = self.load(self.base)
        try:
            with temp_folder("lora-parts") as scratch:
                split = load_parts(pipe, self.recipe, self.adapters, scratch)
        except RefereeUnavailable as e:
            raise Skip(f"{wrong} (its parts apart: {e})") from None
        if split.unread:
            raise Skip(wrong)
        return pipe

    def _judged(self, touched, inputs, ref, out, bare):
        dtype = _single_file_dtype(self.merged_path()) if self.single else _stored_dtype(
            self.merged / _denoiser_folder(self.merged))  # fmt: skip
        tol = tolerance(dtype)
        components = {name: ComponentComparison(_compare(ref[name]["outputs"], out[name]["outputs"]),
                                                _compare(ref[name]["outputs"], bare[name]["outputs"]))
                      for name in touched}  # fmt: skip
        failing = failing_components(components, tol)
        culprits = self._probe(failing, inputs, tol) if failing else []
        behaviour = DiffusionBehaviour(
            reference="the base + adapters applied unmerged by diffusers' load_lora_weights / set_adapters"
            + (" (base and merge loaded by from_single_file)" if self.single else ""),
            compute_dtype="float32",
            output_dtype=dtype,
            tolerance=tol,
            inputs=DiffusionInputs(inputs["timesteps"], touched, IMAGE_STEPS),
            components=components,
            first_disagreeing_module=culprits[0] if culprits else None,
        )
        return behaviour, judge_diffusion(components, tol, culprits)

    def _probe(self, failing: list[str], inputs: dict, tol: DiffusionTolerance) -> list[Disagreement]:
        """Only on a failure: hooks on every Linear/Conv (~3x a forward), both models once more, first input."""
        self.log(f"locating the first disagreeing module of {', '.join(failing)} (both models again, with hooks)")
        probe_inputs = {**inputs, "calls": inputs["calls"][:1]}
        pipe = self.load(self.base)
        apply_adapters(pipe, self.recipe, self.adapters)
        ref_probe = _run(pipe, probe_inputs, failing, hooks=True)
        del pipe
        gc.collect()
        pipe = self.load(self.merged_path())
        out_probe = _run(pipe, probe_inputs, failing, hooks=True)
        del pipe
        gc.collect()
        self.clock.lap("module probe")
        culprits = []
        for name in failing:
            first = first_disagreement(ref_probe[name]["probe"], out_probe[name]["probe"], tol.module_rel_err,
                                       floor=1e-30)  # fmt: skip
            if first:
                culprits.append(Disagreement(f"{name}.{first['module']}", first["relative_error"]))
        return culprits

    def images(self, referee=None) -> list[ImageRow]:
        """The base / reference / merged images (saved next to the report): those the behaviour made, else, for a
        complete pipeline folder, the reference as the base pipeline holding the referee's tensors."""
        if self.made is None and referee is not None and is_diffusion(self.base) and is_complete(self.base):
            self.made = self._referee_images(referee)
        if not self.made or not self.made[0]:
            return []
        return _save_images(self.merged, *self.made)

    def _referee_images(self, referee) -> tuple[list, list, list] | None:
        """Base images, then the same pipeline holding each changed tensor as the referee computes it (the
        reference's images), then the merged pipeline's: one pipeline in memory at a time."""
        import torch

        pipe = load_pipeline(self.base)
        bare = _images(pipe)
        base = locations(open_base_checkpoint(self.base))
        params = _pipeline_params(pipe, set(base))
        for name, rule in referee.expectations().items():
            param, where = params.get(name), base.get(rule.base_name or name)
            if param is None or where is None:
                return None
            value = rule.rows(_read_float64(where), 0, where.shape[0] if where.shape else 1).value
            if value.shape != param.shape:
                return None
            with torch.no_grad():
                param.copy_(value.to(param.dtype))
        ref = _images(pipe)
        del pipe
        gc.collect()
        out = _images(load_pipeline(self.merged))
        self.clock.lap("images (referee's reference)")
        return ref, out, bare


def _pipeline_params(pipe, file_names: set[str]) -> dict:
    """The "component/key" of a checkpoint tensor -> the pipeline's parameter (loaded from it, by transformers'
    own renames on load)."""
    params: dict = {}
    for component in MODEL_PARTS:
        model = getattr(pipe, component, None)
        if model is None:
            continue
        ns = f"{component}/"
        try:
            to_file = loaded_names(model, [n[len(ns) :] for n in file_names if n.startswith(ns)])
            to_file = {k: v for k, v in to_file.items() if v is not None}  # a fused weight has no one file key
        except LoadingRulesUnreadable:  # the names as they are: a renamed tensor is then not found (no images)
            to_file = {}
        for key, param in model.named_parameters():
            params[f"{ns}{to_file.get(key, key)}"] = param
    return params


def open_base_checkpoint(base: Path):
    return open_base(base)


def _read_float64(where):
    import torch

    with open(where.path, "rb") as f:
        f.seek(where.start)
        data = bytearray(f.read(where.end - where.start))
    return torch.frombuffer(data, dtype=dtypes.ST_TO_TORCH[where.dtype]).reshape(where.shape).to(torch.float64)


def _denoiser_folder(merged: Path) -> str:
    return next((n for n in ("unet", "transformer") if (merged / n).is_dir()), "unet")


def _single_file_dtype(file: Path) -> str:
    tensors = SafetensorsFile(file).tensors
    first = next(iter(tensors.values())).dtype
    return next((t.dtype for k, t in tensors.items() if k.startswith("model.diffusion_model.")), first)


def _denoiser_name(pipe) -> str | None:
    return next((n for n in ("unet", "transformer") if getattr(pipe, n, None) is not None), None)


def _can_make_images(pipe) -> bool:
    if not all(getattr(pipe, c, None) is not None for c in ("vae", "scheduler")):
        return False
    if getattr(pipe, "unet", None) is not None:
        return True
    kind = type(getattr(pipe, "transformer", None)).__name__
    return kind == "FluxTransformer2DModel" and all(getattr(pipe, c, None) is not None for c in _text_encoders(pipe))


def _inputs(pipe, touched: list[str]) -> dict:
    """Seeded latents, timesteps across the schedule, token ids and text embeddings for every run."""
    import torch

    g = torch.Generator().manual_seed(0)
    denoiser = getattr(pipe, _denoiser_name(pipe))
    scheduler = getattr(pipe, "scheduler", None)
    steps = int(scheduler.config.get("num_train_timesteps", 1000)) if scheduler is not None else 1000
    timesteps = [int(f * steps) for f in TIMESTEP_FRACTIONS]
    calls = []
    for t in timesteps:
        g.manual_seed(0)  # the same latents and context at every timestep
        calls.append(denoiser_inputs.seeded(type(denoiser).__name__, denoiser.config, t / steps, g))
    inputs = {"timesteps": timesteps, "tokens": {}, "calls": calls}
    for name in _text_encoders(pipe):
        te = getattr(pipe, name)
        length = min(int(getattr(te.config, "max_position_embeddings", 16)), 16)
        inputs["tokens"][name] = torch.randint(0, te.config.vocab_size, (IMAGE_COUNT, length), generator=g)
    return inputs


def _text_encoders(pipe) -> list[str]:
    return [n for n in MODEL_PARTS[2:] if getattr(pipe, n, None) is not None]


def _run(pipe, inputs: dict, touched: list[str], hooks: bool) -> dict:
    """Outputs of every touched component on the fixed inputs; with `hooks`, every Linear/Conv's output on the
    first input (execution order), for locating the first module that disagrees."""
    import torch

    results = {}
    for name in touched:
        model = getattr(pipe, name)
        probe: dict[str, torch.Tensor] = {}
        handles = _hook(model, probe) if hooks else []
        outputs = []
        with torch.no_grad():
            if name == _denoiser_name(pipe):
                for kwargs in inputs["calls"]:
                    outputs.append(denoiser_inputs.flat(model(**kwargs, return_dict=False)).double())
                    for h in handles:
                        h.remove()
                    handles = []
            else:
                result = model(inputs["tokens"][name], output_hidden_states=True)
                outputs.append(result.hidden_states[-1].double())
                for h in handles:
                    h.remove()
        results[name] = {"outputs": outputs, "probe": probe}
    return results


def _hook(model, probe: dict) -> list:
    from torch import nn

    handles = []
    for path, module in model.named_modules():
        if ".base_layer" in path or ".lora_" in path:
            continue
        if not (isinstance(module, nn.Linear | nn.Conv2d) or _is_lora_wrapper(module)):
            continue

        def keep(_m, _i, output, path=path):
            if path not in probe:
                probe[path] = output.detach().double().clone()

        handles.append(module.register_forward_hook(keep))
    return handles


def _is_lora_wrapper(module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - diffusers' loader needs peft
        return False
    return isinstance(module, BaseTunerLayer)


def _compare(ref: list, other: list) -> OutputDifference:
    import torch

    diff = torch.cat([(r - o).flatten() for r, o in zip(ref, other, strict=True)])
    norm = torch.cat([r.flatten() for r in ref]).norm().clamp_min(1e-30)
    return OutputDifference(
        rel_err=(diff.norm() / norm).item(), max_abs=diff.abs().max().item(), mean_abs=diff.abs().mean().item()
    )


def _images(pipe) -> list:
    """IMAGE_COUNT small images, fixed seed, IMAGE_STEPS steps, from text embeddings made by the pipeline's own
    text encoders on fixed token ids (their LoRA, if any, takes part): uint8 HxWx3 arrays."""
    import numpy as np
    import torch

    if getattr(pipe, "unet", None) is not None:
        size = pipe.vae_scale_factor * min(int(pipe.unet.config.sample_size), 32)
    else:  # Flux: latents packed 2x2 into tokens, an 8x8-token image
        size = pipe.vae_scale_factor * 2 * 8
    kwargs = _prompt_embeds(pipe)
    with torch.no_grad():
        out = pipe(
            **kwargs,
            num_inference_steps=IMAGE_STEPS,
            height=size,
            width=size,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
            guidance_scale=1.0,
        )
    return [(np.clip(img, 0, 1) * 255).round().astype("uint8") for img in out.images]


def _prompt_embeds(pipe) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    encoders = _text_encoders(pipe)
    ids = {
        n: torch.randint(
            0,
            getattr(pipe, n).config.vocab_size,
            (IMAGE_COUNT, min(int(getattr(getattr(pipe, n).config, "max_position_embeddings", 16)), 16)),
            generator=g,
        )
        for n in encoders
    }
    with torch.no_grad():
        if getattr(pipe, "transformer", None) is not None:  # Flux: T5's hidden states, CLIP's pooled output
            return {
                "prompt_embeds": pipe.text_encoder_2(ids["text_encoder_2"]).last_hidden_state,
                "pooled_prompt_embeds": pipe.text_encoder(ids["text_encoder"]).pooler_output,
            }
        if len(encoders) == 1:
            return {"prompt_embeds": getattr(pipe, encoders[0])(ids[encoders[0]]).last_hidden_state}
        hidden, pooled = [], None
        for n in encoders:  # SDXL: penultimate hidden states of both, pooled projection of the second
            result = getattr(pipe, n)(ids[n], output_hidden_states=True)
            hidden.append(result.hidden_states[-2])
            pooled = result[0]
        return {"prompt_embeds": torch.cat(hidden, dim=-1), "pooled_prompt_embeds": pooled}


def _save_images(merged: Path, ref: list, out: list, bare: list) -> list[ImageRow]:
    import numpy as np
    from PIL import Image

    folder = merged / IMAGE_DIR
    folder.mkdir(exist_ok=True)
    rows = []
    for i, (r, o, b) in enumerate(zip(ref, out, bare, strict=True)):
        paths = {}
        for role, img in (("base", b), ("reference", r), ("merged", o)):
            Image.fromarray(img).save(folder / f"{role}-{i}.png")
            paths[role] = f"{IMAGE_DIR}/{role}-{i}.png"
        diff = np.abs(r.astype(np.int32) - o.astype(np.int32))
        mse = float((diff.astype(np.float64) ** 2).mean())
        psnr = 99.0 if mse == 0 else float(10 * np.log10(255.0**2 / mse))  # 99: identical (JSON has no inf)
        rows.append(ImageRow(f"(random token ids #{i})", **paths, psnr=round(psnr, 2), max_abs=int(diff.max())))
    return rows


def _stored_dtype(component: Path) -> str:
    from safetensors import safe_open

    for f in sorted(component.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                return fh.get_slice(key).get_dtype()
    return "F32"
