"""PEFT adapters (LoRA, DoRA, rsLoRA, embedding LoRA, modules_to_save, trainable tokens).

Facts from PEFT 0.21 (docs/FORMATS.md §7): keys are `base_model.model.<module>.lora_A.weight`
(r, in) and `.lora_B.weight` (out, r); scaling alpha/r or alpha/sqrt(r) with rsLoRA, per-module overrides from
rank_pattern/alpha_pattern matched with `re.match(rf"(.*\\.)?({key})$", module)` (first match wins).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from converter.errors import AdapterFormatError
from converter.formats.adapter import Adapter, AdapterPatch, open_tensor_file
from converter.formats.patches import BiasDelta, DoRA, ExpertLowRank, LowRank, Ref, Replace, RowReplace, lora_scale

NAME = "peft"
SUPPORTED_TYPES = {"LORA", "TRAINABLE_TOKENS"}
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

PREFIX = "base_model.model."
# Suffix -> role. Order matters: longer, more specific suffixes first.
ROLES = [
    (".lora_magnitude_vector.weight", "magnitude"),
    (".lora_magnitude_vector", "magnitude"),
    (".lora_embedding_A", "emb_A"),
    (".lora_embedding_B", "emb_B"),
    (".lora_A.weight", "A"),
    (".lora_B.weight", "B"),
    (".lora_B.bias", "B_bias"),
    (".token_adapter.trainable_tokens_delta", "tokens"),
    (".base_layer.weight", "base_weight"),
    (".base_layer.bias", "base_bias"),
]
ADAPTER_NAME_SEGMENT = re.compile(
    r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.default\b"
)


def _paths(path: Path) -> tuple[Path, Path] | None:
    """(config, weights) for a PEFT folder or a weights file with adapter_config.json beside it."""
    folder = path if path.is_dir() else path.parent
    config = folder / "adapter_config.json"
    if not config.is_file():
        return None
    if path.is_file():
        return config, path
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return config, folder / name
    raise AdapterFormatError(
        f"{folder}: has adapter_config.json but no adapter_model.safetensors (or .bin)",
        file=folder / "adapter_config.json",
    )


def detect(path: Path) -> bool:
    return _paths(path) is not None


def pattern_value(patterns: dict, module: str, default, where: Path | None = None):
    """PEFT's rule for rank_pattern / alpha_pattern: a regex suffix of the module name, first match wins."""
    if not isinstance(patterns, dict):
        raise AdapterFormatError(f"{where}: rank_pattern / alpha_pattern must be a JSON object", file=where)
    for key, value in patterns.items():
        try:
            matched = re.match(rf"(.*\.)?({key})$", module)
        except re.error as e:
            raise AdapterFormatError(
                f"{where}: rank_pattern / alpha_pattern key {key!r} is not a valid regex ({e})", file=where
            ) from None
        if matched:
            return value
    return default


def _split(key: str) -> tuple[str, str]:
    """'base_model.model.x.q_proj.lora_A.weight' -> ('x.q_proj', 'A'); unknown suffix -> (module, 'full:<param>')."""
    key = ADAPTER_NAME_SEGMENT.sub(lambda m: "." + m.group(1), key)
    if key.startswith(PREFIX):
        key = key[len(PREFIX) :]
    for suffix, role in ROLES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    module, _, param = key.rpartition(".")
    # Saved copies of a modules_to_save layer: the trained one and, for resized embeddings, the original too.
    for wrapper, role in ((".modules_to_save", "copy"), (".original_module", "original")):
        if module.endswith(wrapper):
            return module[: -len(wrapper)], f"{role}:{param}"
    return module, f"full:{param}"


def _token_indices(config: dict, module: str) -> list[int]:
    spec = config.get("trainable_token_indices")
    if isinstance(spec, list):
        return spec
    if isinstance(spec, dict):
        for name, ids in spec.items():
            if module == name or module.endswith("." + name):
                return ids
    raise AdapterFormatError(
        f"trainable tokens saved for {module} but adapter_config.json has no trainable_token_indices for it",
        tensor=module,
    )


def _number(value, what: str, where: Path) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise AdapterFormatError(f"{where}: {what} is {value!r}; it must be a number", file=where)
    return value


def _wrapped_parameters(module: str, config: dict) -> list[tuple[str, str]]:
    """PEFT target_parameters a LoRA under `module` may be for: (parameter name, full path). PEFT wraps each
    targeted parameter of a module in turn, one `base_layer.` deeper each time, so the nesting does not name it."""
    targets = config.get("target_parameters") or []
    root = re.sub(r"(\.base_layer)+$", "", module)
    if root == module and _targets_module(module, config.get("target_modules")):
        return []  # an ordinary LoRA on a module that target_modules names
    out = []
    for target in targets if isinstance(targets, list) else []:
        owner, _, param = str(target).rpartition(".")
        if root == owner or root.endswith(f".{owner}") or not owner:
            out.append((param, f"{root}.{param}"))
    return out


def _targets_module(module: str, targets) -> bool:
    """PEFT's rule for target_modules: a regex string must match the whole name, a list entry its tail."""
    if isinstance(targets, str):
        try:
            return re.fullmatch(targets, module) is not None
        except re.error:
            return False
    return any(module == t or module.endswith(f".{t}") for t in targets or [])


def _parameter_lora(module, wrapped, down: Ref, up: Ref, config: dict, weights_path: Path, config_path: Path):
    """A target_parameters LoRA: one candidate per parameter it may be for, each with that parameter's rank and
    alpha (rank_pattern / alpha_pattern match the parameter's path); 3-D (fused experts) when A holds r·E rows."""
    if len(up.shape) != 2 or up.shape[1] != down.shape[0]:
        raise AdapterFormatError(
            f"{weights_path}: {up.name} has shape {list(up.shape)} but {down.name} has {list(down.shape)}: a "
            "target_parameters LoRA has A (r·experts, in) and B (out, r·experts)",
            file=weights_path,
            tensor=up.name,
        )
    rslora = bool(config.get("use_rslora", False))
    either = []
    for param, path in wrapped:
        r = pattern_value(config.get("rank_pattern") or {}, path, config.get("r", 8), config_path)
        alpha = pattern_value(config.get("alpha_pattern") or {}, path, config.get("lora_alpha", 8), config_path)
        alpha = _number(alpha, f"lora_alpha for {path}", config_path)
        if not isinstance(r, int) or r <= 0 or down.shape[0] % r:
            continue
        scale = lora_scale(alpha, r, rslora)
        experts = down.shape[0] // r
        patch = LowRank(down, up, scale) if experts == 1 else ExpertLowRank(down, up, scale, experts)
        either.append((param, patch))
    if not either:
        raise AdapterFormatError(
            f"{weights_path}: {down.name} has {down.shape[0]} rows, which is no multiple of the rank "
            f"adapter_config.json gives {', '.join(p for _, p in wrapped)}",
            file=weights_path,
            tensor=down.name,
        )
    root = re.sub(r"(\.base_layer)+$", "", module)
    return AdapterPatch(root, either[0][0], either[0][1], either=tuple(either) if len(either) > 1 else ())


def parse(
    path: Path, *, allow_pickle: bool = False, lora_alpha: float | None = None, require_scale: bool = True
) -> Adapter:
    config_path, weights_path = _paths(path)  # type: ignore[misc]
    config = _read_config(config_path, lora_alpha)
    tensors = open_tensor_file(weights_path, allow_pickle)
    reading = _Reading(tensors, config, weights_path, config_path)
    for module, roles in _group_modules(tensors, weights_path).items():
        _read_module(reading, module, roles)
    folder = weights_path.parent
    model_config = _model_config(folder)
    return Adapter(
        path=path,
        format=NAME,
        tensors=tensors,
        patches=reading.patches,
        config=config,
        base_model=config.get("base_model_name_or_path"),
        summary=_summary(config, reading.ranks),
        tokenizer_dir=folder if any((folder / n).is_file() for n in TOKENIZER_FILES) else None,
        files=[config_path, weights_path],
        model_config=model_config,
    )


def _read_config(config_path: Path, lora_alpha: float | None) -> dict:
    """adapter_config.json's LoraConfig fields; refused when unreadable, when a stated lora_alpha contradicts it
    (the config is what the adapter was trained with) or when its PEFT type is one we cannot merge."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise AdapterFormatError(
            f"{config_path}: invalid JSON ({e.msg} at line {e.lineno})", file=config_path
        ) from None
    except UnicodeDecodeError:
        raise AdapterFormatError(
            f"{config_path}: not UTF-8 text; is it really a JSON config?", file=config_path
        ) from None
    if not isinstance(config, dict):
        raise AdapterFormatError(f"{config_path}: expected a JSON object of LoraConfig fields", file=config_path)
    if lora_alpha is not None and lora_alpha != config.get("lora_alpha", 8):
        raise AdapterFormatError(
            f"{config_path}: says lora_alpha={config.get('lora_alpha', 8)!r} but lora_alpha {lora_alpha:g} was "
            "given; drop the stated value (the config is what the adapter was trained with)",
            file=config_path,
        )
    peft_type = _peft_type(config)
    if peft_type not in SUPPORTED_TYPES:
        raise AdapterFormatError(
            f"{config_path}: PEFT type {peft_type} is not supported yet (supported: LORA, TRAINABLE_TOKENS)",
            file=config_path,
        )
    return config


def _peft_type(config: dict) -> str:
    return str(config.get("peft_type", "LORA")).upper()


def _group_modules(tensors, weights_path: Path) -> dict[str, dict[str, str]]:
    """Every tensor name as (module, role): {module: {role: tensor name}}; two names for one role are refused."""
    groups: dict[str, dict[str, str]] = defaultdict(dict)
    for key in tensors.names():
        module, role = _split(key)
        if role in groups[module]:  # e.g. `x.lora_A.weight` beside `x.lora_A.default.weight`: which one is it?
            raise AdapterFormatError(
                f"{weights_path}: {groups[module][role]} and {key} are the same tensor after name mapping; "
                "keep one of them",
                file=weights_path,
                tensor=key,
            )
        groups[module][role] = key
    return groups


@dataclass
class _Reading:
    """One adapter as its modules are read: what each module's reading needs, and the patches and ranks found."""

    tensors: object
    config: dict
    weights_path: Path
    config_path: Path
    patches: list[AdapterPatch] = field(default_factory=list)
    ranks: set[int] = field(default_factory=set)

    def ref(self, roles: dict[str, str], role: str) -> Ref:
        return Ref(self.tensors, roles[role])


def _read_module(reading: _Reading, module: str, roles: dict[str, str]) -> None:
    """One module's tensors -> its patches: whole tensors first, then its LoRA, then trainable tokens."""
    _saved_whole(reading, module, roles)
    if _lora(reading, module, roles):
        return  # a target_parameters LoRA is all such a module holds
    if "tokens" in roles:
        _trainable_tokens(reading, module, roles)


def _saved_whole(reading: _Reading, module: str, roles: dict[str, str]) -> None:
    """Tensors saved whole: a wrapped layer's own base weight/bias, and modules_to_save copies (of each parameter
    the trained copy is used; the `modules_to_save.` repeat and the untrained `original_module.` are accounted
    for but not used)."""
    for role in ("base_weight", "base_bias"):
        if role in roles:
            reading.patches.append(AdapterPatch(module, role.split("_")[1], Replace(reading.ref(roles, role))))
    params = {r.split(":", 1)[1] for r in roles if ":" in r}
    for param in sorted(params):
        variants = [f"{kind}:{param}" for kind in ("full", "copy", "original") if f"{kind}:{param}" in roles]
        if variants[0].startswith("original"):
            raise AdapterFormatError(
                f"{reading.weights_path}: {roles[variants[0]]} has no trained copy beside it",
                file=reading.weights_path,
                tensor=roles[variants[0]],
            )
        value, *rest = (roles[v] for v in variants)
        reading.patches.append(AdapterPatch(module, param, Replace(Ref(reading.tensors, value), tuple(rest))))


def _lora(reading: _Reading, module: str, roles: dict[str, str]) -> bool:
    """The module's LoRA pair (lora_A/lora_B or lora_embedding_A/B) as patches; True when it is a
    target_parameters LoRA (PEFT's wrapper around one of the module's parameters)."""
    weights_path = reading.weights_path
    pair = ("A", "B") if "A" in roles or "B" in roles else ("emb_A", "emb_B")
    if pair[0] not in roles and pair[1] not in roles:
        if "magnitude" in roles or "B_bias" in roles:
            raise AdapterFormatError(
                f"{weights_path}: module {module} has DoRA/bias tensors but no lora_A/lora_B", file=weights_path
            )
        return False
    if pair[0] not in roles or pair[1] not in roles:
        missing = pair[1] if pair[0] in roles else pair[0]
        raise AdapterFormatError(
            f"{weights_path}: module {module} has only half a LoRA pair "
            f"({'lora_B' if missing.endswith('B') else 'lora_A'} is missing)",
            file=weights_path,
            tensor=roles[pair[0] if pair[0] in roles else pair[1]],
        )
    down, up = reading.ref(roles, pair[0]), reading.ref(roles, pair[1])
    config = reading.config
    if (wrapped := _wrapped_parameters(module, config)) and "base_weight" not in roles and pair[0] == "A":
        reading.patches.append(_parameter_lora(module, wrapped, down, up, config, weights_path, reading.config_path))
        reading.ranks.add(reading.patches[-1].patch.rank)
        return True
    _module_lora(reading, module, roles, down, up, embedding=pair[0] == "emb_A")
    return False


def _module_lora(reading: _Reading, module: str, roles: dict[str, str], down: Ref, up: Ref, embedding: bool) -> None:
    """An ordinary LoRA on a module's weight (DoRA with a magnitude, a lora_B bias): its rank must be the one
    adapter_config.json gives; scale lora_alpha / r (rsLoRA: / sqrt(r))."""
    weights_path, config, config_path = reading.weights_path, reading.config, reading.config_path
    r = down.shape[0]
    if len(up.shape) < 2 or up.shape[1] != r:
        raise AdapterFormatError(
            f"{weights_path}: {up.name} has shape {list(up.shape)} but {down.name} has {list(down.shape)}: "
            "their ranks (lora_B dim 1, lora_A dim 0) must agree (damaged or hand-edited file)",
            file=weights_path,
            tensor=up.name,
        )
    reading.ranks.add(r)
    r_cfg = pattern_value(config.get("rank_pattern") or {}, module, config.get("r", 8), config_path)
    if r_cfg != r:
        raise AdapterFormatError(
            f"{weights_path}: {down.name} has rank {r} but adapter_config.json says r={r_cfg} for {module}",
            file=weights_path,
            tensor=down.name,
        )
    alpha = pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8), config_path)
    alpha = _number(alpha, f"lora_alpha for {module}", config_path)
    scale = lora_scale(alpha, r, bool(config.get("use_rslora", False)))
    lora = LowRank(down, up, scale, flip=embedding)
    patch = DoRA(lora, reading.ref(roles, "magnitude")) if "magnitude" in roles else lora
    fan_in_fan_out = bool(config.get("fan_in_fan_out", False))
    reading.patches.append(AdapterPatch(module, "weight", patch, stored_transposed=fan_in_fan_out or None))
    if "B_bias" in roles:
        reading.patches.append(AdapterPatch(module, "bias", BiasDelta(reading.ref(roles, "B_bias"), scale)))


def _trainable_tokens(reading: _Reading, module: str, roles: dict[str, str]) -> None:
    """PEFT's trainable tokens: new rows for the embedding's listed token ids (and a tied head's)."""
    indices = tuple(_token_indices(reading.config, module))
    rows = reading.ref(roles, "tokens")
    if rows.shape[0] != len(indices):
        raise AdapterFormatError(
            f"{reading.weights_path}: {rows.name} has {rows.shape[0]} rows "
            f"but trainable_token_indices lists {len(indices)}",
            file=reading.weights_path,
            tensor=rows.name,
        )
    reading.patches.append(AdapterPatch(module, "weight", RowReplace(rows, indices), follows_tie=True))


def _model_config(folder: Path) -> dict | None:
    """The config.json some trainers save beside the adapter (the base's, for the sanity check), if readable."""
    if (folder / "config.json").is_file():
        try:
            return json.loads((folder / "config.json").read_text())
        except json.JSONDecodeError:
            return None
    return None


def _summary(config: dict, ranks: set[int]) -> dict:
    """What `inspect` shows and the provenance records: the LoraConfig fields that decide the merge."""
    return {
        "peft_type": _peft_type(config),
        "r": config.get("r"),
        "lora_alpha": config.get("lora_alpha"),
        "ranks": sorted(ranks),
        "use_rslora": bool(config.get("use_rslora", False)),
        "use_dora": bool(config.get("use_dora", False)),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out", False)),
        "target_modules": config.get("target_modules"),
        "modules_to_save": config.get("modules_to_save"),
        "trainable_token_indices": config.get("trainable_token_indices"),
        "rank_pattern": config.get("rank_pattern") or {},
        "alpha_pattern": config.get("alpha_pattern") or {},
        "task_type": config.get("task_type"),
    }
