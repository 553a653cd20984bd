"""The behavioural comparison of a model that is not a causal LM (a classifier, an encoder, T5, Whisper, ViT, CLIP):
the class the adapters were trained on (`converter.engine.model_class`), merged against PEFT's unmerged reference and
the bare base, on inputs of the kinds its forward takes.

It proves what the tensor proof cannot, as for a causal LM (llm.py): the config, the heads PEFT's task model adds
and loads (`score`, `classifier`), a class that loads the weights otherwise. Every floating output the model
returns (logits, start/end logits, hidden states, embeddings) is compared as rows of scores: KL, top-1 agreement and
the largest difference, judged by the same rounding thresholds. The models are loaded whole in the compute dtype
(these models are small next to the LLMs the streamed path is for); token ids come from the tokenizer when the
folder has one, images, spectrograms and decoder prompts are seeded random.
"""

from __future__ import annotations

from pathlib import Path

from converter.engine import model_class
from converter.engine.keymap import HEADLESS
from converter.engine.model_inputs import PERPLEXITY_TEXT, build_inputs
from converter.engine.precision import weights_summary
from converter.io.memory import available_memory
from converter.io.units import human_bytes
from converter.verification.llm import LLMCheck
from converter.verification.loading import (
    choose_placement,
    load_model,
    load_reference,
    load_tokenizer,
)
from converter.verification.metrics import Run
from converter.verification.peft_referee import adapter_keys, task_type
from converter.verification.referee import in_one_line
from converter.verification.report import Skip


def trained_class(base: Path, adapters: list[Path]) -> str:
    """The transformers class name the adapters were trained on (NoModelClass: transformers has none)."""
    config = model_class.folder_config(base)
    return model_class.trained_class(config, task_type(adapters), model_class.adapter_modules(adapter_keys(adapters)))


is_causal_lm = model_class.is_causal_lm  # (the name streamed.py and __init__ import from here)
# A classifier's config that its training set beside the base's (from_pretrained(base, num_labels=1, ...))
TRAINED_SETTINGS = ("id2label", "label2id", "pad_token_id")


def trained_settings(base: Path, merged: Path) -> dict:
    """What a classifier made from a checkpoint saved as another class was built with, where the base's config
    says otherwise: the labels and pad token id the output's config states (its class's own head size follows
    from the labels). Nothing for a model merged into the class the base was saved as."""
    import json

    theirs, ours = (json.loads((f / "config.json").read_text()) for f in (base, merged))
    if theirs.get("architectures") == ours.get("architectures"):
        return {}
    return {k: ours[k] for k in TRAINED_SETTINGS if k in ours and ours[k] != theirs.get(k)}


def _generates_text(class_name: str) -> bool:
    """A vision-language model that answers text prompts (transformers' image-text-to-text task)."""
    from transformers.models.auto import modeling_auto

    names = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values()
    return any(class_name == n or (isinstance(n, list | tuple) and class_name in n) for n in names)


class TaskCheck(LLMCheck):
    """LLMCheck's phases for a task model (`model_class`, a transformers class name): whole models in memory, the
    model's own inputs, every output."""

    def __init__(self, *args, model_class: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_class = model_class

    def _place(self) -> None:
        import torch

        self.output_dtype, params = weights_summary(self.merged)
        self.stored_4bit, self.four_bit, self.own, self.offload = None, None, False, None
        budget = self.settings.memory or available_memory()
        placement = choose_placement(params, budget, self.scratch)
        if placement is None or placement[1] is not None:
            raise Skip(f"{self.model_class} is compared in memory and needs about {human_bytes(params * 6)}; "
                       f"{human_bytes(budget)} is available")  # fmt: skip
        self.compute = placement[0]
        self.dtype = getattr(torch, self.compute)
        self.new_tokens = 0  # no continuations: the outputs are the comparison

    def _inputs(self) -> None:
        import inspect
        import json

        import transformers

        config = json.loads((self.merged / "config.json").read_text())
        self.tok = load_tokenizer(self.merged, " ".join([*self.prompts, PERPLEXITY_TEXT]))
        takes = set(inspect.signature(getattr(transformers, self.model_class).forward).parameters)
        if _generates_text(self.model_class):  # a vision-language model: its text path, on the prompts
            takes -= {"pixel_values", "pixel_values_videos"}
        classifier = self.model_class.endswith(HEADLESS)
        self.scores = classifier and len(config.get("id2label") or {}) == 1  # one score per input: a reward model
        try:
            self.inputs, self.template = _model_inputs(config, self.tok, self.prompts, takes, classifier), False
        except (KeyError, TypeError, ValueError) as e:
            raise Skip(f"no inputs could be made for {self.model_class}'s forward ({type(e).__name__}: {e})") from e
        if not any(self.inputs):
            raise Skip(f"{self.model_class}'s forward takes none of the inputs this check makes (token ids, "
                       "pixel values, audio features)")  # fmt: skip
        self.log(f"comparing behaviour: {self.model_class}, reference = base + {len(self.adapters)} adapter(s) "
                 f"through PEFT ({self.compute} compute)")  # fmt: skip

    def _reference(self):
        self.quantization = None
        model = load_reference(self.base, self.adapters, self.recipe, self.dtype, None, None, None,
                               model_class=self.model_class,
                               config=trained_settings(self.base, self.merged))  # fmt: skip
        self.clock.lap("load reference")
        # PEFT's tuner (its LoRA layers sit in the model) called with the model's own arguments: PEFT's task
        # wrappers assume text inputs (its Seq2Seq one passes input_ids to Whisper beside input_features)
        lora = model.base_model
        _conv_settings(lora)
        try:
            ref = _run(lora, self.inputs, self.scores)
        except Exception as e:  # PEFT's layers in this model's forward: its problem, said in one line
            raise Skip(f"PEFT's unmerged {self.model_class} does not run ({in_one_line(e, 160)})") from e
        self.bare_base, bare = self.settings.bare_base, None  # no bare base after a passed tensor proof (llm.py)
        if self.bare_base:
            with model.disable_adapter():
                bare = _run(lora, self.inputs, self.scores)
        self.clock.lap("run reference and bare base" if self.bare_base else "run reference")
        self.one_batch = False
        self.reference = f"the base + adapters applied unmerged through PEFT ({self.model_class})"
        return ref, bare, None

    def _candidate(self):
        self.candidate = load_model(self.merged, self.dtype, model_class=self.model_class)
        self.clock.lap("load merged")
        out = _run(self.candidate, self.inputs, self.scores)
        self.clock.lap("run merged")
        return out

    def _probe(self, ref, out, tol, noise):
        return None  # the tensor proof names wrong tensors; the outputs say whether the model as a whole agrees

    def _qlora_study(self, ref, out):
        return None


CONV_SETTINGS = ("stride", "padding", "dilation", "groups", "kernel_size", "in_channels", "out_channels")


def _conv_settings(model) -> None:
    """PEFT's wrapper of a convolution has none of its settings, which some forwards read from the module (Whisper's
    encoder checks its input length against `conv1.stride`): each wrapper gets its base layer's settings (plain
    numbers; PEFT's forward and weights stay as they are), so PEFT's unmerged model runs."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else None
        if isinstance(base, torch.nn.modules.conv._ConvNd):
            for name in CONV_SETTINGS:
                if not hasattr(module, name):
                    setattr(module, name, getattr(base, name))


def _model_inputs(config: dict, tok, prompts: list[str], takes: set[str], classifier: bool) -> list[dict]:
    """One forward's keyword arguments per input, for the arguments the model's forward `takes`: token ids (the
    tokenizer's, else seeded random), pixel values (vision), log-mel features (speech), decoder ids
    (encoder-decoders, unless a `classifier`, which makes them from the input ids)."""
    import torch

    g = torch.Generator().manual_seed(0)
    text, vision = config.get("text_config") or config, config.get("vision_config") or config
    out: list[dict] = [{} for _ in prompts]
    vocab = int(text.get("vocab_size") or 0)
    if "input_features" in takes:
        frames = 2 * int(config.get("max_source_positions", 1500))
        for kwargs in out:
            kwargs["input_features"] = torch.randn(1, config["num_mel_bins"], frames, generator=g)
    elif "input_values" in takes:  # raw audio (wav2vec2 and its kind): a second at 16 kHz
        for kwargs in out:
            kwargs["input_values"] = torch.randn(1, 16000, generator=g)
    elif "input_ids" in takes and vocab:
        ids, _, _, _ = build_inputs(tok, prompts, vocab)
        eos = text.get("eos_token_id") if config.get("is_encoder_decoder") else None
        for kwargs, i in zip(out, ids, strict=True):
            i = i[:, : min(text.get("max_position_embeddings") or 64, 64) - 1]
            if isinstance(eos, int):  # an encoder-decoder classifier reads the one <eos> that ends each input
                i = torch.cat([torch.where(i == eos, (eos + 1) % vocab, i), torch.tensor([[eos]])], 1)
            kwargs["input_ids"] = i
    if "pixel_values" in takes:
        size = vision.get("image_size", 224)
        size = size if isinstance(size, int) else size[0]
        for kwargs in out:
            kwargs["pixel_values"] = torch.randn(1, vision.get("num_channels", 3), size, size, generator=g)
    if "decoder_input_ids" in takes and config.get("is_encoder_decoder") and not classifier:
        start = config.get("decoder_start_token_id") or 0
        for kwargs in out:
            rest = torch.randint(3, max(vocab, 4), (1, 7), generator=g)
            kwargs["decoder_input_ids"] = torch.cat([torch.tensor([[start]]), rest], 1)
    return out


def _run(model, inputs: list[dict], scores: bool = False) -> Run:
    """Every floating output of the model on each input, as rows of scores (last axis), in one list. `scores`: a
    classifier with one label (a reward model) gives one score per input; each is compared as the two-way choice
    [score, 0], whose softmax is the sigmoid its preferences are computed through (so a shift shows too)."""
    import torch

    rows = []
    with torch.no_grad():
        for kwargs in inputs:
            output = model(**kwargs, return_dict=True)
            for key, value in output.items():
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    continue
                if scores and key == "logits" and value.shape[-1] == 1:
                    value = value.float().reshape(-1, 1)
                    rows.append(torch.cat([value, torch.zeros_like(value)], -1))
                elif value.numel() > 1:
                    value = value.float().reshape(-1, value.shape[-1]) if value.dim() > 1 else value.float()[None]
                    if value.shape[-1] > 1:
                        rows.append(value)
    return Run(logits=rows)
