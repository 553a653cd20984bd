"""Verification of LLM merges: the tensor proof and the behavioural comparison (PEFT's unmerged forward). Each
sabotage must fail, with the report pointing at what is wrong; the behavioural comparison is also tested by itself
(proofs=("behaviour",)), since it must catch what tensors cannot show. The tensor proof's own sabotage suite is
tests/verification/test_verify_tensors.py."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from model_helpers import assert_failed, assert_round_trips, make_adapter, make_base, shown
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    base = make_base(root / "base", "llama", dtype=torch.bfloat16)
    lora = make_adapter(base, root / "lora", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return base, lora


def merged_copy(tmp_path, cli, base, lora, name="merged", *extra):
    code, out, err = cli("merge", "--base", base, "--adapter", lora, "--out", tmp_path / name, *extra, verify=True)
    assert code == 0, out + err
    return tmp_path / name


def edit(folder, fn):
    f = folder / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def report_of(folder):
    return json.loads((folder / "verification.json").read_text())


def test_good_merge_passes_and_card_shows_it(llama, tmp_path, cli):
    base, lora = llama
    out = merged_copy(tmp_path, cli, base, lora, "merged", "--verify", "full")
    report = report_of(out)
    assert_round_trips(out)  # an LLM's report, read back typed
    assert report["verdict"] == "pass" and report["compute_dtype"] == "float32" and report["output_dtype"] == "BF16"
    assert report["mode"] == "full" and report["weights_in_memory"] == "F32"  # generation: a float32 copy
    m, b = report["merged_vs_reference"], report["base_vs_reference"]
    assert m["mean_kl"] < report["tolerance"]["mean_kl"] < b["mean_kl"]
    # Greedy continuations are reported, not judged: a random tiny model has near-ties that one bf16 rounding flips.
    assert m["greedy_total"] == 4 and m["greedy_identical"] == sum(d is None for d in m["first_divergence"])
    assert b["greedy_identical"] < m["greedy_identical"] and report["peak_rss_mb"] > 0
    assert len(report["generations"]) == 3 and set(report["generations"][0]) == {
        "prompt",
        "base",
        "reference",
        "merged",
    }
    card = (out / "README.md").read_text()
    assert "**Passed**" in card and "Not verified" not in card and "| mean KL(reference‖model) |" in card
    assert "full check" in card and "| greedy continuations identical |" in card
    # Both proofs, plainly: the tensors against PEFT, and the behaviour table
    tensors = report["tensors"]
    assert tensors["referee"]["name"] == "PEFT" and tensors["changed"] == 6 and tensors["untouched"] == 15
    assert tensors["failed"] == 0 and not tensors["missing"] and 0 <= tensors["worst"]["ratio"] <= 1
    assert "every tensor within rounding of base + ΔW (referee: PEFT)" in card and "two proofs" in card


def test_quick_is_the_default_and_judges_the_same(llama, tmp_path, cli):
    """The default check skips the continuations (never judged) and the module probe (a pass needs none) and keeps
    the weights in bf16; its verdict and metrics are those of the full check (float32 copy), the card says which."""
    base, lora = llama
    out = merged_copy(tmp_path, cli, base, lora)
    quick = report_of(out)
    assert quick["mode"] == "quick" and quick["verdict"] == "pass" and quick["generations"] == []
    assert quick["weights_in_memory"] == "BF16" and quick["compute_dtype"] == "float32"  # upcast per layer
    assert quick["execution"].startswith("weights read block by block") and "reference alone" in quick["execution"]
    # The tensor proof passed (PEFT as referee): it has shown what the adapter changes, so no bare base is run
    assert quick["tensors"]["changed"] > 0 and quick["base_vs_reference"] is None
    assert list(quick["phase_seconds"]) == ["tensor proof", "run reference and merged, side by side"]  # no bare base
    assert (
        quick["merged_vs_reference"]["greedy_total"] == 0 and "module probe (on failure)" not in quick["phase_seconds"]
    )
    card = (out / "README.md").read_text()
    assert "quick check" in card and "greedy continuations identical" not in card
    assert "The bare base and the perplexity text were not run" in card
    assert "| base vs reference |" not in card
    code, stdout, err = cli("verify", out, "--verify", "full")
    assert code == 0, stdout + err
    full = report_of(out)
    assert full["mode"] == "full" and full["merged_vs_reference"]["greedy_total"] == 4
    assert full["execution"].startswith("each model loaded whole") and "disable_adapter" in full["execution"]
    assert "- ran as: " in (out / "README.md").read_text()
    assert quick["verdict"] == full["verdict"] and quick["tolerance"] == full["tolerance"]
    for key in ("mean_kl", "confident_top1_agreement"):  # float32 math both: equal to its rounding
        assert quick["merged_vs_reference"][key] == pytest.approx(full["merged_vs_reference"][key], rel=1e-3)
    assert full["base_vs_reference"]["mean_kl"] > full["tolerance"]["mean_kl"]
    # after the passed tensor proof the quick check ran the prompts only; the full one the perplexity text too
    assert quick["merged_vs_reference"]["perplexity"] == "nan" and full["merged_vs_reference"]["perplexity"] > 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2"])
def test_float32_compute_over_bf16_weights_equals_a_float32_copy(family, tmp_path, monkeypatch):
    """Weights kept in bf16, each block upcast while it runs (copied from memory, or read from the safetensors
    files, also with the head and the embedding read a few rows at a time, 16-bit bytes staged a few at a time,
    no read ahead): the logits of a float32 load, each packed row exactly those of the row run alone, for the
    merged model and for PEFT's unmerged reference (adapters on top); afterwards the very bf16 tensors are back."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from converter.engine import precision
    from converter.engine.precision import float32_compute
    from converter.verification.loading import load_model
    from converter.verification.metrics import logits_of

    base = make_base(tmp_path / "base", family, dtype=torch.bfloat16)
    lora = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8)
    rows = [torch.tensor([[1, 5, 9, 2, 7]]), torch.tensor([[3, 4, 11]]), torch.tensor([[8, 6, 2, 2]])]

    for wrap in (lambda m: m, lambda m: PeftModel.from_pretrained(m, lora).eval()):
        exact = wrap(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval())
        with torch.no_grad():  # each row alone, unpadded: what packing must reproduce
            want = [exact(input_ids=r).logits[0] for r in rows]
        for streamed, by_rows in ((False, False), (True, False), (True, True)):
            sources = {} if streamed else None
            lean = wrap(load_model(base, torch.bfloat16, sources=sources))
            assert bool(sources) == streamed  # every weight of the folder is found in its file
            before = {n: (p.dtype, p.data_ptr()) for n, p in lean.named_parameters()}
            if by_rows:  # a head read in 5 blocks of rows, 16-bit bytes upcast 1,000 at a time
                monkeypatch.setattr(precision, "ROWS_MIN", 1000)
                monkeypatch.setattr(precision, "ROW_BLOCK", lean.get_output_embeddings().weight.nbytes // 5)
                monkeypatch.setattr(precision, "STAGING", 2000)
            with float32_compute(lean, sources, prefetch=not by_rows):
                got = logits_of(lean, rows)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            assert not torch.equal(got[0], logits_of(lean, rows)[0])  # without it: bf16 compute, visibly different
            assert {n: (p.dtype, p.data_ptr()) for n, p in lean.named_parameters()} == before
            assert torch.bfloat16 in {dtype for dtype, _ in before.values()}


def test_reference_and_bare_base_in_one_mixed_batch_equal_two_forwards(llama):
    """PEFT's mixed-adapter batch (the adapter's row and a "__base__" row) gives the reference's and the bare
    base's logits of two separate forwards (disable_adapter for the bare base), to float32 rounding."""
    from converter.engine.model_inputs import build_inputs
    from converter.engine.precision import float32_compute
    from converter.engine.recipe import AdapterSpec, Recipe
    from converter.verification.loading import load_reference
    from converter.verification.metrics import mixed_batch, run_model

    base, lora = llama
    recipe = Recipe(base=str(base), adapters=[AdapterSpec(source=str(lora))])
    inputs, _probe, ppl, _ = build_inputs(None, ["a", "b", "c"], 128)
    sources: dict = {}
    model = load_reference(base, [lora], recipe, torch.bfloat16, 128, sources=sources)
    with float32_compute(model, sources):
        ref, bare = mixed_batch(model, inputs, ppl)
        want_ref = run_model(model, inputs, None, ppl, 0)
        with model.disable_adapter():
            want_bare = run_model(model, inputs, None, ppl, 0)
    for got, want in ((ref, want_ref), (bare, want_bare)):
        for g, w in zip(got.logits, want.logits, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert got.perplexity == pytest.approx(want.perplexity, rel=1e-5)
    assert (ref.logits[0] - bare.logits[0]).abs().max() > 1e-2  # the two rows did run differently


def _mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_streamed_float32_compute_leaves_the_mapped_weights_untouched(tmp_path):
    """transformers maps the safetensors file; reading each layer from the file (not through the mapping) keeps
    the model out of the process's memory: its mapping stays (nearly) non-resident. Upcasting from the mapped
    tensors instead pulls every page in, which is what the file reads avoid."""
    from converter.engine.precision import float32_compute
    from converter.verification.loading import load_model
    from converter.verification.metrics import logits_of

    base = make_base(  # ~35 MB: the page or so the loader touches per tensor is small next to each tensor
        tmp_path / "base", "llama", dtype=torch.bfloat16, hidden_size=512, intermediate_size=2048, vocab_size=8192
    )
    weights = (base / "model.safetensors").resolve()
    size_kib = weights.stat().st_size // 1024
    rows = [torch.tensor([[1, 5, 9, 2, 7]])]
    for streamed in (True, False):
        sources = {} if streamed else None
        model = load_model(base, torch.bfloat16, sources=sources)
        with float32_compute(model, sources):
            logits_of(model, rows)
        resident = _mapped_kib(weights)
        if streamed:
            assert resident < size_kib // 4, (resident, size_kib)
        else:
            assert resident > size_kib // 2, (resident, size_kib)
        del model


# PEFT features through the quick check's own paths (file-streamed float32 compute, the reference and the bare base
# in one mixed-adapter batch, or two forwards for DoRA): its numbers must be those of the full check (a float32
# copy, one forward each), and a sabotaged copy must fail it.
PEFT_FEATURES = {
    "dora": ({}, dict(use_dora=True)),
    "modules_to_save": ({}, dict(target_modules=["q_proj"], modules_to_save=["lm_head", "norm"])),
    "embedding_lora_tied": (dict(tie_word_embeddings=True), dict(target_modules=["embed_tokens", "q_proj"])),
    "lm_head_lora_tied": (dict(tie_word_embeddings=True), dict(target_modules=["lm_head", "v_proj"])),
    "trainable_tokens_tied": (
        dict(tie_word_embeddings=True),
        dict(target_modules=["q_proj"], trainable_token_indices=[5, 17, 200]),
    ),
}


@pytest.mark.parametrize("feature", list(PEFT_FEATURES))
def test_quick_check_of_each_peft_feature_equals_the_full_check(feature, tmp_path, cli):
    base_options, lora_options = PEFT_FEATURES[feature]
    base = make_base(tmp_path / "base", "llama", dtype=torch.bfloat16, **base_options)
    lora = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, **lora_options)
    out = merged_copy(tmp_path, cli, base, lora)
    quick = report_of(out)
    assert quick["verdict"] == "pass", quick["problems"]
    assert quick["mode"] == "quick" and quick["weights_in_memory"] == "BF16"
    code, stdout, err = cli("verify", out, "--verify", "full")
    assert code == 0, stdout + err
    full = report_of(out)
    for key in ("mean_kl", "confident_top1_agreement"):
        assert quick["merged_vs_reference"][key] == pytest.approx(full["merged_vs_reference"][key], rel=1e-3)
    assert full["base_vs_reference"]["mean_kl"] > full["tolerance"]["mean_kl"]  # the adapter does something
    assert quick["tensors"]["changed"] > 0 and quick["base_vs_reference"] is None  # ... which the tensors show
    # ... and the same quick path fails a sabotaged copy: every change the merge made, negated (a wrong sign; a
    # wrong scale can hide behind the norms here: this random embedding LoRA dwarfs the embedding it adapts)
    changed = json.loads((out / "converter_provenance.json").read_text())["tensors"]["changed"]
    original = load_file(base / "model.safetensors")

    def negated(t):
        for n in changed:
            before = original[n if n in original else "model.embed_tokens.weight"].float()  # a tied head's base
            t[n] = (before - (t[n].float() - before)).to(t[n].dtype)

    edit(out, negated)
    code, stdout, err = cli("verify", out)
    assert code == 3 and report_of(out)["verdict"] == "fail"  # the tensor proof names every negated tensor
    tensors = report_of(out)["tensors"]
    assert tensors["failed"] == len(changed) and {f["name"] for f in tensors["failures"]} <= set(changed)
    behaviour = verdict_of(out, prompts=None, proofs=("behaviour",))  # and the behaviour, by itself, fails too
    assert behaviour.verdict == "fail" and behaviour.behaviour.mode == "quick", behaviour.problems


def test_two_adapters_run_the_bare_base_in_its_own_forward_and_a_sabotage_still_fails(llama, tmp_path, cli):
    """PEFT's mixed batch takes one adapter per row: with two adapters the bare base gets its own forward
    (disable_adapter), the weights still streamed; a right merge passes and a shifted tensor fails."""
    base, lora = llama
    other = make_adapter(base, tmp_path / "other", seed=2, r=4, lora_alpha=8, target_modules=["k_proj", "up_proj"])
    out = tmp_path / "two"
    args = ["merge", "--base", base, "--adapter", lora, "--adapter", other, "--out", out]
    code, stdout, err = cli(*args, verify=True)
    assert code == 0, stdout + err
    assert report_of(out)["verdict"] == "pass"
    behaviour = verdict_of(out, prompts=None)  # the behaviour alone: the bare base runs (no tensor proof shows it)
    assert behaviour.verdict == "pass" and "disable_adapter" in behaviour.behaviour.execution
    assert behaviour.behaviour.execution.startswith("weights read block by block")
    assert behaviour.behaviour.base_vs_reference.mean_kl > behaviour.behaviour.tolerance.mean_kl
    edit(out, lambda t: t["model.layers.1.mlp.up_proj.weight"].add_(0.2))
    code, stdout, err = cli("verify", out)
    assert code == 3 and "model.layers.1.mlp.up_proj" in stdout + err


def test_perturbed_tensor_fails_and_is_located(llama, tmp_path, cli):
    base, lora = llama
    out = merged_copy(tmp_path, cli, base, lora)
    edit(out, lambda t: t["model.layers.1.mlp.up_proj.weight"].add_(0.2))
    assert_failed(cli("verify", out, "--report", tmp_path / "r.json"), "model.layers.1.mlp.up_proj")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "fail"
    assert report["tensors"]["failures"][0]["name"] == "model.layers.1.mlp.up_proj.weight"
    assert report["behaviour_skipped"] == "the tensor proof already failed"
    assert "FAILED" in (out / "README.md").read_text()
    behaviour = verdict_of(out, prompts=None, proofs=("behaviour",))  # by itself, the probe locates the module
    assert behaviour.behaviour.first_disagreeing_module.module == "model.layers.1.mlp.up_proj"


def test_wrong_scale_fails(llama, tmp_path, cli):
    """alpha/r dropped (scale 1 instead of 2): merge a doctored copy of the adapter, verify against the real one."""
    base, lora = llama
    wrong = tmp_path / "wrong-lora"
    shutil.copytree(lora, wrong)
    config = json.loads((wrong / "adapter_config.json").read_text())
    config["lora_alpha"] = config["r"]
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    assert cli("merge", "--base", base, "--adapter", wrong, "--out", tmp_path / "m")[0] == 0
    code, out, err = cli("verify", tmp_path / "m", "--base", base, "--adapter", lora)
    assert code == 3, out + err
    assert "model.layers.0.self_attn.q_proj" in err


def test_missing_transpose_fails(tmp_path, cli):
    base = make_base(tmp_path / "base", "gpt2")
    lora = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["c_proj"])
    out = tmp_path / "merged"
    assert cli("merge", "--base", base, "--adapter", lora, "--out", out)[0] == 0
    original = load_file(base / "model.safetensors")
    name = "transformer.h.0.attn.c_proj.weight"  # square: a transposed delta still fits

    def transpose_delta(t):
        t[name] = original[name] + (t[name] - original[name]).T

    edit(out, transpose_delta)
    code, stdout, err = cli("verify", out)
    assert code == 3, stdout + err
    assert "transformer.h.0.attn.c_proj" in err


def test_no_op_merge_fails(llama, tmp_path, cli):
    base, lora = llama
    out = merged_copy(tmp_path, cli, base, lora)
    shutil.copyfile(base / "model.safetensors", out / "model.safetensors")
    code, stdout, err = cli("verify", out)
    assert code == 3, stdout + err
    assert "as if the change were not merged" in err
    behaviour = verdict_of(out, prompts=None, proofs=("behaviour",))
    assert any("as far from the reference as the bare base" in p for p in behaviour.problems)


def test_custom_prompts_with_a_real_tokenizer_and_chat_template(tmp_path, cli):
    from test_smollm2 import FIXTURE

    if not (FIXTURE / "tokenizer.json").is_file():
        pytest.fail(f"SmolLM2 fixture missing at {FIXTURE}: run `make fixtures`")
    base = make_base(tmp_path / "base", "llama", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(FIXTURE / name, base / name)
    lora = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n\nwhy is the sea blue?\n")
    code, out, err = cli(
        "merge",
        "--base",
        base,
        "--adapter",
        lora,
        "--out",
        tmp_path / "m",
        "--prompts",
        prompts,
        "--max-new-tokens",
        "5",
        "--verify",
        "full",
        verify=True,
    )
    assert code == 0, out + err
    report = report_of(tmp_path / "m")
    assert report["inputs"] == {"count": 2, "chat_template": True, "tokenizer": True, "max_new_tokens": 5}
    assert report["generations"][1]["prompt"] == "why is the sea blue?"
    assert (tmp_path / "m" / "chat_template.jinja").is_file()


def test_adapter_peft_cannot_load_is_proven_by_the_formula_and_its_behaviour_skipped(tmp_path, cli):
    """Split q/k/v adapter into Phi-3's fused projections: merged by keymap; PEFT cannot apply it (its own
    refusal, not any error), so the published formula proves the tensors and the behaviour is not compared."""
    phi = make_base(tmp_path / "phi", "phi3")
    llama = make_base(tmp_path / "llama", "llama")
    lora = make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"])
    code, out, err = cli("merge", "--base", phi, "--adapter", lora, "--out", tmp_path / "m", verify=True)
    assert code == 0, out + err
    report = report_of(tmp_path / "m")
    assert report["verdict"] == "pass" and report["tensors"]["referee"]["name"] == "published formula"
    assert "not found in the base model" in report["tensors"]["referee"]["detail"]
    assert report["tensors"]["changed"] == 2 and "PEFT cannot apply" in report["behaviour_skipped"]
    card = (tmp_path / "m" / "README.md").read_text()
    assert "referee: published formula; module placement from converter's keymap" in card
    assert "**Behaviour**: not compared (PEFT cannot apply" in card


def test_models_larger_than_memory_verify_offloaded_to_disk(llama, tmp_path, cli, monkeypatch):
    """A memory budget below the model's size: accelerate offloads weights to disk, the verdict is unchanged."""
    base, lora = llama
    before = hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    code, out, err = cli(
        "merge", "--base", base, "--adapter", lora, "--out", tmp_path / "m", "--verify-memory", "200KB", verify=True
    )
    assert code == 0, out + err
    report = report_of(tmp_path / "m")
    assert report["offloaded"] and report["compute_dtype"] == "float32" and report["verdict"] == "pass"
    assert report["offload_memory_bytes"] == 100_000 and "offloaded to disk" in shown(report)
    assert "load reference" in report["phase_seconds"] and "run merged" in report["phase_seconds"]
    # The same sabotage as above is still caught by the behaviour when offloaded.
    edit(tmp_path / "m", lambda t: t["model.layers.1.mlp.up_proj.weight"].add_(0.2))
    behaviour = verdict_of(tmp_path / "m", memory=200_000, prompts=None, proofs=("behaviour",))
    assert behaviour.verdict == "fail" and behaviour.behaviour.offloaded
    assert behaviour.behaviour.first_disagreeing_module.module == "model.layers.1.mlp.up_proj"
    # PEFT's offload rewrite copies base shards: never into the working directory, never over the base itself.
    assert list((tmp_path / "cwd").iterdir()) == []
    assert hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest() == before


# Self-test of the behavioural comparison by itself: a right merge passes and each sabotage fails, naming the
# module, on the in-memory and the offloaded path alike. Every family in memory with one sabotage each; on llama
# the whole sabotage x path x dtype matrix. Merges are made once per (family, dtype) and sabotaged as copies.
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2"]
SABOTAGES = ["perturbed", "scale_dropped", "nothing_merged"]
OFFLOAD = 200_000  # bytes: below any tiny model's size, so accelerate offloads weights to disk


def _sabotage(kind, right, base, folder):
    """A copy of the right merge with one defect: one tensor off, the adapter scale (alpha/r = 2) lost, or no
    merge at all. Returns the module verification must name (None: any adapted module)."""
    shutil.copytree(right, folder)
    if kind == "nothing_merged":
        shutil.copyfile(base / "model.safetensors", folder / "model.safetensors")
        return None
    original = load_file(base / "model.safetensors")
    changed = json.loads((right / "converter_provenance.json").read_text())["tensors"]["changed"]
    if kind == "scale_dropped":
        edit(
            folder,
            lambda t: t.update(
                {n: (original[n].float() + (t[n].float() - original[n].float()) / 2).to(t[n].dtype) for n in changed}
            ),
        )
        return None
    name = next(n for n in changed if ".1.mlp." in n)  # a layer-1 weight: not the first module that runs

    def shifted(t):  # the perturbation test_perturbed_tensor_fails_and_is_located uses
        t[name] = (t[name].float() + 0.2).to(t[name].dtype)

    edit(folder, shifted)
    return name.removesuffix(".weight")


@pytest.fixture(scope="module")
def sabotaged(tmp_path_factory):
    """(family, dtype) -> {"right": folder, sabotage: (folder, module to name)}, each built once."""
    from converter.cli import main

    built = {}

    def get(family, dtype):
        if (family, dtype) not in built:
            root = tmp_path_factory.mktemp(f"{family}-{str(dtype).split('.')[-1]}")
            base = make_base(root / "base", family, dtype=dtype)
            lora = make_adapter(base, root / "lora", r=4, lora_alpha=8)
            right = root / "right"
            assert main(["merge", "--base", str(base), "--adapter", str(lora), "--out", str(right), "--no-verify"]) == 0
            changed = json.loads((right / "converter_provenance.json").read_text())["tensors"]["changed"]
            folders = {"right": (right, None), "adapted": {n.removesuffix(".weight") for n in changed}}
            for kind in SABOTAGES:
                folders[kind] = (root / kind, _sabotage(kind, right, base, root / kind))
            built[family, dtype] = folders
        return built[family, dtype]

    return get


def verdict_of(folder, memory=None, prompts=("a", "b"), proofs=("behaviour",)):
    """The behavioural comparison by itself (the tensor proof would stop every sabotage first)."""
    from converter.engine.recipe import recorded_recipe
    from converter.verification import verify

    # Greedy continuations are reported, not judged: two short ones keep the matrix affordable (offloaded
    # generation reads every weight from disk per token).
    return verify(folder, recorded_recipe(folder), prompts=list(prompts) if prompts else None, max_new_tokens=2,
                  memory=memory, log=print, proofs=proofs)  # fmt: skip


def check_verdict(report, folders, kind):
    report = report.to_dict()
    if kind == "right":
        assert report["verdict"] == "pass", report["problems"]
        return
    assert report["verdict"] == "fail", f"{kind} passed: {report['merged_vs_reference']}"
    culprit = report["first_disagreeing_module"]
    assert culprit is not None, report["problems"]
    expected = folders[kind][1]
    if expected:
        assert culprit["module"] == expected
    else:
        assert culprit["module"] in folders["adapted"]
    if kind == "nothing_merged":
        assert any("as far from the reference as the bare base" in p for p in report["problems"])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_right_merge_passes_and_a_sabotage_fails(sabotaged, family):
    folders = sabotaged(family, torch.float32)
    kind = SABOTAGES[FAMILIES.index(family) % len(SABOTAGES)]
    check_verdict(verdict_of(folders["right"][0]), folders, "right")
    check_verdict(verdict_of(folders[kind][0]), folders, kind)


@pytest.mark.parametrize("kind", ["right", *SABOTAGES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_offloaded_verdict_equals_in_memory_verdict(sabotaged, kind, dtype):
    folders = sabotaged("llama", dtype)
    in_memory = verdict_of(folders[kind][0])
    offloaded = verdict_of(folders[kind][0], memory=OFFLOAD)
    assert not in_memory.behaviour.offloaded and offloaded.behaviour.offloaded
    check_verdict(in_memory, folders, kind)
    check_verdict(offloaded, folders, kind)
    same = ("verdict", "first_disagreeing_module")
    in_memory, offloaded = in_memory.to_dict(), offloaded.to_dict()
    assert [in_memory[k] and _module(in_memory[k]) for k in same] == [
        offloaded[k] and _module(offloaded[k]) for k in same
    ]


def _module(value):
    return value["module"] if isinstance(value, dict) else value


def test_offloaded_in_bfloat16_when_the_disk_holds_no_float32_copy(sabotaged, monkeypatch):
    """Too little disk for float32 offloading: bfloat16 compute, judged by bfloat16's rounding (not the float32
    output's), so a right float32 merge still passes and a sabotage still fails."""
    from converter.verification import loading

    folders = sabotaged("llama", torch.float32)
    params = sum(t.numel() for t in load_file(folders["right"][0] / "model.safetensors").values())
    monkeypatch.setattr(loading, "_free_disk", lambda _folder: params * 2 * 3 + 1)  # bf16 fits, float32 does not
    for kind in ("right", "perturbed"):
        report = verdict_of(folders[kind][0], memory=OFFLOAD)
        assert report.behaviour.offloaded and report.behaviour.compute_dtype == "bfloat16"
        assert report.behaviour.tolerance.mean_kl == tolerance_of("F32", "BF16")
        check_verdict(report, folders, kind)


def tolerance_of(output, compute):
    from converter.verification import tolerance

    return tolerance(output, compute)["mean_kl"]


def llama_headers(folder, hidden=4096, layers=32, intermediate=14336, vocab=128256, kv=1024):
    """A Llama-3-8B-shaped folder (8.03 B parameters, bf16) whose safetensors file is all header: its data is a
    hole (a sparse file), which is all a placement decision reads."""
    from converter.io.safetensors_header import encode_header, entry

    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["lm_head.weight"] = (vocab, hidden)
    entries, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(torch.tensor(shape).prod())
        entries[name] = entry("BF16", shape, offset, offset + size)
        offset += size
    folder.mkdir()
    header = encode_header(entries)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(header)
        f.truncate(len(header) + offset)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    return folder, offset // 2


def test_an_8b_bf16_model_verifies_in_memory_on_a_24gb_machine(tmp_path, monkeypatch):
    """Weights left mapped from their files, each layer read in float32 while it runs: Llama-3-8B's shapes need
    only their working set (two blocks and the 128256 x 4096 embedding in float32, a 16-bit staging copy, 1 GiB),
    well inside the ~21 GiB a 24 GB machine has, and inside 8 GiB too. Holding the bf16 weights as well would
    not fit 8 GiB, and a whole float32 copy does not fit even 21 GiB: both go to disk."""
    from converter.verification import loading
    from converter.verification.loading import choose_placement, upcast_working_set

    monkeypatch.setattr(loading, "_free_disk", lambda _folder: 2**40)  # offloading possible: the choice is memory's
    folder, params = llama_headers(tmp_path / "llama-8b")
    assert params == 8_030_261_248
    working = upcast_working_set(folder)
    assert 5 * 2**30 < working < 7 * 2**30
    for available in (21 * 2**30, 8 * 2**30):
        assert choose_placement(params, available, tmp_path, 0, working) == ("float32", None)
    assert choose_placement(params, 8 * 2**30, tmp_path, 2, working)[1] is not None
    assert choose_placement(params, 21 * 2**30, tmp_path, 4)[1] is not None  # float32 weights: to disk
