"""The false-alarm matrix: a right merge is never reported wrong, a wrong one always is, on every kind of model PEFT
adapts.

For each transformers architecture (decoders, encoders, encoder-decoders, vision, audio) and the task types PEFT
supports for it, a tiny model from a config and an adapter made by PEFT itself (get_peft_model + save_pretrained,
every trainable tensor randomised so no ΔW is zero), with a rotating mix of LoRA features so each feature is
covered on several architectures: plain LoRA, rsLoRA, DoRA, lora_bias, modules_to_save (PEFT's task heads
included), trainable tokens, fan_in_fan_out (GPT-2's Conv1D), embedding LoRA and conv LoRA. Each case:

- the merge passes verification (both proofs) with PEFT as the tensor proof's referee, not the formula;
- the output with one changed tensor put back to the base's value fails the tensor proof, naming that tensor
  (a LoRA-changed one, and where the adapter also saves a head or other tensor whole, that one too).

In-process through the Python API; the CLI cases of the issue's table are at the end.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from model_helpers import assert_round_trips, save_perturbed

from converter import AdapterSpec, Recipe
from converter.engine.merging import merge
from converter.verification import verify

DEC = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
           pad_token_id=0)  # fmt: skip
ENC = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=64, pad_token_id=0)  # fmt: skip
S2S = dict(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
           pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)  # fmt: skip
VIS = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
           patch_size=8, num_labels=3)  # fmt: skip


@dataclass
class Case:
    model: str  # the transformers class trained on
    config: str  # its config class
    settings: dict
    task: str | None  # PEFT task_type (None: as many vision adapters are saved)
    targets: list[str]
    features: dict = field(default_factory=dict)  # LoraConfig options: the features this case covers
    dtype: torch.dtype = torch.float32  # the base's stored dtype

    @property
    def id(self) -> str:
        extra = "+".join(k for k in self.features if k != "modules_to_save") or "lora"
        return f"{self.model}-{extra}" + ("-bf16" if self.dtype == torch.bfloat16 else "")


def case(model, config, settings, task, targets, dtype=torch.float32, **features) -> Case:
    return Case(model, config, settings, task, targets, features, dtype)


BF16 = torch.bfloat16


# one line (or a few) per case
# fmt: off
CASES = [
    # decoders
    case("LlamaForCausalLM", "LlamaConfig", DEC, "CAUSAL_LM", ["q_proj", "v_proj", "down_proj"], use_dora=True),
    case("LlamaForSequenceClassification", "LlamaConfig", {**DEC, "num_labels": 3}, "SEQ_CLS", ["q_proj", "v_proj"],
         use_rslora=True),
    case("LlamaForQuestionAnswering", "LlamaConfig", DEC, "QUESTION_ANS", ["k_proj", "o_proj"]),
    case("Qwen2ForCausalLM", "Qwen2Config", DEC, "CAUSAL_LM", ["q_proj", "k_proj", "v_proj"], lora_bias=True),
    case("Qwen2ForTokenClassification", "Qwen2Config", {**DEC, "num_labels": 4}, "TOKEN_CLS", ["q_proj", "up_proj"],
         use_dora=True),
    case("MistralForCausalLM", "MistralConfig", DEC, "CAUSAL_LM", ["q_proj", "v_proj"],
         trainable_token_indices=[3, 5, 7]),
    case("Qwen3ForCausalLM", "Qwen3Config", {**DEC, "head_dim": 8}, "CAUSAL_LM", ["embed_tokens", "q_proj"]),
    case("Gemma2ForCausalLM", "Gemma2Config", {**DEC, "head_dim": 8}, "CAUSAL_LM", ["q_proj", "gate_proj"],
         use_rslora=True, use_dora=True),
    case("Phi3ForCausalLM", "Phi3Config", DEC, "CAUSAL_LM", ["qkv_proj", "o_proj"], modules_to_save=["lm_head"]),
    case("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
         bos_token_id=1, eos_token_id=2), "CAUSAL_LM", ["c_attn", "c_fc"], fan_in_fan_out=True, use_rslora=True),
    case("GPT2ForSequenceClassification", "GPT2Config", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
         n_positions=64, num_labels=3, pad_token_id=0), "SEQ_CLS", ["c_attn"], fan_in_fan_out=True),
    case("GPT2ForTokenClassification", "GPT2Config", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
         n_positions=64, num_labels=3), "TOKEN_CLS", ["c_proj", "wte"], fan_in_fan_out=True),
    case("GPTNeoXForCausalLM", "GPTNeoXConfig", DEC, "CAUSAL_LM", ["query_key_value", "dense"], lora_bias=True),
    case("OPTForCausalLM", "OPTConfig", dict(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
         num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64), "CAUSAL_LM",
         ["q_proj", "v_proj", "fc1"], use_dora=True),
    case("OPTForSequenceClassification", "OPTConfig", dict(vocab_size=96, hidden_size=32, ffn_dim=64,
         num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64,
         num_labels=2), "SEQ_CLS", ["k_proj", "embed_tokens"], use_dora=True),
    case("FalconForCausalLM", "FalconConfig", dict(vocab_size=96, hidden_size=32, num_hidden_layers=2,
         num_attention_heads=4), "CAUSAL_LM", ["query_key_value", "dense_h_to_4h"], use_rslora=True),
    case("BloomForTokenClassification", "BloomConfig", dict(vocab_size=96, hidden_size=32, n_layer=2, n_head=4,
         num_labels=3), "TOKEN_CLS", ["query_key_value"], lora_bias=True),
    case("LlamaForTokenClassification", "LlamaConfig", {**DEC, "num_labels": 3}, "TOKEN_CLS", ["v_proj", "up_proj"],
         BF16, use_rslora=True),
    case("MistralForSequenceClassification", "MistralConfig", {**DEC, "num_labels": 2}, "SEQ_CLS",
         ["q_proj", "embed_tokens"], BF16),
    case("GPT2ForQuestionAnswering", "GPT2Config", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
         n_positions=64), "QUESTION_ANS", ["c_attn", "c_fc"], fan_in_fan_out=True, use_dora=True),
    case("Qwen2ForSequenceClassification", "Qwen2Config", {**DEC, "num_labels": 3}, "SEQ_CLS", ["q_proj", "v_proj"],
         BF16, lora_bias=True),
    case("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", dict(text_config=dict(vocab_size=160, hidden_size=32,
         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}), vision_config=dict(depth=1, embed_dim=16,
         hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=1, temporal_patch_size=1), image_token_id=150,
         video_token_id=151, vision_start_token_id=152), "CAUSAL_LM", ["q_proj", "v_proj"], BF16, use_dora=True),
    # encoders
    case("BertForSequenceClassification", "BertConfig", {**ENC, "num_labels": 3}, "SEQ_CLS", ["query", "value"],
         lora_bias=True),
    case("BertForTokenClassification", "BertConfig", {**ENC, "num_labels": 5}, "TOKEN_CLS", ["key", "dense"],
         use_dora=True),
    case("BertForQuestionAnswering", "BertConfig", ENC, "QUESTION_ANS", ["query", "word_embeddings"]),
    case("BertModel", "BertConfig", ENC, "FEATURE_EXTRACTION", ["query", "value"],
         trainable_token_indices={"word_embeddings": [4, 9]}),
    case("RobertaForSequenceClassification", "RobertaConfig", {**ENC, "max_position_embeddings": 70,
         "num_labels": 2}, "SEQ_CLS", ["query", "value"], use_rslora=True),
    case("DistilBertForSequenceClassification", "DistilBertConfig", dict(vocab_size=96, dim=32, n_layers=2, n_heads=4,
         hidden_dim=64, max_position_embeddings=64, num_labels=3), "SEQ_CLS", ["q_lin", "v_lin"],
         modules_to_save=["classifier", "pre_classifier"]),
    case("DistilBertForQuestionAnswering", "DistilBertConfig", dict(vocab_size=96, dim=32, n_layers=2, n_heads=4,
         hidden_dim=64, max_position_embeddings=64), "QUESTION_ANS", ["k_lin", "lin1"], lora_bias=True),
    case("ElectraForTokenClassification", "ElectraConfig", {**ENC, "embedding_size": 16, "num_labels": 3},
         "TOKEN_CLS", ["query", "value"], use_dora=True),
    case("DebertaV2ForSequenceClassification", "DebertaV2Config", {**ENC, "num_labels": 3}, "SEQ_CLS",
         ["query_proj", "value_proj"]),
    case("AlbertForSequenceClassification", "AlbertConfig", {**ENC, "embedding_size": 16, "num_labels": 2},
         "SEQ_CLS", ["query", "value"], use_rslora=True),
    case("XLMRobertaForQuestionAnswering", "XLMRobertaConfig", {**ENC, "max_position_embeddings": 70},
         "QUESTION_ANS", ["query", "key"], use_dora=True),
    case("RobertaForTokenClassification", "RobertaConfig", {**ENC, "max_position_embeddings": 70, "num_labels": 4},
         "TOKEN_CLS", ["query", "intermediate.dense"], BF16, lora_bias=True),
    case("DistilBertForTokenClassification", "DistilBertConfig", dict(vocab_size=96, dim=32, n_layers=2, n_heads=4,
         hidden_dim=64, max_position_embeddings=64, num_labels=3), "TOKEN_CLS", ["q_lin", "word_embeddings"], BF16),
    case("ElectraForSequenceClassification", "ElectraConfig", {**ENC, "embedding_size": 16, "num_labels": 2},
         "SEQ_CLS", ["key", "value"], trainable_token_indices={"word_embeddings": [5, 6]}),
    # encoder-decoders
    case("T5ForConditionalGeneration", "T5Config", dict(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2,
         num_heads=4, decoder_start_token_id=0), "SEQ_2_SEQ_LM", ["q", "v", "wo"], use_rslora=True),
    case("T5ForSequenceClassification", "T5Config", dict(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2,
         num_heads=4, decoder_start_token_id=0, num_labels=3), "SEQ_CLS", ["q", "k"], use_dora=True),
    case("BartForConditionalGeneration", "BartConfig", S2S, "SEQ_2_SEQ_LM", ["q_proj", "v_proj", "fc1"],
         lora_bias=True),
    case("BartForSequenceClassification", "BartConfig", {**S2S, "num_labels": 3}, "SEQ_CLS", ["q_proj", "out_proj"]),
    case("MarianMTModel", "MarianConfig", S2S, "SEQ_2_SEQ_LM", ["k_proj", "fc2"], use_dora=True),
    case("BartForQuestionAnswering", "BartConfig", S2S, "QUESTION_ANS", ["v_proj", "fc2"], BF16, use_rslora=True),
    case("T5ForQuestionAnswering", "T5Config", dict(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2,
         num_heads=4, decoder_start_token_id=0), "QUESTION_ANS", ["q", "o"]),
    # vision
    case("ViTForImageClassification", "ViTConfig", VIS, None, ["q_proj", "v_proj", "projection"],
         modules_to_save=["classifier"]),
    case("ViTModel", "ViTConfig", VIS, "FEATURE_EXTRACTION", ["q_proj", "fc1"], use_rslora=True),
    case("DeiTForImageClassification", "DeiTConfig", VIS, None, ["q_proj", "v_proj"], use_dora=True,
         modules_to_save=["classifier"]),
    case("CLIPModel", "CLIPConfig", dict(text_config=dict(vocab_size=96, hidden_size=32, intermediate_size=64,
         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64), vision_config=dict(
         hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
         patch_size=8), projection_dim=16), None, ["q_proj", "v_proj", "patch_embedding"], use_rslora=True),
    case("SwinForImageClassification", "SwinConfig", dict(image_size=16, patch_size=4, embed_dim=16, depths=[1, 1],
         num_heads=[2, 2], window_size=2, num_labels=3), None, ["q_proj", "fc2"], lora_bias=True,
         modules_to_save=["classifier"]),
    case("CLIPForImageClassification", "CLIPConfig", dict(text_config=dict(vocab_size=96, hidden_size=32,
         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64),
         vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
         image_size=16, patch_size=8), num_labels=3), "SEQ_CLS", ["k_proj", "fc1"], BF16, lora_bias=True),
    case("ResNetForImageClassification", "ResNetConfig", dict(embedding_size=8, hidden_sizes=[8, 16],
         depths=[1, 1], num_labels=3), None, ["convolution"], use_rslora=True, modules_to_save=["classifier"]),
    # audio
    case("WhisperForConditionalGeneration", "WhisperConfig", dict(vocab_size=96, d_model=32, encoder_layers=2,
         decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
         decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=32, pad_token_id=0,
         bos_token_id=1, eos_token_id=2, decoder_start_token_id=3), "SEQ_2_SEQ_LM", ["q_proj", "v_proj", "fc1"]),
    case("WhisperForAudioClassification", "WhisperConfig", dict(vocab_size=96, d_model=32, encoder_layers=2,
         decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
         decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, classifier_proj_size=16, num_labels=3),
         "SEQ_CLS", ["k_proj", "fc2"], BF16, use_dora=True),
    case("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", dict(vocab_size=32, hidden_size=32,
         num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16), conv_stride=(4, 4),
         conv_kernel=(4, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, num_labels=3,
         classifier_proj_size=16), "SEQ_CLS", ["q_proj", "v_proj"], use_dora=True),
]
# fmt: on


def build(root: Path, c: Case) -> tuple[Path, Path]:
    """The tiny base (saved by its own class) and PEFT's adapter for it, every trainable tensor random."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = getattr(transformers, c.config)(**c.settings)
    model = getattr(transformers, c.model)(config).eval()
    with torch.no_grad():  # norms and biases away from 1 / 0, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    base, adapter = root / "base", root / "adapter"
    copy.deepcopy(model).to(c.dtype).save_pretrained(base)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=c.targets, task_type=c.task, init_lora_weights=False,
                      **c.features)  # fmt: skip
    peft_model = get_peft_model(model, lora)
    save_perturbed(peft_model, adapter)
    return base, adapter


def changed_tensors(base: Path, out: Path) -> list[str]:
    from safetensors.torch import load_file

    before = {k: v for f in base.glob("*.safetensors") for k, v in load_file(f).items()}
    after = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    return sorted(k for k in after if k in before and not torch.equal(after[k], before[k]))


def put_back(out: Path, base: Path, name: str) -> None:
    """Sabotage: one tensor of the output back to the base's value (a module left unmerged)."""
    from safetensors.torch import load_file, save_file

    original = {k: v for f in base.glob("*.safetensors") for k, v in load_file(f).items()}[name]
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        if name in tensors:
            tensors[name] = original
            save_file(tensors, f, metadata={"format": "pt"})


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_right_merge_passes_and_one_unmerged_tensor_fails(c: Case, tmp_path):
    base, adapter = build(tmp_path, c)
    right_passes_sabotage_fails(c, base, adapter, tmp_path)


def test_a_checkpoint_without_the_base_model_prefix(tmp_path):
    """GPT-2's own checkpoint keys have no `transformer.` (transformers adds it on load); PEFT's names have it."""
    from safetensors.torch import load_file, save_file

    c = next(c for c in CASES if c.model == "GPT2ForSequenceClassification")
    base, adapter = build(tmp_path, c)
    tensors = load_file(base / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, base / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    right_passes_sabotage_fails(c, base, adapter, tmp_path)


def right_passes_sabotage_fails(c: Case, base: Path, adapter: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    recipe = Recipe(base=str(base), adapters=[AdapterSpec(str(adapter))], out=str(out))
    merge(recipe, force=True, log=lambda _: None)

    report = verify(out, recipe, log=lambda _: None)
    assert report.verdict == "pass", (report.problems, report.tensors_skipped, report.behaviour_skipped)
    assert report.tensors.referee.name == "PEFT", report.tensors.referee.detail
    assert c.model in report.tensors.referee.detail  # the class the adapter was trained on
    assert report.behaviour is not None, report.behaviour_skipped
    assert_round_trips(out, report)  # a task model's report, read back typed

    changed = changed_tensors(base, out)
    assert changed, "the adapter changed nothing"
    lora = next((n for n in changed if any(t in n for t in c.targets)), changed[0])
    whole = next((n for n in changed if not any(t in n for t in c.targets)), None)  # a head, a replacement
    for i, victim in enumerate(v for v in (lora, whole) if v):
        sabotaged = tmp_path / f"sabotaged{i}"
        shutil.copytree(out, sabotaged)
        put_back(sabotaged, base, victim)
        bad = verify(sabotaged, recipe, log=lambda _: None, proofs=("tensors",))
        assert bad.verdict == "fail", victim
        assert any(victim in p for p in bad.problems), bad.problems


def test_the_matrix_covers_every_feature_on_several_architectures():
    """Each LoRA feature on at least two architectures, and every kind of model in the matrix."""
    counts: dict[str, set[str]] = {}
    for c in CASES:
        for feature in c.features:
            counts.setdefault(feature, set()).add(c.config)
        if any(t in ("embed_tokens", "wte", "word_embeddings") for t in c.targets):
            counts.setdefault("embedding LoRA", set()).add(c.config)
        if any(t in ("projection", "patch_embedding", "convolution", "conv1") for t in c.targets):
            counts.setdefault("conv LoRA", set()).add(c.config)
        if c.task in ("SEQ_CLS", "TOKEN_CLS", "QUESTION_ANS"):
            counts.setdefault("task heads (modules_to_save by PEFT)", set()).add(c.config)
    wanted = ["use_rslora", "use_dora", "lora_bias", "modules_to_save", "trainable_token_indices", "fan_in_fan_out",
              "embedding LoRA", "conv LoRA", "task heads (modules_to_save by PEFT)"]  # fmt: skip
    thin = {f: sorted(counts.get(f, ())) for f in wanted if len(counts.get(f, ())) < 2 and f != "fan_in_fan_out"}
    assert not thin, thin
    assert len({c.config for c in CASES}) >= 25


def test_a_conv_lora_whose_settings_the_forward_reads_is_compared(tmp_path):
    """Whisper with a LoRA on its conv1: Whisper's encoder reads `conv1.stride`, which PEFT's wrapped conv lacks;
    the behaviour check gives the wrapper its base layer's settings, so PEFT's unmerged model runs and both proofs
    pass with PEFT as referee. conv1 put back unmerged fails the behaviour check on its own."""
    whisper = next(c for c in CASES if c.model == "WhisperForConditionalGeneration")
    c = Case(whisper.model, whisper.config, whisper.settings, whisper.task, ["q_proj", "conv1"])
    base, adapter = build(tmp_path, c)
    out = tmp_path / "out"
    recipe = Recipe(base=str(base), adapters=[AdapterSpec(str(adapter))], out=str(out))
    merge(recipe, force=True, log=lambda _: None)
    report = verify(out, recipe, log=lambda _: None)
    assert report.verdict == "pass", report.problems
    assert report.tensors.referee.name == "PEFT"
    assert report.behaviour is not None, report.behaviour_skipped
    put_back(out, base, "model.encoder.conv1.weight")
    bad = verify(out, recipe, log=lambda _: None, proofs=("behaviour",))
    assert bad.verdict == "fail", bad.problems


# The table, through the command line: exit 0 with PEFT named; one tensor put back: exit 3 naming it.
CLI_CASES = {
    "gpt2-seq-cls-fan-in-fan-out-score": "GPT2ForSequenceClassification-fan_in_fan_out",
    "distilbert-seq-cls-classifier-pre-classifier": "DistilBertForSequenceClassification-lora",
    "qwen2-lora-bias": "Qwen2ForCausalLM-lora_bias",
    "vit-transformers-5-names": "ViTForImageClassification-lora",
}


@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_cases_of_the_table(name, tmp_path, cli):
    c = next(c for c in CASES if c.id == CLI_CASES[name])
    base, adapter = build(tmp_path, c)
    out = tmp_path / "out"
    code, stdout, stderr = cli("merge", "--base", base, "--adapter", adapter, "--out", out, verify=True)
    assert code == 0, stderr
    assert "referee: PEFT" in stdout and c.model in stdout
    victim = next(n for n in changed_tensors(base, out) if any(t in n for t in c.targets))
    put_back(out, base, victim)
    code, stdout, stderr = cli("verify", out, "--proof", "tensors")
    assert code == 3, stdout + stderr
    assert victim in stderr


def test_a_weight_transformers_splits_on_load_is_refused_in_one_line(tmp_path, cli):
    """Dinov2 with SwiGLU: the checkpoint's `mlp.weights_in` is split into `gate_proj` and `up_proj` on load, not
    renamed; a LoRA on `up_proj` cannot be placed on the checkpoint's tensors by a rename: exit 2, named."""
    c = case("Dinov2Model", "Dinov2Config", {**VIS, "use_swiglu_ffn": True}, None, ["up_proj"])
    c.settings.pop("num_labels")
    base, adapter = build(tmp_path, c)
    code, _, stderr = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "out")
    assert code == 2
    assert "mlp.up_proj.lora_A.weight" in stderr and "by more than a rename" in stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_head_the_base_lacks_is_named(tmp_path, cli):
    """A classifier fine-tuned from a checkpoint saved as a masked LM: the head PEFT saves whole has no tensor in
    the base. One line naming the head and the class the base was saved as, exit 2, nothing written."""
    import transformers
    from peft import LoraConfig, get_peft_model

    settings = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)
    transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(**settings)).save_pretrained(tmp_path / "base")
    model = transformers.DistilBertForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=3)
    lora = LoraConfig(task_type="SEQ_CLS", target_modules=["q_lin"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(tmp_path / "adapter")
    code, _, stderr = cli("merge", "--base", tmp_path / "base", "--adapter", tmp_path / "adapter", "--out",
                          tmp_path / "out")  # fmt: skip
    assert code == 2
    assert "saves classifier, pre_classifier whole" in stderr and "DistilBertForMaskedLM" in stderr
    assert not (tmp_path / "out").exists()
