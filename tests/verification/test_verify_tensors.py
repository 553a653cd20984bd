"""The tensor proof's sabotage suite: a "Passed" that a one-module mistake cannot earn.

On the real SmolLM2-135M-Instruct (bf16) with a LoRA on all 210 linear modules (r=16, alpha=32, each module's ΔW
2% of its weight's norm, as a trained LoRA) plus a modules_to_save norm: right merges pass (ours in bf16, fp16 and
fp32; PEFT's own merge_and_unload in bf16, double rounding included) and each sabotage exits 3 naming the tensor.
Then the same on a kohya SDXL-layout LoRA (diffusers referee), a verl FSDP checkpoint with its LoRA inside
(PEFT on the checkpoint written unmerged) and a TIES / DARE merge (PEFT's merge_utils). Merges are made once per
module; each sabotage edits a copy, checked with the proof alone where the behaviour adds nothing to the test.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from model_helpers import make_adapter, make_base, shown
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from build_fixtures import cache_dir, is_complete  # noqa: E402

SMOL = cache_dir() / "smollm2-135m-instruct"
WEIGHTS = "model.safetensors"


def proof_only(folder: Path, recipe=None):
    """The tensor proof by itself (the report as verify returns it)."""
    from converter.engine.recipe import recorded_recipe
    from converter.verification import verify

    return verify(folder, recipe or recorded_recipe(folder), log=lambda _line: None, proofs=("tensors",))


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """SmolLM2 and a LoRA like a trained one: every linear module, ΔW scaled to 2% of the weight's norm."""
    if not is_complete(SMOL):
        pytest.fail(f"SmolLM2 fixture missing at {SMOL}: run `make fixtures` (make test does it first)")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(SMOL, dtype=torch.float32)
    config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False,
                        modules_to_save=["model.norm"])  # fmt: skip
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for module in peft_model.modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                delta = module.get_delta_weight("default")
                module.lora_B["default"].weight.mul_(0.02 * module.base_layer.weight.norm() / delta.norm())
            if hasattr(module, "modules_to_save") and "default" in module.modules_to_save:
                module.modules_to_save["default"].weight.mul_(1.5)
    folder = tmp_path_factory.mktemp("smol") / "lora"
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ours(smol, tmp_path_factory):
    """converter's merges of the SmolLM2 LoRA, one per output dtype, made once."""
    from converter.cli import main

    made = {}

    def get(dtype: str) -> Path:
        if dtype not in made:
            out = tmp_path_factory.mktemp(f"ours-{dtype}") / "m"
            extra = [] if dtype == "bf16" else ["--dtype", {"fp16": "float16", "fp32": "float32"}[dtype]]
            args = ["merge", "--base", str(SMOL), "--adapter", str(smol), "--out", str(out), "--no-verify", *extra]
            assert main(args) == 0
            made[dtype] = out
        return made[dtype]

    yield get
    for out in made.values():
        shutil.rmtree(out.parent, ignore_errors=True)  # three merged models: gone with the module


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_our_right_merges_pass_within_one_rounding(ours, dtype):
    report = proof_only(ours(dtype))
    t = report.tensors
    assert report.verdict == "pass" and t.passed, report.problems
    assert t.referee.name == "PEFT" and t.changed == 211 and t.untouched == 61  # 210 LoRA + the norm replaced
    assert t.worst.ratio <= 1 and t.inexact / t.elements < 1e-3  # one rounding: nearly all exactly rounded


def test_right_bf16_merge_passes_both_proofs_and_the_card_says_so(ours):
    from converter.engine.recipe import recorded_recipe
    from converter.verification import markdown, verify

    folder = ours("bf16")
    report = verify(folder, recorded_recipe(folder), log=lambda _line: None)
    assert report.verdict == "pass" and report.behaviour is not None, report.problems
    text = markdown(report)
    assert "every tensor within rounding of base + ΔW (referee: PEFT)" in text
    assert "| mean KL(reference‖model) |" in text and "two proofs" in text


@pytest.mark.parametrize("safe_merge", [False, True], ids=["merge_and_unload", "safe_merge-double-rounded"])
def test_peft_merge_and_unload_in_bf16_passes(smol, tmp_path, safe_merge):
    """PEFT's own merge of the bf16 model (its factors in float32, as PEFT loads them by default): W + ΔW rounded
    once from float32's ΔW, or (safe_merge) ΔW rounded to bf16 first and then the sum: two roundings, within the
    bound too (its u·|ΔW| term)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from converter.engine.recipe import AdapterSpec, Recipe

    model = AutoModelForCausalLM.from_pretrained(SMOL, dtype=torch.bfloat16)
    peft_model = PeftModel.from_pretrained(model, smol)
    peft_model.merge_and_unload(safe_merge=safe_merge).save_pretrained(tmp_path / "peft")
    report = proof_only(tmp_path / "peft", Recipe(base=str(SMOL), adapters=[AdapterSpec(str(smol))]))
    assert report.verdict == "pass" and report.tensors.changed == 211, report.problems
    assert report.tensors.worst.ratio <= 1


def _deltas(folder: Path, base: dict) -> dict[str, torch.Tensor]:
    return {k: v.double() - base[k].double() for k, v in load_file(folder / WEIGHTS).items() if k in base}


def _sabotage(kind: str, right: Path, folder: Path) -> str:
    """A copy of the right merge with one defect; returns the tensor the failure must name."""
    shutil.copytree(right, folder)
    base = load_file(SMOL / WEIGHTS)
    t = load_file(folder / WEIGHTS)
    layer = "model.layers.{}.{}.weight".format
    name = {
        "one module missing": layer(15, "self_attn.v_proj"),
        "one ΔW transposed": layer(5, "self_attn.o_proj"),
        "one ΔW negated": layer(20, "mlp.down_proj"),
        "adjacent layers' deltas exchanged": layer(3, "self_attn.q_proj"),
        "every ΔW doubled": layer(0, "self_attn.q_proj"),
        "one ulp off in an untouched tensor": layer(7, "input_layernorm"),
        "a tensor dropped": layer(9, "mlp.up_proj"),
        "modules_to_save left as the base": "model.norm.weight",
    }[kind]

    def with_delta(n: str, delta: torch.Tensor) -> None:
        t[n] = (base[n].double() + delta).to(t[n].dtype)

    if kind == "one module missing" or kind == "modules_to_save left as the base":
        t[name] = base[name].clone()
    elif kind == "one ΔW transposed":
        with_delta(name, (t[name].double() - base[name].double()).T)
    elif kind == "one ΔW negated":
        with_delta(name, -(t[name].double() - base[name].double()))
    elif kind == "adjacent layers' deltas exchanged":
        other = layer(4, "self_attn.q_proj")
        d3, d4 = t[name].double() - base[name].double(), t[other].double() - base[other].double()
        with_delta(name, d4)
        with_delta(other, d3)
    elif kind == "every ΔW doubled":
        for n in [k for k in t if "layers." in k and "norm" not in k]:
            with_delta(n, 2 * (t[n].double() - base[n].double()))
    elif kind == "one ulp off in an untouched tensor":
        t[name].view(torch.int16)[0] += 1
    elif kind == "a tensor dropped":
        del t[name]
    save_file(t, folder / WEIGHTS, metadata={"format": "pt"})
    return name


SABOTAGES = [
    "one module missing",
    "one ΔW transposed",
    "one ΔW negated",
    "adjacent layers' deltas exchanged",
    "every ΔW doubled",
    "one ulp off in an untouched tensor",
    "a tensor dropped",
    "modules_to_save left as the base",
]


@pytest.mark.parametrize("kind", SABOTAGES)
def test_each_sabotage_exits_3_naming_the_tensor(ours, tmp_path, cli, kind):
    folder = tmp_path / "sabotaged"
    name = _sabotage(kind, ours("bf16"), folder)
    code, out, err = cli("verify", folder)
    assert code == 3, out + err
    assert "verification failed" in err and (name in err or kind == "every ΔW doubled")
    report = json.loads((folder / "verification.json").read_text())
    assert report["verdict"] == "fail" and report["behaviour_skipped"] == "the tensor proof already failed"
    failures = {f["name"]: f for f in report["tensors"]["failures"]}
    if kind == "a tensor dropped":
        assert report["tensors"]["missing"] == [name]
    elif kind != "every ΔW doubled":
        assert name in failures and float(failures[name]["ratio"]) > 10  # far beyond one rounding
    if kind == "one module missing":
        assert "as if the change were not merged" in failures[name]["problem"]
    if kind == "one ΔW negated":
        assert "as if the change were negated" in failures[name]["problem"]
    if kind == "every ΔW doubled":  # every LoRA tensor (the ten worst named), the replaced norm is right
        assert report["tensors"]["failed"] == 210 and "... and 200 more tensors wrong" in err
    shutil.rmtree(folder)


def test_push_uploads_nothing_when_the_proof_fails(ours, tmp_path, monkeypatch):
    """`push` verifies before uploading: a wrong tensor stops it before any Hub call that writes."""
    from converter.errors import VerificationFailed
    from converter.jobs import pipeline
    from converter.jobs.options import PushOptions

    folder = tmp_path / "sabotaged"
    _sabotage("one ΔW negated", ours("bf16"), folder)
    calls = []
    monkeypatch.setattr(pipeline.hub, "whoami_info", lambda token: {"name": "me"})
    monkeypatch.setattr(pipeline, "push_folder", lambda *a, **k: calls.append(a))
    with pytest.raises(VerificationFailed, match="model.layers.20.mlp.down_proj.weight"):
        pipeline.push("me/merged", PushOptions(verify={}), folder=folder, log=lambda _line: None)
    assert calls == []


# --- a kohya SDXL-layout LoRA on a tiny SDXL pipeline: diffusers' loader is the referee -------------------------


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    from diffusion_helpers import make_pipeline, save
    from test_community_sd import sdxl_lora, uniform_alpha

    root = tmp_path_factory.mktemp("sdxl")
    models = make_pipeline(root / "base", "sdxl")
    lora = uniform_alpha(sdxl_lora(models, ldm=True), 2.0)  # sd-scripts' SGM names: lora_unet_input_blocks_4_1_...
    assert any(k.startswith("lora_unet_input_blocks_") for k in lora)
    save(lora, root / "lora.safetensors")
    from converter.cli import main

    assert main(["merge", "--base", str(root / "base"), "--adapter", str(root / "lora.safetensors"), "--out",
                 str(root / "m"), "--no-verify"]) == 0  # fmt: skip
    return root


def test_kohya_sdxl_right_merge_passes_with_diffusers_as_referee(sdxl):
    report = proof_only(sdxl / "m")
    assert report.verdict == "pass" and report.tensors.referee.name == "diffusers", report.problems
    assert set(report.tensors.groups) >= {"unet", "text_encoder", "text_encoder_2"}
    assert report.tensors.changed > 50 and report.tensors.worst.ratio <= 1


UNET = "unet/diffusion_pytorch_model.safetensors"


@pytest.mark.parametrize("kind", ["one module missing", "one conv ΔW transposed"])
def test_kohya_sdxl_sabotage_fails_naming_the_tensor(sdxl, tmp_path, kind):
    shutil.copytree(sdxl / "m", tmp_path / "s")
    base, t = load_file(sdxl / "base" / UNET), load_file(tmp_path / "s" / UNET)
    if kind == "one module missing":
        name = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight"
        t[name] = base[name].clone()
    else:  # a 3x3 conv whose in and out channels agree: its ΔW transposed (out <-> in) still fits
        name = "down_blocks.0.resnets.0.conv2.weight"
        assert t[name].shape[0] == t[name].shape[1]
        t[name] = base[name] + (t[name] - base[name]).transpose(0, 1).contiguous()
    save_file(t, tmp_path / "s" / UNET)
    report = proof_only(tmp_path / "s", _recipe_of(sdxl))
    assert report.verdict == "fail" and [f.name for f in report.tensors.failures] == [f"unet/{name}"]
    assert report.tensors.failures[0].ratio > 10


def _recipe_of(root: Path):
    from converter.engine.recipe import AdapterSpec, Recipe

    return Recipe(base=str(root / "base"), adapters=[AdapterSpec(str(root / "lora.safetensors"))])


# --- a verl FSDP checkpoint with its LoRA inside: PEFT on the checkpoint written unmerged -----------------------


def test_verl_checkpoint_with_lora_inside_passes_and_a_sabotage_fails(training_checkpoints, tmp_path, cli):
    actor = training_checkpoints / "lora/actor"
    code, out, err = cli("merge", "--base", actor, "--out", tmp_path / "m", verify=True)
    assert code == 0, out + err
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    assert report["verdict"] == "pass" and report["tensors"]["referee"]["name"] == "PEFT"
    assert report["tensors"]["changed"] == 14 and "training checkpoint" in report["notes"][-1]
    name = "model.layers.1.self_attn.v_proj.weight"
    t = load_file(tmp_path / "m" / WEIGHTS)
    t[name] = -t[name]
    save_file(t, tmp_path / "m" / WEIGHTS, metadata={"format": "pt"})
    code, out, err = cli("verify", tmp_path / "m")
    assert code == 3 and name in err, out + err


# --- TIES and DARE: PEFT's merge_utils on PEFT's deltas -------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("ties")
    base = make_base(root / "base", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    a = make_adapter(base, root / "a", seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"])
    b = make_adapter(base, root / "b", seed=2, r=4, lora_alpha=4, target_modules=["q_proj", "o_proj"])
    return base, a, b


@pytest.mark.parametrize("method", ["ties", "magnitude_prune", "dare", "dare_ties"])
def test_ties_and_dare_merges_are_proven_and_a_sabotage_fails(pair, tmp_path, cli, method):
    base, a, b = pair
    out = tmp_path / "m"
    options = ("--method", method, "--density", "0.4", "--seed", "3")
    code, stdout, err = cli("merge", "--base", base, "--adapter", a, "--adapter", b, "--weight", "0.7", "--weight",
                            "0.5", *options, "--out", out, verify=True)  # fmt: skip
    assert code == 0, stdout + err
    report = json.loads((out / "verification.json").read_text())
    assert report["verdict"] == "pass" and report["tensors"]["changed"] == 6, report["problems"]
    assert "merge_utils" in report["tensors"]["referee"]["detail"] and "not compared" in shown(report)
    # the plain weighted sum instead of the method, on one tensor: named
    name = "model.layers.1.self_attn.q_proj.weight"
    summed = tmp_path / "sum"
    assert cli("merge", "--base", base, "--adapter", a, "--adapter", b, "--weight", "0.7", "--weight", "0.5",
               "--out", summed)[0] == 0  # fmt: skip
    t = load_file(out / WEIGHTS)
    t[name] = load_file(summed / WEIGHTS)[name]
    save_file(t, out / WEIGHTS, metadata={"format": "pt"})
    code, stdout, err = cli("verify", out)
    assert code == 3 and name in err, stdout + err


def test_dare_is_checked_with_the_masks_of_the_recorded_seed(pair, tmp_path, cli):
    """The proof redraws DARE's masks from the seed the recipe records: another seed's merge fails."""
    base, a, b = pair
    args = ["--adapter", a, "--adapter", b, "--method", "dare", "--density", "0.5"]
    assert cli("merge", "--base", base, *args, "--seed", "1", "--out", tmp_path / "one")[0] == 0
    assert cli("merge", "--base", base, *args, "--seed", "2", "--out", tmp_path / "two")[0] == 0
    shutil.copyfile(tmp_path / "two" / WEIGHTS, tmp_path / "one" / WEIGHTS)
    code, stdout, err = cli("verify", tmp_path / "one")
    assert code == 3 and "q_proj" in err, stdout + err


# --- multi-component PEFT folders: PEFT per component ---------------------------------------------------------------


def test_multi_component_peft_folder_is_proven_by_peft_and_a_sabotage_fails(tmp_path, cli):
    """A kohya SD 1.5 LoRA converted to PEFT folders per component (`unet/`, `text_encoder/`), merged: PEFT injects
    each component's adapter into that component's weightless model; a text-encoder tensor left unmerged fails."""
    from diffusion_helpers import TE_TARGETS, UNET_TARGETS, kohya_lora, kohya_modules, make_pipeline, save

    models = make_pipeline(tmp_path / "base", "sd15")
    mods = kohya_modules(models["unet"], "lora_unet", UNET_TARGETS)
    mods.update(kohya_modules(models["text_encoder"], "lora_te", TE_TARGETS))
    lora = kohya_lora(mods, alpha=None)
    save(lora, tmp_path / "kohya.safetensors")
    code, out, err = cli("convert", "--adapter", tmp_path / "kohya.safetensors", "--to", "peft", "--base",
                         tmp_path / "base", "--out", tmp_path / "peft")  # fmt: skip
    assert code == 0 and (tmp_path / "peft/unet/adapter_config.json").is_file(), out + err
    assert (tmp_path / "peft/text_encoder/adapter_config.json").is_file()
    code, out, err = cli("merge", "--base", tmp_path / "base", "--adapter", tmp_path / "peft", "--out", tmp_path / "m",
                         "--dtype", "bfloat16", verify=True)  # fmt: skip
    assert code == 0, out + err
    report = json.loads((tmp_path / "m" / "verification.json").read_text())
    tensors = report["tensors"]
    assert tensors["referee"]["name"] == "PEFT" and "per component" in tensors["referee"]["detail"]
    assert tensors["groups"]["unet"]["changed"] and tensors["groups"]["text_encoder"]["changed"]
    te = tmp_path / "m/text_encoder/model.safetensors"
    t, before = load_file(te), load_file(tmp_path / "base/text_encoder/model.safetensors")
    name = next(k for k in sorted(t) if k.endswith("q_proj.weight") and not torch.equal(t[k], before[k].bfloat16()))
    t[name] = before[name].bfloat16()
    save_file(t, te, metadata={"format": "pt"})
    code, out, err = cli("verify", tmp_path / "m")
    assert code == 3 and f"text_encoder/{name}" in err, out + err


def test_shards_proven_before_the_output_exists_resized_vocabulary(tmp_path, cli):
    """A pipelined push proves each shard before the output's config.json is written: the PEFT referee then takes
    the vocabulary the adapter was trained on from its files (a resized embedding saved whole), and the shards'
    verdict is the whole proof (every tensor seen once, nothing missing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from converter.engine.recipe import recorded_recipe
    from converter.engine.writer import Shard
    from converter.verification.shards import ShardProof

    base = make_base(tmp_path / "base", "llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(260)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"],
                      init_lora_weights=False)  # fmt: skip
    get_peft_model(model, lora).save_pretrained(tmp_path / "lora")
    merged = tmp_path / "merged"
    args = ["merge", "--base", base, "--adapter", tmp_path / "lora", "--out", merged, "--no-verify"]
    assert cli(*args, "--max-shard-size", "40KB")[0] == 0
    recipe = recorded_recipe(merged)
    recipe.out = str(tmp_path / "not-written-yet")
    lines = []
    proof = ShardProof(recipe, log=lines.append)
    shards = sorted(merged.glob("*.safetensors"))
    assert len(shards) > 2
    try:
        for path in shards:
            proof.check(Shard(path, path.name, "", path.stat().st_size, b"", ()))
        result, referee = proof.finish()
    finally:
        proof.close()
    assert referee.info.name == "PEFT" and any("before it is uploaded" in line for line in lines)
    assert result.passed and result.changed == 4 and not result.missing  # 2 q_proj, the embedding and the head
    assert referee.expectations()["model.embed_tokens.weight"].shape == (260, 64)


def test_shards_of_a_4bit_output_are_left_to_the_finished_folder(tmp_path):
    """A 4-bit output's packed weights are not proven tensor by tensor: the per-shard check steps aside (nothing
    read, no referee built) and verification judges the finished folder by its behaviour."""
    from converter.engine.recipe import AdapterSpec, Recipe
    from converter.engine.writer import Shard
    from converter.verification.shards import ShardProof

    recipe = Recipe(base=str(tmp_path / "base"), adapters=[AdapterSpec(str(tmp_path / "lora"))], dtype="bnb-nf4")
    proof = ShardProof(recipe, log=lambda _line: None)
    proof.check(Shard(tmp_path / "missing.safetensors", "model.safetensors", "", 0, b"", ()))
    assert proof.finish() is None and proof.declined.startswith("a 4-bit output")
    proof.close()
