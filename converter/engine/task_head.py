"""A classifier trained on a causal LM's checkpoint, merged as the class it was trained as.

Reward models and classifiers are made from a published causal LM: `AutoModelForSequenceClassification
.from_pretrained(causal_lm, num_labels=1)`, a LoRA with task_type SEQ_CLS (or TOKEN_CLS), and PEFT saves the new
head (`score`) whole (modules_to_save). The base's files hold no such head, and a language-model head the
classifier does not have. The merge then writes that classifier: its head from the adapter, the LM head left
out, config.json naming the class with its labels and pad token. Which class, which of its weights the base
lacks and which base tensors it never loads are transformers' answers (its task mappings, its model built
without weights, its loading rules), asked only here: where a tensor an adapter saves whole lands on nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from converter.formats.adapter import Adapter
from converter.formats.patches import Replace
from converter.io.dtypes import FLOATING

# PEFT task types whose classes this writes, and the Auto class that loads each (what the card shows)
AUTO_CLASS = {"SEQ_CLS": "AutoModelForSequenceClassification", "TOKEN_CLS": "AutoModelForTokenClassification"}
TOKENIZER_CONFIG, TOKENIZER = "tokenizer_config.json", "tokenizer.json"


@dataclass
class TaskHead:
    """What the merge writes instead of the base's class: `class_name` (transformers'), `task_type` (the adapter's,
    or the one its head implies when it says none), `added` (tensors the base lacks, their shapes: the head the
    adapter saves whole), `dropped` (base tensors the class never loads: the LM head), `dtype` (the base's
    weights'), `config` (what config.json gets), `notes` (said before merging, kept in the provenance)."""

    class_name: str
    task_type: str
    added: dict[str, tuple[int, ...]]
    dropped: list[str]
    dtype: str
    config: dict
    notes: list[str] = field(default_factory=list)

    @property
    def auto_class(self) -> str:
        return AUTO_CLASS[self.task_type]

    def record(self) -> dict:
        """The provenance's account of it (the card reads it)."""
        return {"class": self.class_name, "auto_class": self.auto_class, "task_type": self.task_type,
                "head": sorted(self.added), "dropped": self.dropped,
                "labels": len(self.config["id2label"]), "pad_token_id": self.config.get("pad_token_id")}  # fmt: skip


def plan_head(config: dict, keys: list[str], dtypes: dict[str, str], folder: Path, adapter: Adapter) -> TaskHead | None:
    """The classifier `adapter` was trained as, where it was made from this causal-LM checkpoint (`config`, its
    tensor `keys` and their `dtypes`, its `folder`) and saves its head whole; None where it was not (the plan
    then says what lands nowhere)."""
    task = adapter.config.get("task_type")
    if task not in (*AUTO_CLASS, None) or "model_type" not in config or not _saved_as_causal_lm(config):
        return None
    whole = {f"{ap.module}.{ap.param}": tuple(ap.patch.value.shape) for ap in adapter.patches
             if isinstance(ap.patch, Replace) and not ap.flat and not ap.component}  # fmt: skip
    model = _trained(config, task, {ap.module for ap in adapter.patches if not ap.flat}, whole)
    if model is None:
        return None
    from converter.engine.model_class import task_of

    name = type(model).__name__
    taken = task or task_of(config["model_type"], name)
    own = {n: tuple(p.shape) for n, p in model.named_parameters()}
    added = {n: shape for n, shape in whole.items() if n not in keys and own.get(n) == shape}
    if taken not in AUTO_CLASS or not added:
        return None
    head = TaskHead(name, taken, added, _dropped(config, keys, model), _weights_dtype(keys, dtypes), {})
    _configure(head, model.config.num_labels, config, folder, adapter)
    head.notes.insert(0, _what(head, task, config))
    return head


def _trained(config: dict, task: str | None, modules: set[str], whole: dict[str, tuple]):
    """transformers' model of the class the adapter was trained on, hollow (None: transformers has none)."""
    from converter.engine.model_class import NoModelClass, config_object, trained_model, wait_for_warmup

    wait_for_warmup()
    try:
        return trained_model(config_object(config), task, modules, whole)
    except (NoModelClass, ImportError):
        return None


def _saved_as_causal_lm(config: dict) -> bool:
    from converter.engine.model_class import is_causal_lm, wait_for_warmup

    wait_for_warmup()
    saved_as = config.get("architectures") or []
    return bool(saved_as) and all(is_causal_lm(a) for a in saved_as)


def _dropped(config: dict, keys: list[str], model) -> list[str]:
    """Base tensors the causal LM loads and the classifier does not (its LM head), by transformers' own loading
    rules for each class."""
    from converter.engine.model_class import NoModelClass, config_object, hollow_model, unloaded_keys

    try:
        causal = hollow_model(config_object(config), config["architectures"][0])
    except (NoModelClass, ValueError, TypeError, AttributeError, ImportError):
        causal = None
    unused = set(unloaded_keys(causal, keys)) if causal is not None else set()
    return sorted(set(unloaded_keys(model, keys)) - unused)


def _weights_dtype(keys: list[str], dtypes: dict[str, str]) -> str:
    """The dtype most of the base's floating tensors have: the one a classifier built from it creates its head in."""
    counts = Counter(dtypes[k] for k in keys if dtypes[k] in FLOATING)
    return counts.most_common(1)[0][0] if counts else "F32"


def _what(head: TaskHead, said: str | None, config: dict) -> str:
    """The plan's note on what is written."""
    why = f"task_type {said}" if said else f"no task_type; its saved {', '.join(sorted(head.added))} is this class's"
    drop = f"; {', '.join(head.dropped)} (the language-model head) left out" if head.dropped else ""
    tied = "; the tied language-model head goes with it" if not head.dropped else ""
    return (f"the adapter was trained as {head.class_name} ({why}) on this {', '.join(config['architectures'])} "
            f"checkpoint: writing {head.class_name}, its head {', '.join(sorted(head.added))} from the adapter "
            f"(modules_to_save){drop}{tied}")  # fmt: skip


def _configure(head: TaskHead, labels: int, config: dict, folder: Path, adapter: Adapter) -> None:
    """config.json's class, labels and pad token id as trained (`labels`: the head's rows), with a note where the
    pad token id is not one the training config held."""
    id2label = _labels(labels, adapter.model_config or {}, config)
    head.config = {"architectures": [head.class_name], "num_labels": labels, "id2label": id2label,
                   "label2id": {v: int(k) for k, v in id2label.items()}}  # fmt: skip
    pad, where = _pad_token(adapter, config, folder)
    if pad is not None:
        head.config["pad_token_id"] = pad
    if where:
        head.notes.append(where)


def _labels(labels: int, theirs: dict, base: dict) -> dict[str, str]:
    """id2label as trained: the adapter folder's config.json's, else the base's, where it has `labels` entries;
    else transformers' default for that many labels (LABEL_0 ...)."""
    for config in (theirs, base):
        names = config.get("id2label") or {}
        if len(names) == labels:
            return {str(int(k)): str(v) for k, v in sorted(names.items(), key=lambda kv: int(kv[0]))}
    return {str(i): f"LABEL_{i}" for i in range(labels)}


def _pad_token(adapter: Adapter, config: dict, folder: Path) -> tuple[int | None, str | None]:
    """The pad token id the classifier was trained with (it scores each sequence at its last token that is not
    one), and a note saying where it came from when no training config held it: the adapter folder's config.json,
    the base's; else the tokenizer's pad token (the adapter's tokenizer, else the base's); else the eos id, as
    TRL pads; else none."""
    for source in (adapter.model_config or {}, config):
        if isinstance(source.get("pad_token_id"), int):
            return source["pad_token_id"], None
    for tokenizer in (adapter.tokenizer_dir, folder):
        if tokenizer is not None and (found := _tokenizer_pad(Path(tokenizer))) is not None:
            return found[1], f"pad_token_id {found[1]}: the tokenizer's pad token {found[0]!r} (no config held one)"
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if isinstance(eos, int):
        return eos, f"pad_token_id {eos}: the eos token id (no config or tokenizer names a pad token; TRL pads so)"
    return None, "no pad token id anywhere: the classifier scores batches of one sequence only"


def _tokenizer_pad(folder: Path) -> tuple[str, int] | None:
    """(the pad token, its id) from a tokenizer folder's files, without loading the tokenizer."""
    try:
        settings = json.loads((folder / TOKENIZER_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    pad = settings.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    if not isinstance(pad, str):
        return None
    for index, token in (settings.get("added_tokens_decoder") or {}).items():
        if isinstance(token, dict) and token.get("content") == pad:
            return pad, int(index)
    return _vocab_id(folder / TOKENIZER, pad)


def _vocab_id(path: Path, token: str) -> tuple[str, int] | None:
    """`token`'s id in a tokenizer.json: its added tokens, else its model's vocabulary."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for added in data.get("added_tokens") or []:
        if added.get("content") == token:
            return token, int(added["id"])
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return token, int(vocab[token])
    if isinstance(vocab, list):  # Unigram: [token, score] by id
        return next(((token, i) for i, entry in enumerate(vocab) if entry and entry[0] == token), None)
    return None
