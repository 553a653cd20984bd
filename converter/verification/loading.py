"""Loading the models verification compares: the merged folder, PEFT's unmerged reference, with accelerate's
disk offloading when they do not fit in memory; and the inputs they run on.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from converter.engine.checkpoint import Checkpoint
from converter.engine.precision import file_sources
from converter.engine.recipe import Recipe
from converter.errors import OutputError
from converter.verification.peft_names import older_name_mapping
from converter.verification.referee import RefereeUnavailable, first_line

# PEFT's own words when an adapter targets modules this base does not have (e.g. split q/k/v onto fused qkv)
PEFT_REFUSALS = ("not found in the base model",)


class PeftRefused(RefereeUnavailable):
    """PEFT cannot apply these adapters to this base unmerged, or not as they were trained."""


@contextmanager
def peft_refusals():
    """PEFT's specific refusal (a ValueError in its words) as PeftRefused; any other error stays what it is."""
    try:
        yield
    except ValueError as e:
        if any(words in str(e) for words in PEFT_REFUSALS):
            raise PeftRefused(f"PEFT cannot apply the adapters to this base unmerged ({first_line(e)})") from e
        raise


@dataclass
class Offload:
    """accelerate's disk offloading: what stays in memory, and where the rest goes."""

    max_memory: int
    folder: Path

    def kwargs(self) -> dict:
        folder = tempfile.mkdtemp(dir=self.folder)  # one per model loaded: offloaded files must not mix
        return {"device_map": "auto", "max_memory": {"cpu": self.max_memory}, "offload_folder": folder}

    def peft_safe(self, base: Path) -> Path:
        """The base seen through a path PEFT's disk-offload rewrite can use safely.

        PEFT 0.21 (`PeftModel._update_offload`) writes a renamed copy of every offloaded base shard at
        `os.path.join(*path.split(os.sep))` with "-peft" appended to the first path part containing "--": an
        absolute path loses its leading "/" (the copy lands under the working directory) and a path without "--"
        is overwritten in place. A relative path through a `models--*` link in our scratch folder sends the copy
        to a sibling inside the scratch folder, removed with it."""
        link = self.folder / f"models--reference-{uuid.uuid4().hex[:8]}"
        link.symlink_to(base.resolve(), target_is_directory=True)
        relative = Path(os.path.relpath(link))
        if next(part for part in relative.parts if "--" in part) != link.name:
            raise OutputError(
                f"{self.folder}: the temp folder's path contains '--'; set TMPDIR elsewhere", path=self.folder
            )
        return relative


def choose_placement(
    params: int, budget: int, scratch: Path, stored_bytes: int = 4, working: int | None = None
) -> tuple[str, Offload | None] | None:
    """In memory when one copy of the weights as loaded (`stored_bytes` per parameter; 0 when they stay mapped
    from their files and each layer is read in float32 while it runs, converter.engine.precision) fits: float32 compute.
    `working`: the bytes computing takes on top of it in that case (upcast_working_set); without it, half the
    model again. Float32 weights that do not fit load in bfloat16. When that does not fit either, weights go to
    disk and the compute stays float32 if the disk holds it (the offloaded verdict is then the in-memory one),
    else bfloat16. None: not even that fits."""
    if params * stored_bytes + (working if working is not None else params * stored_bytes // 2) < budget:
        return "float32", None
    if stored_bytes > 2 and params * 2 * 1.5 < budget:
        return "bfloat16", None
    offload = Offload(budget // 2, scratch)  # the other half: activations, logits, one layer loaded
    free = _free_disk(scratch)
    # Both models' offloaded weights (kept until the end) plus PEFT's renamed copies of the base's shards.
    for compute, size in (("float32", 4), ("bfloat16", 2)):
        if params * size * 3 < free:
            return compute, offload
    return None


def _free_disk(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def load_model(folder: Path, dtype, quantization=None, offload: Offload | None = None, sources: dict | None = None,
               model_class: str | None = None, config: dict | None = None):  # fmt: skip
    """transformers' own load (its weights stay views of the mapped files) as `model_class` (a transformers class
    name; default: the causal LM). `sources`, when given, is filled with the weights that are exactly a file's
    tensor (converter.engine.precision.file_sources), for float32 compute read from the files. `config`: settings
    given to `from_pretrained` over the folder's config (a classifier's labels and pad token)."""
    import transformers

    cls = getattr(transformers, model_class) if model_class else transformers.AutoModelForCausalLM
    extra = {"quantization_config": quantization} if quantization else {}
    extra.update(config or {})
    if offload:
        extra.update(offload.kwargs())
    model = cls.from_pretrained(folder, dtype=dtype, **extra).eval()
    if sources is not None:
        sources.update(file_sources(model, folder))
    return model


BYTES = {"F32": 4, "BF16": 2, "F16": 2}


def upcast_working_set(folder: Path) -> int:
    """Bytes computing in float32 over weights kept in their files takes (converter.engine.precision): the reused
    float32 buffers, which come to two blocks (~1/num_layers of the model each: the one computing and the next, read
    ahead) plus the largest tensor (the embedding or the head), the 16-bit staging buffer of that largest tensor,
    and 1 GiB for activations, logits and the metrics."""
    ckpt = Checkpoint(folder)
    sizes = [ckpt.info(name).numel for name in ckpt.names()]
    config = json.loads((folder / "config.json").read_text())
    layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers") or 1
    largest = max(sizes, default=0)
    return 4 * (2 * (sum(sizes) // int(layers)) + largest) + 2 * largest + 2**30


def streamed_working_set(folder: Path, adapters: list[Path] = ()) -> int:
    """Bytes the hollow comparison takes (converter.verification.streamed: two forwards taking turns on one set of
    buffers, no read ahead): one block's weights in float32, a block of head rows and the 16-bit staging buffer
    (converter.engine.precision), each model's logits twice (the run, then the comparison's log-softmax) for up to
    256 positions, the reference's adapters as PEFT holds them (float32), and 64 MiB for activations. Measured
    beside it: 475 MiB for the 3.15 GB bench model (bench/push_bound_bench.py), this gives 528 MiB."""
    from converter.engine.precision import ROW_BLOCK, STAGING

    vocab = _config_value(folder, "vocab_size")
    adapter = sum(f.stat().st_size for a in adapters for f in Path(a).glob("adapter_model*.safetensors"))
    return block_bytes(folder) + ROW_BLOCK + STAGING + 2 * 2 * 256 * vocab * 4 + adapter + 2**26


def block_bytes(folder: Path) -> int:
    """Bytes of one block of the model in float32 (a decoder layer; a head or an embedding read by rows aside)."""
    from converter.engine.precision import ROWS_MIN

    ckpt = Checkpoint(folder)
    sizes = [ckpt.info(name).numel for name in ckpt.names()]
    layers, vocab = _config_value(folder, "num_hidden_layers") or 1, _config_value(folder, "vocab_size")
    rowwise = sum(n for n in sizes if n >= ROWS_MIN and n % max(vocab, 1) == 0)  # a big head or embedding
    return 4 * max((sum(sizes) - rowwise) // layers, max((n for n in sizes if n < ROWS_MIN), default=0))


def _config_value(folder: Path, key: str) -> int:
    config = json.loads((folder / "config.json").read_text())
    return int(config.get(key) or (config.get("text_config") or {}).get(key) or 0)


def resident_bytes(model, sources: dict | None) -> int:
    """Bytes of `model`'s parameters held in memory: all of them, less those left mapped from their files."""
    skip = sources or {}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def vocab_size(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    return int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size"))


def load_tokenizer(folder: Path, sample: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        return None
    # Some model types get a tokenizer with only special tokens when the folder has no tokenizer files.
    return tok if len(set(tok(sample).input_ids)) >= 3 else None


@contextmanager
def load_results():
    """The load results of PeftModel.load_adapter, which PeftModel.from_pretrained computes and drops."""
    from peft import PeftModel

    results: list = []
    original = PeftModel.load_adapter

    def load_adapter(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        results.append(result)
        return result

    PeftModel.load_adapter = load_adapter
    try:
        yield results
    finally:
        PeftModel.load_adapter = original


def require_all_loaded(results: list, adapters: list[Path]) -> None:
    """A reference in which PEFT left LoRA weights out (file tensors it placed nowhere, or LoRA layers it made but
    found no weights for) is not the adapter as trained: comparing with it would fail a right merge. PEFT 0.21 does
    this to per-expert LoRAs on models whose shared experts share the experts' names (Qwen2-MoE's
    `shared_expert.gate_proj`): it wraps those and drops the experts'."""
    for path, result in zip(adapters, results, strict=False):
        unplaced = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        unloaded = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
        if unplaced or unloaded:
            example = (unplaced or unloaded)[0]
            raise PeftRefused(
                f"PEFT does not apply {path.name} as trained: it {'ignores' if unplaced else 'finds no weights for'} "
                f"{len(unplaced or unloaded)} LoRA tensors, e.g. {example}"
            )


def require_trained_scales(model, names: list[str], adapters: list[Path]) -> None:
    """PEFT 0.21 loads per-expert LoRAs onto fused experts by stacking gate and up: it doubles their rank and alpha
    in its config (rank_pattern / alpha_pattern entries the file does not have). alpha/r stays, alpha/sqrt(r)
    (use_rslora) grows by sqrt(2): its forward is then not the adapter as trained, and could only fail a right
    merge."""
    for name, path in zip(names, adapters, strict=True):
        config = model.peft_config.get(name)
        if not getattr(config, "use_rslora", False):
            continue
        try:
            saved = json.loads((path / "adapter_config.json").read_text())
        except (OSError, ValueError):
            continue
        added = sorted(set(config.rank_pattern or {}) - set(saved.get("rank_pattern") or {}))
        if added:
            raise PeftRefused(
                f"PEFT does not apply {path.name} as trained: it fuses per-expert LoRAs into {', '.join(added)} "
                "with doubled rank and alpha, which under use_rslora scales them by sqrt(2)"
            )


def load_reference(
    base: Path,
    adapters: list[Path],
    recipe: Recipe,
    dtype,
    vocab: int,
    quantization=None,
    offload=None,
    sources: dict | None = None,
    model_class: str | None = None,
    config: dict | None = None,
):
    """PEFT's unmerged model: the base (as `model_class`, default the causal LM, with `config` over its own config)
    with the adapters on top, each scaled by its recipe weight. `sources`: as for load_model, of the base's
    weights (found before PEFT wraps them; a parameter keeps its id inside PEFT). `vocab`: the rows the adapters
    were trained on (None: as is)."""
    from peft import PeftModel

    if offload:
        base = offload.peft_safe(base)
    # (a base's own quantization_config applies by itself)
    model = load_model(base, dtype, quantization, offload, sources, model_class, config)
    if vocab and model.get_input_embeddings().weight.shape[0] != vocab:
        model.resize_token_embeddings(vocab)  # the adapters were trained on a resized vocabulary
    names = [f"adapter{i}" for i in range(len(adapters))]
    # PEFT re-dispatches an offloaded model when it adds adapters: keep the placement accelerate chose.
    placed = {**offload.kwargs(), "device_map": model.hf_device_map} if offload else {}
    with warnings.catch_warnings():
        # Offloaded: torch warns that copying the adapter weights into meta parameters is a no-op, but PEFT then
        # writes them to the offload folder; the offloaded reference equals the in-memory one (tested).
        warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter .* is a no-op")
        renamed = {"key_mapping": older_name_mapping(model, adapters) or None}  # transformers 4's module names
        with load_results() as results, peft_refusals():
            model = PeftModel.from_pretrained(model, adapters[0], adapter_name=names[0], **placed, **renamed)
            for name, path in zip(names[1:], adapters[1:], strict=True):
                model.load_adapter(path, adapter_name=name, **placed, **renamed)
    require_all_loaded(results, adapters)
    require_trained_scales(model, names, adapters)
    if sources is not None:
        _exact_adapter_tensors(model, adapters, names, sources, renamed["key_mapping"])
    set_recipe_scales(model, recipe)
    return model.eval()


def set_recipe_scales(model, recipe: Recipe) -> None:
    """Every adapter of a PEFT model (named adapter0, adapter1 ... in recipe order) active, each scaled by its
    recipe weight on the modules its include/exclude admits and by 0 elsewhere, as PEFT's multi-adapter forward
    scales them."""
    names = [f"adapter{i}" for i in range(len(recipe.adapters))]
    if len(names) > 1:
        model.base_model.set_adapter(names)
    for name, spec in zip(names, recipe.adapters, strict=True):
        for module_name, module in model.named_modules():
            if hasattr(module, "set_scale") and name in getattr(module, "scaling", {}):
                key = module_name.removeprefix("base_model.model.") + ".weight"
                module.set_scale(name, spec.weight if spec.admits(key) else 0.0)


def _exact_adapter_tensors(model, adapters: list[Path], names: list[str], sources: dict, renamed=None) -> None:
    """Float32 compute over weights in their own dtype must see the adapters' tensors as stored: PEFT makes its
    copies for modules_to_save and trainable tokens in the base's dtype, which rounds a float32 adapter's values
    (LoRA factors it upcasts itself). Upcast the adapters' own 16-bit tensors (PEFT puts the adapter's name in
    each of their names; the base's, read from its files or copied while computing, stay as loaded), then load the
    adapters' tensors into them again, now exactly."""
    import torch
    from peft import load_peft_weights, set_peft_model_state_dict

    upcast = 0
    for full_name, param in model.named_parameters():
        owned = any(f".{n}." in full_name or full_name.endswith(f".{n}") for n in names)
        if owned and id(param) not in sources and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()
            upcast += 1
    if not upcast:  # plain LoRA factors: PEFT loaded them in float32 already
        return
    for name, path in zip(names, adapters, strict=True):
        weights = load_peft_weights(str(path), device="cpu", key_mapping=renamed)
        set_peft_model_state_dict(model, weights, adapter_name=name)


def side_by_side(tok, prompts: list[str], bare, ref, out, count: int = 3) -> list[dict]:
    """The first `count` prompts' greedy continuations of the bare base, the reference and the merge."""

    def text(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else " ".join(map(str, ids))

    return [
        {
            "prompt": prompts[i] if tok is not None else f"(random token ids #{i})",
            "base": text(bare.generations[i]),
            "reference": text(ref.generations[i]),
            "merged": text(out.generations[i]),
        }
        for i in range(min(count, len(ref.generations)))
    ]
