"""PEFT as the referee of every changed tensor: what PEFT itself would merge, module by module.

The base model, of the class the adapters were trained on (their task_type, else the config's architectures:
`converter.engine.model_class`), is built on the meta device and each weight replaced by a
zero-stride stand-in of its shape (no memory); PEFT then loads the adapters onto it for real, from their files,
with its own parsing, its own module names (`base_model.model.<path>`) and its own rules: scaling (alpha/r,
rsLoRA, rank/alpha patterns), fan_in_fan_out, DoRA, modules_to_save, trainable tokens, the recipe's weights
through `set_scale` as PEFT's own multi-adapter forward uses them. Nothing of converter's adapter readers,
keymaps or plan is used. When the proof asks for a tensor, the module gets the base's rows as its weight and its
adapter factors in the proof's working precision (float64 for 32-bit outputs, float32 for 16-bit ones), and PEFT's
own `merge()` computes the rows (`get_delta_weight` inside); then the stand-in is put back. One module's rows are
real at a time, beside the adapters themselves. Where transformers saves a weight under another name than the
loaded model's (ViT in transformers 5), the tensor is found by transformers' own save-direction renames.
TIES / DARE / magnitude pruning: combination.py.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

from converter.engine.model_class import NoModelClass, adapter_modules, folder_config, trained_model
from converter.engine.recipe import Recipe
from converter.io.safetensors_file import SafetensorsFile
from converter.verification.loading import load_results, peft_refusals, require_all_loaded, require_trained_scales
from converter.verification.peft_experts import WholeParameters, piece_expectations, saved_one_by_one, saved_pieces
from converter.verification.peft_names import older_name_mapping
from converter.verification.referee import Expectation, Expected, RefereeInfo, RefereeUnavailable, gamma

PREFIX = "base_model.model."
ROW_BLOCKED = ("Linear", "Embedding")  # PEFT layer classes whose rows can be merged a block at a time


class PeftLayers:
    """The expectations of every PEFT layer in one module tree: `strip` is removed from module paths (PEFT's
    `base_model.model.`), `namespace` put before tensor names (a diffusers component's `unet/`), `names` are the
    adapter names in recipe order and `specs` their recipe entries (include/exclude), `base_names` the base's
    tensor names, `ties` tensor names tied to another (a head to the embedding)."""

    def __init__(self, root, strip: str, namespace: str, names: list[str], specs: list, base_names: set[str],
                 ties: dict[str, str] | None = None, quantized=None,
                 saved: dict[str, str | None] | None = None):  # fmt: skip
        self.root, self.strip, self.namespace = root, strip, namespace
        self.names, self.specs, self.base_names, self.ties = names, specs, base_names, ties or {}
        self.quantized = quantized  # (layer -> the 4-bit round trip of its weight) for QLoRA's dequantized base
        self.saved = saved or {}  # a weight's name in the model -> its name in the files, where transformers renames
        # transformers' base-model prefix (`transformer`, `bert` ...), which a checkpoint may have without or with
        # where the loaded model has it the other way (it adds or strips it on load, as here)
        self.prefix = getattr(root, "base_model_prefix", "") if strip else ""
        self.whole = WholeParameters()  # fused expert parameters PEFT merged whole, read by their file tensors

    def expectations(self) -> dict[str, Expectation]:
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import ModulesToSaveWrapper

        out: dict[str, Expectation] = {}
        for path, module in self.root.named_modules():
            plain = path.removeprefix(self.strip)
            if isinstance(module, ModulesToSaveWrapper):
                out.update(self._replacement(plain, module))
            elif hasattr(module, "trainable_tokens_delta"):
                out.update(self._tokens(plain, module))
            elif isinstance(module, LoraLayer):
                out.update(self._lora(plain, module))
        return {**out, **self._untied_heads(out)}

    def _untied_heads(self, changed: dict[str, Expectation]) -> dict[str, Expectation]:
        """A head tied to an embedding the adapters change (by LoRA or a replacement) sees the base's embedding
        in PEFT's forward: written untied, it must be that (trainable tokens keep the tie: PEFT ties them too)."""
        out = {}
        for head, source in self.ties.items():
            head, source = self.namespace + head, self.namespace + source
            rule = changed.get(source)
            if head in self.base_names or head in changed or rule is None or rule.kind == "trainable tokens":
                continue
            out[head] = Expectation(rule.module, "untied head (the base's embedding)", _same, True, source)
        return out

    def _admitted(self, layer, tensor: str) -> list[str]:
        """This layer's adapters the recipe applies to `tensor` (include/exclude), in recipe order."""
        own = set(getattr(layer, "lora_A", {})) | set(getattr(layer, "lora_embedding_A", {}))
        own |= set(getattr(layer, "trainable_tokens_delta", {})) | set(getattr(layer, "modules_to_save", {}))
        return [n for n, spec in zip(self.names, self.specs, strict=True)
                if n in own and spec.admits(tensor)]  # fmt: skip

    def _tensor(self, plain: str, param: str = "weight") -> tuple[str, str | None]:
        """The output tensor of a module's parameter, and the base tensor it starts from when that is another
        (a tied head, absent from the base's files, starts from the embedding)."""
        found = self._located(plain, param)
        if found is None:
            raise RefereeUnavailable(
                f"PEFT's module {plain} has no tensor {self.namespace}{plain}.{param} in the base's files (this "
                "model's weights are renamed or fused when it is loaded)"
            )
        return found

    def _located(self, plain: str, param: str) -> tuple[str, str | None] | None:
        """_tensor's answer; None where the base's files hold no such tensor."""
        name = f"{self.namespace}{plain}.{param}"
        if name in self.base_names:
            return name, None
        if self.prefix:
            other = plain.removeprefix(f"{self.prefix}.") if plain.startswith(f"{self.prefix}.") else (
                f"{self.prefix}.{plain}")  # fmt: skip
            if f"{self.namespace}{other}.{param}" in self.base_names:
                return f"{self.namespace}{other}.{param}", None
        if f"{plain}.{param}" in self.saved:  # transformers saves this weight under another name
            stored = self.saved[f"{plain}.{param}"]
            if stored is None:
                raise RefereeUnavailable(f"PEFT's module {plain}: transformers converts its {param} (fused or split) "
                                         "when it saves or loads the model, not only renames it")  # fmt: skip
            if f"{self.namespace}{stored}" in self.base_names:
                return f"{self.namespace}{stored}", None
        tied = self.ties.get(f"{plain}.{param}")
        if tied and f"{self.namespace}{tied}" in self.base_names:
            return name, f"{self.namespace}{tied}"
        return None

    def _lora(self, plain: str, layer) -> dict[str, Expectation]:
        kind = type(layer).__name__
        if kind == "ParamWrapper":
            return self._parameter(plain, layer)
        if kind not in ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d"):
            raise RefereeUnavailable(f"PEFT's {kind} layer at {plain} has no merge this referee can replay")
        name, base_name = self._tensor(plain)
        adapters = self._admitted(layer, name)
        if not adapters:
            return {}
        dora = any(n in getattr(layer, "lora_magnitude_vector", {}) for n in adapters)
        blocks = kind in ROW_BLOCKED and not getattr(layer, "fan_in_fan_out", False) and not (dora and kind != "Linear")
        module = self.strip + plain
        first = self.quantized(layer) if self.quantized else None  # the base as QLoRA training saw it
        blocks = blocks and first is None
        out = {name: Expectation(module, "DoRA" if dora else "LoRA", _merged_rows(layer, adapters, blocks, first),
                                 blocks, base_name)}  # fmt: skip
        if any(getattr(layer, "lora_bias", {}).get(n) for n in adapters):
            out[self._tensor(plain, "bias")[0]] = Expectation(module, "LoRA bias", _merged_bias(layer, adapters))
        return out

    def _parameter(self, plain: str, layer) -> dict[str, Expectation]:
        """A `target_parameters` LoRA (one ParamWrapper per parameter, nested, on fused MoE experts): PEFT's merge
        of the whole parameter (its own expert layout: (E, out, in) or (E, in, out) by the model)."""
        owner = plain.replace(".base_layer", "")  # the nested wrappers sit at <module>(.base_layer)*
        if self.saved.get(f"{owner}.{layer.parameter_name}", "") is None and not self._located_plain(owner, layer):
            return self._expert_pieces(owner, layer)  # fused when loaded, one tensor per expert in the files
        name, _ = self._tensor(owner, layer.parameter_name)
        adapters = self._admitted(layer, name)
        if not adapters:
            return {}
        return {name: Expectation(self.strip + owner, "LoRA (target_parameters)", _merged_parameter(layer, adapters))}

    def _located_plain(self, owner: str, layer) -> bool:
        return f"{self.namespace}{owner}.{layer.parameter_name}" in self.base_names

    def _expert_pieces(self, owner: str, layer) -> dict[str, Expectation]:
        """A fused parameter the base's files hold per expert: each file tensor (found by transformers' save
        direction) gets its rows of PEFT's merge of the whole parameter (peft_experts)."""
        model = getattr(getattr(self.root, "base_model", None), "model", self.root)
        shape = tuple(layer.get_param().shape)
        pieces = {self.namespace + k: v for k, v in saved_pieces(model, f"{owner}.{layer.parameter_name}",
                                                                    shape).items()}  # fmt: skip
        missing = sorted(set(pieces) - self.base_names)
        if missing:
            raise RefereeUnavailable(f"PEFT's parameter {owner}.{layer.parameter_name} is saved as {missing[0]}, "
                                     "which the base's files do not hold")  # fmt: skip
        return piece_expectations(pieces, self.strip + owner, lambda n: self._admitted(layer, n),
                                  lambda adapters: _merged_parameter(layer, adapters), shape, self.whole,
                                  id(layer))  # fmt: skip

    def _replacement(self, plain: str, wrapper) -> dict[str, Expectation]:
        """A modules_to_save copy: PEFT's own tensor, whatever the base holds; where the base's files hold none (a
        classifier's head, made from a checkpoint saved without it), the output must add it as it is."""
        out = {}
        for pname, _ in wrapper.original_module.named_parameters():
            found = self._located(plain, pname)
            name = found[0] if found else f"{self.namespace}{plain}.{pname}"
            adapters = self._admitted(wrapper, name)
            if adapters:  # a replacement ignores the weight; the last adapter that replaces it wins
                value = dict(wrapper.modules_to_save[adapters[-1]].named_parameters())[pname]
                out[name] = Expectation(f"{self.strip}{plain}.modules_to_save.{adapters[-1]}", "replacement",
                                        _constant(value), shape=tuple(value.shape), added=found is None)  # fmt: skip
        return out

    def _tokens(self, plain: str, layer) -> dict[str, Expectation]:
        plain = plain.removesuffix(".token_adapter")
        tied = getattr(layer, "tied_adapter", None) is not None
        if tied and f"{self.namespace}{plain}.weight" not in self.base_names:
            return {}  # a head tied to the embedding stays tied: it is the embedding's tensor
        name, base_name = self._tensor(plain)
        adapters = self._admitted(layer, name)
        if not adapters:
            return {}
        return {name: Expectation(self.strip + plain, "trainable tokens", _token_rows(layer, adapters), True,
                                  base_name)}  # fmt: skip


class PeftReferee:
    """PEFT's merge of `adapters` (PEFT folders) into the base at `base` (a transformers folder)."""

    def __init__(self, base: Path, adapters: list[Path], recipe: Recipe, base_names: set[str], vocab: int | None):
        self.names = [f"adapter{i}" for i in range(len(adapters))]
        self.model = hollow_peft_model(Path(base), [Path(a) for a in adapters], self.names, vocab)
        model_class = type(self.model.base_model.model).__name__
        for name, spec in zip(self.names, recipe.adapters, strict=True):  # the recipe's weights, as PEFT scales
            for module in self.model.modules():
                if hasattr(module, "set_scale") and name in getattr(module, "scaling", {}):
                    module.set_scale(name, spec.weight_for(None))
        self.layers = PeftLayers(self.model, PREFIX, "", self.names, recipe.adapters, base_names,
                                 _tied_sources(self.model), _qlora_base(self.model, recipe),
                                 self.model.saved_names)  # fmt: skip
        self.info = RefereeInfo(
            "PEFT",
            f"PEFT's own merge of each module (get_delta_weight, DoRA, modules_to_save, trainable tokens) on "
            f"{model_class}, located by PEFT's module names, adapter files read by PEFT, in float64 (float32 for "
            "16-bit outputs)",
        )
        self.dropped: list[str] = []  # base tensors the output leaves out: the model PEFT wraps has none of them

    def expectations(self) -> dict[str, Expectation]:
        rules = self.layers.expectations()
        if any(r.added for r in rules.values()):  # a classifier's head the base lacks
            self.dropped = not_in_model(self.model.base_model.model, self.layers.base_names)
        return rules


def not_in_model(model, names: set[str]) -> list[str]:
    """Base tensors of top-level modules `model` does not have, nor its base model (a causal LM's `lm_head` in a
    sequence classifier, which has `model` and `score`): what the model never loads from those files."""
    own = {n for n, _ in model.named_children()}
    inner = getattr(model, getattr(model, "base_model_prefix", ""), None)
    own |= {n for n, _ in inner.named_children()} if inner is not None and inner is not model else set()
    return sorted(n for n in names if n.split(".", 1)[0] not in own)


def _qlora_base(model, recipe: Recipe):
    """--qlora-base dequantized: the merge starts from each LoRA-targeted linear weight as load_in_4bit held it
    in training (bitsandbytes' round trip with the recipe's settings); the output head stays as it is."""
    if recipe.qlora_base != "dequantized":
        return None
    head = model.get_output_embeddings()

    def quantized(layer):
        if type(layer).__name__ != "Linear" or getattr(layer, "fan_in_fan_out", False) or layer is head:
            return None
        return lambda base: _round_trip_4bit(base, recipe)

    return quantized


def _round_trip_4bit(base, recipe: Recipe):
    import bitsandbytes.functional as bnb

    packed, state = bnb.quantize_4bit(base.float(), quant_type=recipe.qlora_quant, blocksize=recipe.qlora_blocksize,
                                      compress_statistics=recipe.qlora_double_quant)  # fmt: skip
    return bnb.dequantize_4bit(packed, state).to(base.dtype)


def hollow_peft_model(base: Path, adapters: list[Path], names: list[str], vocab: int | None, before_peft=None):
    """The base's module tree on no memory (the model class the adapters were trained on), PEFT's adapters
    loaded onto it for real. `before_peft(model, written, saved)` sees the hollow base before PEFT wraps it
    (`written`: the weights an adapter file holds whole; `saved`: saved_names)."""
    from peft import PeftModel

    whole = _whole_shapes(adapters)
    try:
        config = folder_config(base)
        model = trained_model(config, task_type(adapters), adapter_modules(adapter_keys(adapters)), whole)
    except NoModelClass as e:
        raise RefereeUnavailable(f"PEFT needs the base's transformers model: {e}") from None
    saved = saved_names(model)  # before PEFT wraps the modules (and renames their weights `base_layer.`)
    vocab = vocab or _adapter_vocab(model, adapters)
    written = _saved_base_weights(adapters) | _heads_base_lacks(base, whole)
    ties = {k: v for k, v in dict(getattr(model, "all_tied_weights_keys", None) or {}).items() if isinstance(v, str)}
    written |= {v for k, v in ties.items() if k in written} | {k for k, v in ties.items() if v in written}
    hollow(model, written)
    if vocab and _embedding_rows(model) not in (None, vocab):
        model.resize_token_embeddings(vocab)  # the adapters were trained on a resized vocabulary
        hollow(model, written)
    if before_peft is not None:
        before_peft(model, written, saved)
    renamed = {"key_mapping": older_name_mapping(model, adapters) or None}  # transformers 4's module names
    with load_results() as results, peft_refusals():
        model = PeftModel.from_pretrained(model, adapters[0], adapter_name=names[0], **renamed)
        for name, path in zip(names[1:], adapters[1:], strict=True):
            model.load_adapter(path, adapter_name=name, **renamed)
    require_all_loaded(results, adapters)
    require_trained_scales(model, names, adapters)
    model.saved_names = saved
    return model


def task_type(adapters: list[Path]) -> str | None:
    """The PEFT task_type the adapters were trained for (the first that says one)."""
    import json

    for folder in adapters:
        try:
            task = json.loads((folder / "adapter_config.json").read_text()).get("task_type")
        except (OSError, ValueError):
            continue
        if task:
            return task
    return None


def adapter_keys(adapters: list[Path]) -> list[str]:
    files = [f for folder in adapters for f in folder.glob("adapter_model*.safetensors")]
    return [k for f in files for k in SafetensorsFile(f).tensors]


def _embedding_rows(model) -> int | None:
    """The input embedding's rows, None for a model without a token embedding (a ViT's is a patch projection)."""
    try:
        weight = getattr(model.get_input_embeddings(), "weight", None)
    except (NotImplementedError, AttributeError):
        return None
    return weight.shape[0] if weight is not None and weight.dim() == 2 else None


def saved_names(model) -> dict[str, str | None]:
    """A weight's name in the loaded model -> its name in the files, where they differ: transformers' own save
    direction (`revert_weight_conversion`, what `save_pretrained` writes), asked of every weight at once on
    one-element stand-ins; None where the saved tensor is converted (fused, split), not only renamed."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    names = [n for n, _ in model.named_parameters()]
    try:
        saved = revert_weight_conversion(model, {n: torch.tensor([float(i)]) for i, n in enumerate(names)})
    except Exception:  # a conversion that cannot run on one-element stand-ins (fused experts): one at a time
        return saved_one_by_one(model, names)
    out: dict[str, str | None] = {}
    for key, value in saved.items():
        if value.numel() != 1:
            continue
        name = names[int(value.item())]
        if name != key:
            out[name] = key
    for name in set(names) - {names[int(v.item())] for v in saved.values() if v.numel() == 1}:
        out[name] = None  # gone into a tensor of several weights
    return out


def hollow(model, written: set[str] = frozenset()) -> None:
    """Every parameter and buffer still on the meta device becomes a zero-stride CPU tensor of its shape and dtype
    (no memory), so PEFT places what it loads next to it, on the CPU (next to meta it would load nothing). The
    parameters in `written` (base weights an adapter file holds whole, such as an embedding PEFT saved with its
    LoRA) get unbacked memory instead (address space; a page is real once PEFT writes it)."""
    import torch

    for path, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.device.type == "meta":
                full = f"{path}.{name}" if path else name
                stand_in = torch.empty(p.shape, dtype=p.dtype) if full in written else torch.zeros(
                    (), dtype=p.dtype).expand(p.shape)  # fmt: skip
                module._parameters[name] = torch.nn.Parameter(stand_in, requires_grad=False)
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.device.type == "meta":
                module._buffers[name] = torch.zeros((), dtype=b.dtype).expand(b.shape)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def _saved_base_weights(adapters: list[Path]) -> set[str]:
    """Base weights the adapter files hold whole (PEFT saves an adapted embedding's `base_layer.weight`), by
    their names in the model (read from the files' headers)."""
    names = set()
    for folder in adapters:
        for f in folder.glob("adapter_model*.safetensors"):
            for key in SafetensorsFile(f).tensors:
                if ".base_layer." in key and "lora_" not in key:
                    names.add(key.removeprefix(PREFIX).replace(".base_layer.", "."))
    return names


def _whole_shapes(adapters: list[Path]) -> dict[str, tuple[int, ...]]:
    """The weights the adapter files hold whole (modules_to_save: no LoRA factor, no base layer), by their names
    in the model, with their shapes (read from the files' headers)."""
    out = {}
    for folder in adapters:
        for f in folder.glob("adapter_model*.safetensors"):
            for key, t in SafetensorsFile(f).tensors.items():
                if not any(part in key for part in ("lora_", "base_layer", "trainable_tokens", "token_adapter")):
                    out[key.removeprefix(PREFIX)] = tuple(t.shape)
    return out


def _heads_base_lacks(base: Path, whole: dict[str, tuple[int, ...]]) -> set[str]:
    """Of `whole`, the weights the base's files do not hold (a classifier's head): PEFT's copy of them gets real
    memory, and a reader of the base's files has nothing to read for them."""
    names = {k for f in base.glob("*.safetensors") for k in SafetensorsFile(f).tensors}
    return {n for n in whole if n not in names}


def _adapter_vocab(model, adapters: list[Path]) -> int | None:
    """The vocabulary the adapters were trained on, when their files hold the input embedding whole (PEFT saves
    it with a resized vocabulary: modules_to_save, or save_embedding_layers): its rows, from the files' headers.
    For an output not written yet (a pipelined push proves its shards as they come), whose config says nothing."""
    if _embedding_rows(model) is None:
        return None  # no token embedding (a vision or audio model)
    embedding = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    rows = {t.shape[0] for folder in adapters for f in folder.glob("adapter_model*.safetensors")
            for k, t in SafetensorsFile(f).tensors.items()
            if k.startswith(f"{PREFIX}{embedding}.") and len(t.shape) == 2
            and not any(part in k for part in ("lora_", "trainable_tokens", "token_adapter"))}  # fmt: skip
    return max(rows) if rows else None


def _tied_sources(model) -> dict[str, str]:
    """Tensor names the model ties to another (the head to the embedding), as transformers declares them."""
    ties = getattr(model.base_model.model, "all_tied_weights_keys", None) or {}
    return {k: v for k, v in dict(ties).items() if isinstance(v, str)}


def _adapters_in(layer, dtype) -> None:
    """The adapters' own tensors (never the base's stand-ins) in `dtype`, converted from their loaded values
    (kept aside the first time), so PEFT computes in the proof's working precision."""
    originals = layer.__dict__.setdefault("_proof_originals", {})
    for name, p in layer.named_parameters():
        if "base_layer" in name:
            continue
        original = originals.setdefault(name, p.data)
        if p.dtype != dtype:
            p.data = original.to(dtype)


@contextmanager
def _swapped(pairs: list[tuple[object, str, object]]):
    """Set module parameters (owner, attribute, tensor) for the duration; put the originals back after."""
    import torch

    saved = [(owner, attr, owner._parameters[attr]) for owner, attr, _ in pairs]
    try:
        for owner, attr, value in pairs:
            owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
        yield
    finally:
        for owner, attr, original in saved:
            owner._parameters[attr] = original


def _row_slices(layer, adapters: list[str], start: int, end: int) -> list[tuple[object, str, object]]:
    """The adapter factors that produce rows start:end of the merged weight (PEFT's Linear: lora_B's rows, its
    bias and DoRA's magnitudes; Embedding: lora_embedding_A's columns)."""
    pairs = []
    for n in adapters:
        if type(layer).__name__ == "Embedding":
            pairs.append((layer.lora_embedding_A, n, layer.lora_embedding_A[n][:, start:end]))
            continue
        b = layer.lora_B[n]
        pairs.append((b, "weight", b.weight[start:end]))
        if b.bias is not None:
            pairs.append((b, "bias", b.bias[start:end]))
        if n in getattr(layer, "lora_magnitude_vector", {}):
            m = layer.lora_magnitude_vector[n]
            pairs.append((m, "weight", m.weight[start:end]))
    return pairs


def _merged_rows(layer, adapters: list[str], blocks: bool, first=None):
    """rows(base, start, end): PEFT's merge of these adapters onto the base rows, and the float32 allowance of a
    merge computing the same in float32 (γ_r over |scale|·|B|@|A| per adapter, DoRA's norm on top). `first`:
    what becomes of the base before the merge (QLoRA's 4-bit round trip), whole tensors only."""

    def rows(base, start: int, end: int) -> Expected:
        _adapters_in(layer, base.dtype)
        if first is not None:
            base = first(base)
        slices = _row_slices(layer, adapters, start, end) if blocks else []
        real = layer.get_base_layer()
        if getattr(real, "bias", None) is not None and any(getattr(layer, "lora_bias", {}).get(n) for n in adapters):
            # PEFT's merge adds lora_bias into the bias too (judged apart, _merged_bias): real memory to write to
            slices.append((real, "bias", _writable(real.bias, slices, start, end)))
        with _swapped([(real, "weight", base), *slices]):  # the base rows become the merged rows
            layer.merge(adapter_names=adapters)
            value = real.weight.data
            allowance = _allowance(layer, adapters, value)
        layer.merged_adapters.clear()
        layer._caches.clear()
        return Expected(value, allowance)

    return rows


def _writable(bias, slices: list, start: int, end: int):
    """A zero bias for the rows being merged (all of them when not merged a block at a time)."""
    import torch

    return torch.zeros(end - start if slices else bias.shape[0], dtype=bias.dtype)


def _merged_parameter(layer, adapters: list[str]):
    """rows(base, 0, n): PEFT's merge of a ParamWrapper's adapters onto the whole parameter; the float32
    allowance γ_r · |scale| · |B|@|A| per expert, laid out by PEFT itself (its delta of the factors' magnitudes)."""

    def rows(base, start: int, end: int) -> Expected:
        _adapters_in(layer, base.dtype)
        owner = layer.get_base_layer()
        with _swapped([(owner, layer.parameter_name, base.clone())]):
            layer.merge(adapter_names=adapters)
            value = getattr(owner, layer.parameter_name).data
            allowance = _parameter_allowance(layer, adapters, value)
        layer.merged_adapters.clear()
        return Expected(value, allowance)

    return rows


def _parameter_allowance(layer, adapters: list[str], value):
    import torch

    twice = 2.0 if value.dtype == torch.float32 else 1.0
    total = torch.zeros_like(value)
    for n in adapters:
        a, b = layer.lora_A[n], layer.lora_B[n]
        rank = a.weight.shape[0] // max(getattr(layer, "num_experts", 1), 1)
        with _swapped([(a, "weight", a.weight.abs()), (b, "weight", b.weight.abs())]):
            total += layer.get_delta_weight(n).abs().to(value.dtype) * (twice * gamma(rank))
    return total


def _allowance(layer, adapters: list[str], value):
    """What float32 arithmetic may add, as a function of flat positions in `value` (the proof asks only where
    an element is not exactly the rounded expectation): per adapter γ_r · |scale| · |B|@|A|, bounded by
    Cauchy-Schwarz as |scale| · ‖B's row‖ · ‖A's column‖ (vectors now, products later), twice when the referee
    itself computes in float32; for DoRA, ΔW's share scaled by m/‖W+ΔW‖, and its norm's error (γ over half a
    row) on the merged value."""
    import torch

    twice = 2.0 if value.dtype == torch.float32 else 1.0
    terms, dora_inner = [], 0
    for n in adapters:
        a, b = _factors(layer, n)
        rows = b.norm(dim=1).to(value.dtype) * (twice * gamma(a.shape[0]) * abs(layer.scaling[n]))
        cols = a.norm(dim=0).to(value.dtype)
        norm = layer._caches.get(f"{n}-weight_norm")
        if n in getattr(layer, "lora_magnitude_vector", {}):
            dora_inner = max(dora_inner, math.prod(value.shape[1:]) // 2)
            if norm is not None:  # DoRA scales ΔW's error by m/‖W+ΔW‖, one factor per output feature: B's rows
                rows = rows * (layer.lora_magnitude_vector[n].weight / norm).abs().reshape(-1).to(value.dtype)
        if getattr(layer, "fan_in_fan_out", False) or type(layer).__name__ == "Embedding":
            rows, cols = cols, rows  # stored (in, out) / (vocab, dim): B's side is the columns
        terms.append((rows, cols))
    flat_value = value.reshape(-1)
    width = math.prod(value.shape[1:]) if value.dim() > 1 else 1

    def at(flat):
        total = sum(r[flat // width] * c[flat % width] for r, c in terms)
        if dora_inner:
            total = total + twice * gamma(dora_inner) * flat_value[flat].abs()
        return total

    return at


def _factors(layer, n: str):
    """(A, B) of one adapter as matrices: A (r, in · kernel), B (out, r)."""
    if type(layer).__name__ == "Embedding":
        return layer.lora_embedding_A[n], layer.lora_embedding_B[n]
    a, b = layer.lora_A[n].weight, layer.lora_B[n].weight
    return a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)


def _merged_bias(layer, adapters: list[str]):
    """PEFT's lora_bias: the base bias + scale · lora_B's bias, per adapter (as its merge adds it)."""

    def rows(base, start: int, end: int) -> Expected:
        value = base.clone()
        for n in adapters:
            value = value + layer.lora_B[n].bias.to(base.dtype)[start:end] * layer.scaling[n]
        return Expected(value, gamma(0) * value.abs())

    return rows


def _token_rows(layer, adapters: list[str]):
    """PEFT's trainable tokens: its merge writes each adapter's rows over the base's (rows start:end only)."""

    def rows(base, start: int, end: int) -> Expected:
        _adapters_in(layer, base.dtype)
        saved = {n: (layer.token_indices[n], layer.trainable_tokens_delta[n]) for n in adapters}
        real = layer.base_layer
        try:
            for n in adapters:
                keep = [i for i, t in enumerate(saved[n][0]) if start <= t < end]
                layer.token_indices[n] = [saved[n][0][i] - start for i in keep]
                layer.trainable_tokens_delta[n] = saved[n][1][keep]
            with _swapped([(real, "weight", base.clone())]):
                layer.merge(adapter_names=adapters)
                value = real.weight.data
        finally:
            for n, (idx, delta) in saved.items():
                layer.token_indices[n], layer.trainable_tokens_delta[n] = idx, delta
            layer.merged_adapters.clear()
        return Expected(value)

    return rows


def _same(base, start: int, end: int) -> Expected:
    return Expected(base)


def _constant(value):
    """A replacement: the adapter's own tensor (rows start:end), whatever the base holds."""

    def rows(_base, start: int, end: int) -> Expected:

        return Expected(value.detach().to(_base.dtype)[start:end] if value.dim() else value.detach().to(_base.dtype))

    return rows
