"""The transformers model an adapter was trained on, and the names transformers gives its weights on load.

PEFT wraps whatever model the training script built (a causal LM, a sequence classifier, a ViT image classifier);
its module names (`distilbert.transformer...`) and the heads it saves whole (`score`, `classifier`) exist only on
that class. The class is the first of: the adapter's `task_type` (PEFT's task names, through transformers' own
task mappings), the base config's `architectures`, `AutoModel`, that holds every module the adapter names.

transformers 5 also renames some models' weights when it loads them (ViT's checkpoint key
`encoder.layer.N.attention.attention.query` is the module `layers.N.attention.q_proj`), so an adapter trained on
the loaded model names modules the checkpoint spells otherwise. `loaded_names` maps them the way
`from_pretrained` does, with transformers' own conversion mapping. transformers is imported only when one of these
is asked (verification; a merge whose adapter names do not resolve on the checkpoint as they are).
"""

from __future__ import annotations

PEFT_PREFIX = "base_model.model."
# PEFT task_type -> transformers' task mappings (modeling_auto's *_MAPPING_NAMES), asked in order: a speech or
# image model has its seq2seq / classification class in a mapping of its own.
TASK_MAPPINGS = {
    "CAUSAL_LM": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",),
    "SEQ_2_SEQ_LM": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    "SEQ_CLS": (
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    ),
    "TOKEN_CLS": ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",),
    "QUESTION_ANS": ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",),
    "FEATURE_EXTRACTION": ("MODEL_MAPPING_NAMES",),
}
# Where PEFT's own names for an adapter's tensors stop and the module path ends
_PEFT_PARTS = (".lora_", ".base_layer", ".modules_to_save", ".original_module", ".trainable_tokens_", ".token_adapter")


WARMUP_THREAD = "verify-imports"  # the thread importing transformers beside a verified merge (verification/warmup.py)


def wait_for_warmup() -> None:
    """transformers is not safe to import from two threads at once: let a warm-up import finish first."""
    import threading

    for thread in threading.enumerate():
        if thread.name == WARMUP_THREAD and thread is not threading.current_thread():
            thread.join()


class NoModelClass(Exception):
    """transformers has no class for this config (a model type it does not know)."""


def candidates(config: dict, task_type: str | None) -> list[str]:
    """transformers class names to try, in order: the task's, the base's own `architectures`, the bare model."""
    from transformers.models.auto import modeling_auto

    model_type = config.get("model_type")
    out = []
    for mapping in TASK_MAPPINGS.get(task_type or "", ()):
        out += _mapped(getattr(modeling_auto, mapping, {}), model_type)
    out += list(config.get("architectures") or [])
    out += _mapped(modeling_auto.MODEL_MAPPING_NAMES, model_type)
    if task_type is None:  # no task said: a head saved whole that none of these has may be a classifier's
        for mapping in (*TASK_MAPPINGS["SEQ_CLS"][:1], *TASK_MAPPINGS["TOKEN_CLS"]):
            out += _mapped(getattr(modeling_auto, mapping), model_type)
    return list(dict.fromkeys(out))


def _mapped(mapping: dict, model_type: str | None) -> list[str]:
    name = mapping.get(model_type)
    return list(name) if isinstance(name, list | tuple) else [name] if name else []


def task_of(model_type: str, class_name: str) -> str | None:
    """The PEFT task type whose transformers mapping gives `class_name` for this model type (None: none does)."""
    from transformers.models.auto import modeling_auto

    for task, mappings in TASK_MAPPINGS.items():
        if any(class_name in _mapped(getattr(modeling_auto, m, {}), model_type) for m in mappings):
            return task
    return None


def is_causal_lm(class_name: str) -> bool:
    """Whether transformers' causal-LM mapping names this class (for any model type)."""
    from transformers.models.auto import modeling_auto

    names = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return any(class_name == n or (isinstance(n, list | tuple) and class_name in n) for n in names)


def adapter_modules(keys) -> set[str]:
    """The module paths (in the model PEFT wrapped) that PEFT tensor names `keys` belong to."""
    out = set()
    for key in keys:
        key = key.removeprefix(PEFT_PREFIX)
        cut = min((i for part in _PEFT_PARTS if (i := key.find(part)) >= 0), default=None)
        out.add(key[:cut] if cut is not None else key.rpartition(".")[0])
    return out


def folder_config(folder):
    """transformers' config object of a model folder; NoModelClass when transformers cannot read it (a model
    type it does not know, remote code)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (KeyError, ValueError, OSError) as e:
        first = (str(e).splitlines() or [""])[0][:160]
        raise NoModelClass(f"transformers cannot read {folder}'s config ({first})") from None


def config_object(config: dict):
    """transformers' config object for a config.json's contents."""
    from transformers import AutoConfig

    rest = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(config["model_type"], **rest)
    except (KeyError, ValueError) as e:
        raise NoModelClass(f"transformers does not know the model type {config.get('model_type')!r}") from e


def hollow_model(config, class_name: str):
    """`class_name` built from `config` on the meta device (no memory), float32."""
    import torch
    import transformers
    from accelerate import init_empty_weights

    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise NoModelClass(f"transformers has no class {class_name}")
    with init_empty_weights():
        return cls._from_config(config, dtype=torch.float32)


_CHOSEN: dict[tuple, str] = {}  # what trained_model chose, so the behaviour check after the proof builds nothing


def trained_model(config, task_type: str | None, modules: set[str], whole: dict[str, tuple] | None = None):
    """The hollow model the adapter was trained on: the first candidate class holding every module in `modules`
    (else the first that builds, whose refusal PEFT will then word). NoModelClass: none builds. `whole`: the
    shapes of the weights the adapter holds whole (PEFT's modules_to_save), by their names in the model: a
    classifier's head is built with as many labels as the adapter's head has rows (fit_labels)."""
    key, first, tried = _key(config, task_type, modules), None, []  # (building a model sets fields of its config)
    for name in candidates(config.to_dict(), task_type):
        try:
            model = hollow_model(config, name)
        except (NoModelClass, ValueError, TypeError, AttributeError, ImportError) as e:
            tried.append(f"{name}: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}")
            continue
        own = {n for n, _ in model.named_modules()}
        if modules <= own:
            first = model
            break
        first = first or model
    if first is None:
        raise NoModelClass("no transformers class builds this model (" + "; ".join(tried or ["none known"]) + ")")
    _CHOSEN[key] = type(first).__name__
    return fit_labels(first, config, whole or {})


def fit_labels(model, config, whole: dict[str, tuple]):
    """`model` rebuilt with `num_labels` set to the rows of the adapter's saved head, where the config's label
    count (2 unless it says otherwise) builds the head another size: a classifier made from a checkpoint saved
    without one (`from_pretrained(causal_lm, num_labels=1)`) was trained with the head the adapter saved. Kept
    as it is where no label count makes more of the `whole` shapes fit."""
    import copy

    def off(m) -> set[str]:
        own = {n: tuple(p.shape) for n, p in m.named_parameters()}
        return {n for n, shape in whole.items() if n in own and own[n] != tuple(shape)}

    wrong = off(model)
    for rows in sorted({whole[n][0] for n in wrong if whole[n]}):
        trial = copy.deepcopy(config)
        trial.num_labels = rows
        candidate = hollow_model(trial, type(model).__name__)
        left = off(candidate)
        if left < wrong:
            return candidate
    return model


def trained_class(config, task_type: str | None, modules: set[str]) -> str:
    """The name of trained_model's class (remembered from an earlier call with the same question)."""
    known = _CHOSEN.get(_key(config, task_type, modules))
    return known or type(trained_model(config, task_type, modules)).__name__


def _key(config, task_type: str | None, modules: set[str]) -> tuple:
    return config.to_json_string(use_diff=False), task_type, frozenset(modules)


class LoadingRulesUnreadable(Exception):
    """transformers' loading rules could not be asked here (its internals moved): the names are taken as they are."""


def loaded_names(model, keys) -> dict[str, str | None]:
    """{name in `model`: the checkpoint key transformers' `from_pretrained` loads it from}, for every key in `keys`
    (a key it keeps as it is maps to itself), by its own rules: the conversion mapping of the model's class and
    its submodels, applied as its loader applies it (`rename_source_key`, then again with only the base-model
    prefix added or removed). None where a weight is built by a conversion (fused, split), not only renamed.
    Ask before PEFT wraps the modules (its `base_layer.` names are not the model's). A model that is not
    transformers' keeps every name."""
    keys = list(keys)
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import dot_natural_key
    except ImportError as e:
        raise LoadingRulesUnreadable(f"transformers' loading rules cannot be read here ({e})") from None
    if not isinstance(model, PreTrainedModel):
        return {k: k for k in keys}
    try:
        converters, pairs = _loaded(model, sorted(keys, key=dot_natural_key))
    except ImportError as e:
        raise LoadingRulesUnreadable(f"transformers' loading rules cannot be read here ({e})") from None
    out: dict[str, str | None] = {}
    for key, loaded, source in pairs:
        if source is not None:  # every weight the converter makes (it names the first target)
            targets = next((c.target_patterns for c in converters if source in c.source_patterns), [])
            out[loaded] = None
            for target in targets[1:]:
                if targets[0] in loaded:
                    out[loaded.replace(targets[0], target)] = None
        else:
            out.setdefault(loaded, key)
    return out


def _loaded(model, keys: list[str]) -> tuple[list, list[tuple[str, str, str | None]]]:
    """transformers' converters for `model`, and per checkpoint key (key, the name it loads as, the converter's
    source pattern or None), by its own loader: its renames and converters, then only the base-model prefix
    added or removed."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix, meta = model.base_model_prefix, model.state_dict()  # a weightless model's: stand-ins, no memory
    pairs = []
    for key in keys:
        loaded, source = rename_source_key(key, renamings, converters, prefix, meta)
        if loaded not in meta and key in meta:  # as transformers' loader: only the base-model prefix, then
            loaded, source = rename_source_key(key, [], [], prefix, meta)
        pairs.append((key, loaded, source))
    return converters, pairs


def unloaded_keys(model, keys) -> list[str]:
    """The checkpoint keys `model`'s `from_pretrained` would report as unexpected: neither loaded under a name
    the model has nor converted into one of its weights (LoadingRulesUnreadable: transformers' rules moved)."""
    try:
        _, pairs = _loaded(model, list(keys))
    except ImportError as e:
        raise LoadingRulesUnreadable(f"transformers' loading rules cannot be read here ({e})") from None
    meta = model.state_dict()
    return [key for key, loaded, source in pairs if source is None and loaded not in meta]


class LoadedNames:
    """A transformers checkpoint's keys by the names its model has once loaded, asked only for adapter modules
    that name no checkpoint key as they are (so a merge whose names resolve never imports transformers).
    `key(name)`: the checkpoint key loaded as `name`; None where transformers does not rename it; Converted where
    it converts the weight (fused, split) rather than renames it."""

    def __init__(self, config: dict, keys, task_type: str | None, modules: set[str]):
        self.config, self.keys, self.task_type, self.modules = config, keys, task_type, modules
        self._names: dict[str, str | None] | None = None

    def key(self, name: str) -> str | None:
        if self._names is None:
            self._names = self._build()
        if name in self._names and self._names[name] is None:
            raise Converted(name)
        return self._names.get(name)

    def _build(self) -> dict[str, str | None]:
        if "model_type" not in self.config:
            return {}
        wait_for_warmup()
        try:
            model = trained_model(config_object(self.config), self.task_type, self.modules)
        except (NoModelClass, ImportError):
            return {}
        return loaded_names(model, self.keys)


class Converted(Exception):
    """transformers builds this loaded weight from checkpoint tensors by more than a rename."""
