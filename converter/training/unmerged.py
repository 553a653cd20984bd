"""A training checkpoint written unmerged: a Hugging Face base folder and, when it carries a LoRA, a PEFT folder.

This is `--keep-adapter`'s output and what verification feeds PEFT: the merged model must behave like PEFT's
own forward of this base with this adapter (the oracle), so a wrong alpha, scale or module mapping fails.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from converter.engine.base_reader import open_base
from converter.engine.writer import OutSpec, ShardedWriter, atomic_folder
from converter.errors import UsageError
from converter.io.units import human_bytes
from converter.training.view import TrainingCheckpoint

PEFT_PREFIX = "base_model.model."


def _write(folder: Path, tensors: list[tuple[str, str, tuple[int, ...]]], read, single: str | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    specs = [OutSpec(n, d, s) for n, d, s in tensors]
    stem = single.removesuffix(".safetensors") if single else "model"
    writer = ShardedWriter(folder, specs, float("inf") if single else 5 * 2**30, stem, single)
    try:
        for spec in specs:
            data = memoryview(read(spec.name).contiguous().reshape(-1).view(torch.uint8).numpy())
            writer.write(spec.name, lambda sink, d=data: sink(d))
    except BaseException:
        writer.abort()
        raise
    writer.close()


def write_unmerged(ckpt: TrainingCheckpoint, out: Path) -> tuple[Path, Path | None]:
    """`out/base` (the base weights, LoRA not applied) and `out/adapter` (PEFT LoRA) or None without a LoRA."""
    base = Path(out) / "base"
    infos = [ckpt.info(n) for n in ckpt.names()]
    _write(base, [(i.name, i.dtype, i.shape) for i in infos], ckpt.read_unfused, None)
    for src in ckpt.folder.iterdir():
        if src.is_file() and not src.name.endswith((".safetensors", ".bin", ".index.json")):
            shutil.copyfile(src, base / src.name)
    if not ckpt.lora and not ckpt.expert_lora:
        return base, None
    adapter = Path(out) / "adapter"
    keys, modules, ranks = [], [], set()
    for name, (a_key, b_key, _) in ckpt.lora.items():
        module = name.removesuffix(".weight")
        modules.append(module)
        for key, role in ((a_key, "lora_A"), (b_key, "lora_B")):
            info = ckpt.source_info(key)
            keys.append((f"{PEFT_PREFIX}{module}.{role}.weight", key, info))
        ranks.add(ckpt.source.shape(a_key)[0])
    parameters = []
    for name, (a_key, b_key, _, experts, module, _) in ckpt.expert_lora.items():
        parameters.append(name)  # PEFT nests one wrapper per parameter: its keys keep the nesting (`base_layer.`)
        for key, role in ((a_key, "lora_A"), (b_key, "lora_B")):
            keys.append((f"{PEFT_PREFIX}{module}.{role}.weight", key, ckpt.source_info(key)))
        ranks.add(ckpt.source.shape(a_key)[0] // experts)
    by_name = {n: k for n, k, _ in keys}
    _write(
        adapter,
        [(n, i.dtype, i.shape) for n, _, i in keys],
        lambda n: ckpt.source.read(by_name[n]),
        "adapter_model.safetensors",
    )
    alpha, rslora, _, _ = ckpt.alpha
    (r,) = ranks if len(ranks) == 1 else (max(ranks),)
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": sorted(modules) or None,
        "target_parameters": sorted(parameters) or None,
        "rank_pattern": {m: rk for m in modules if (rk := ckpt.source.shape(ckpt.lora[f"{m}.weight"][0])[0]) != r},
        "task_type": ckpt.task_type,
        "bias": "none",
        "base_model_name_or_path": None,
    }
    (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return base, adapter


def keep_adapter(
    base: Path, out: Path, *, lora_alpha: float | None = None, allow_pickle: bool = False, force: bool = False,
    log: Callable[[str], None] = print, config: str | Path | None = None,
) -> tuple[Path, Path]:  # fmt: skip
    """`converter merge --keep-adapter`: the training checkpoint's base weights as stored in `out/base` (a model
    folder) and its LoRA as a PEFT folder in `out/adapter`, both appearing at once (one rename) or not at all."""
    ckpt = open_base(Path(base), lora_alpha=lora_alpha, allow_pickle=allow_pickle, config=config)
    if not isinstance(ckpt, TrainingCheckpoint):
        raise UsageError(f"--keep-adapter is for training checkpoints with a LoRA inside; {base} is not one")
    if not ckpt.lora and not ckpt.expert_lora:
        raise UsageError(f"--keep-adapter: {base} holds no LoRA (nothing to keep apart); drop --keep-adapter")
    for note in ckpt.notes[:1]:
        log(f"note: {note}")
    with atomic_folder(Path(out), force, needs=ckpt.total_bytes, log=log) as tmp:
        write_unmerged(ckpt, tmp)
    size = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
    log(
        f"wrote {out}/base (the base, LoRA not applied) and {out}/adapter (its LoRA as a PEFT adapter: "
        f"{len(ckpt.lora) + len(ckpt.expert_lora)} weights, lora_alpha {ckpt.alpha[0]:g} from {ckpt.alpha[2]}), "
        f"{human_bytes(size)}"
    )
    return Path(out) / "base", Path(out) / "adapter"
