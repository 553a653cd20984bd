"""The pieces of verification that need no model: the pure judge, the renderer, and the TensorProof's streaming
API on hand-made safetensors files with a referee stated by hand (a right tensor passes, each defect fails)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from converter.verification.judge import failing_components, judge, judge_diffusion, judge_llm, judge_tensors
from converter.verification.referee import Expectation, Expected, RefereeInfo
from converter.verification.report import (
    ComponentComparison,
    DiffusionTolerance,
    Disagreement,
    LLMTolerance,
    LogitComparison,
    OutputDifference,
)
from converter.verification.tensors import TensorCheck, TensorProof, TensorProofResult, locations

TOL = LLMTolerance(mean_kl=1e-3, confident_top1_agreement=0.99, module_rel_err=1e-2)


def metrics(kl: float, top1: float = 1.0) -> LogitComparison:
    return LogitComparison(0.1, 0.01, kl, top1, 10, top1, 0, 0, [], math.nan)


def result(**kw) -> TensorProofResult:
    return TensorProofResult(RefereeInfo("PEFT", "test"), **kw)


def test_judge_passes_only_when_every_proof_that_ran_passed():
    ok = result(tensors=3, changed=2, untouched=1)
    assert judge(ok, ([], [])).verdict == "pass"
    assert judge(ok, None, (None, "PEFT cannot apply")).verdict == "pass"  # the tensors alone
    assert judge(None, ([], []), ("a 4-bit output", None)).verdict == "pass"  # the behaviour alone
    assert judge(None, None, ("no referee", "no reference")).verdict == "skipped"
    bad = result(tensors=3, failed=1, failures=[TensorCheck("w", "LoRA", "m", ratio=42.0, problem="42x")])
    verdict = judge(bad, ([], []))
    assert verdict.verdict == "fail" and verdict.problems == ["w (LoRA, module m): 42x"]
    assert judge(ok, (["mean KL too high"], [])).verdict == "fail"


def test_judge_names_missing_and_extra_tensors_and_counts_the_rest():
    r = result(failed=12, failures=[TensorCheck(f"t{i}", "LoRA", problem="off") for i in range(10)],
               missing=["a", "b"], extra=["z"])  # fmt: skip
    problems, _ = judge_tensors(r)
    assert "... and 2 more tensors wrong" in problems
    assert any(p.startswith("2 tensor(s) of the base missing") and "a, b" in p for p in problems)
    assert any("that the base does not have: z" in p for p in problems)


def test_judge_notes_a_tensor_the_adapters_do_not_change():
    weak = TensorCheck("w", "LoRA", numel=10, changed=0)
    _, notes = judge_tensors(result(changed=1, weakest_effect=weak))
    assert notes and "could not be told apart" in notes[0]


def test_judge_llm_thresholds_and_the_no_op_rule():
    assert judge_llm(metrics(1e-4), metrics(1.0), TOL) == ([], [])
    problems, _ = judge_llm(metrics(2e-3), metrics(1.0), TOL)
    assert problems and "mean KL" in problems[0]
    problems, _ = judge_llm(metrics(5e-4, top1=0.5), metrics(1.0), TOL)
    assert "top-1 agreement" in problems[0]
    problems, _ = judge_llm(metrics(9e-4), metrics(2e-3), TOL)  # within KL, but as far as the bare base
    assert "as far from the reference as the bare base" in problems[0]
    _, notes = judge_llm(metrics(1e-4), metrics(5e-4), TOL)  # the adapter barely changes anything
    assert "could not be told apart" in notes[0]
    problems, _ = judge_llm(metrics(2e-3), metrics(1.0), TOL, Disagreement("a.b", 0.5))
    assert problems[-1].startswith("first module that disagrees: a.b")


def test_judge_diffusion_per_component_and_the_no_op_rule():
    tol = DiffusionTolerance(output_rel_err=1e-6, module_rel_err=1e-5)

    def component(merged: float, bare: float) -> ComponentComparison:
        return ComponentComparison(OutputDifference(merged, 0.0, 0.0), OutputDifference(bare, 0.0, 0.0))

    right, off, as_bare = component(1e-7, 0.2), component(1e-3, 0.2), component(1e-7, 1e-7)
    assert judge_diffusion({"unet": right}, tol) == ([], [])
    problems, _ = judge_diffusion({"unet": right, "text_encoder": off}, tol, [Disagreement("text_encoder.q", 0.3)])
    assert problems[0].startswith("text_encoder: relative error 0.001 >")
    assert problems[-1] == "first module that disagrees: text_encoder.q (relative error 0.3)"
    assert failing_components({"unet": right, "text_encoder": off}, tol) == ["text_encoder"]
    _, notes = judge_diffusion({"unet": as_bare}, tol)  # the adapter barely changes it
    assert "could not be told apart" in notes[0]


class Stated:
    """A referee stated by hand: `w` gets `delta` added (LoRA-like), everything else is untouched."""

    info = RefereeInfo("stated", "by hand")

    def __init__(self, delta: torch.Tensor, rows: bool = True):
        self.delta, self.row_blocks = delta.double(), rows

    def expectations(self) -> dict:
        def rows(base, start, end):
            return Expected(base + self.delta[start:end].to(base.dtype))

        return {"w": Expectation("module.w", "LoRA", rows, self.row_blocks)}


@pytest.fixture
def files(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(64, 32, generator=g).to(torch.bfloat16), "n": torch.randn(32, generator=g)}
    delta = torch.randn(64, 32, generator=g) * 0.05
    save_file(base, tmp_path / "base.safetensors")
    merged = {"w": (base["w"].double() + delta.double()).to(torch.bfloat16), "n": base["n"].clone()}
    return tmp_path, base, merged, delta


def prove(tmp_path, base_tensors, merged, delta, out_dtype=None, rows=True, shards=1):
    from converter.engine.checkpoint import Checkpoint

    (tmp_path / "b").mkdir(exist_ok=True)
    save_file(base_tensors, tmp_path / "b" / "model.safetensors")
    (tmp_path / "b" / "config.json").write_text("{}")
    proof = TensorProof(locations(Checkpoint(tmp_path / "b")), Stated(delta, rows), out_dtype)
    names = sorted(merged)
    for i in range(shards):  # shard by shard, as a pipelined upload would call it
        part = {k: merged[k] for k in names[i::shards]}
        path = tmp_path / f"out-{i}.safetensors"
        save_file(part, path)
        checks = proof.check_file(path)
        assert {c.name for c in checks} == set(part) - ({"x"} if "x" in part else set())
    return proof.result()


@pytest.mark.parametrize("rows", [True, False], ids=["row-blocks", "whole"])
def test_right_tensors_pass_shard_by_shard(files, monkeypatch, rows):
    from converter.verification import tensors

    monkeypatch.setattr(tensors, "BLOCK_ELEMENTS", 100)  # many row blocks
    tmp_path, base, merged, delta = files
    r = prove(tmp_path, base, merged, delta, rows=rows, shards=2)
    assert r.passed and r.changed == 1 and r.untouched == 1 and r.worst.ratio <= 1
    assert r.worst.changed == 64 * 32 - r.worst.inexact or r.worst.changed > 0


def test_the_verdict_does_not_depend_on_which_worker_finished_first(files):
    """Workers append checks as they finish; two tensors changed alike tie, and the report must still be the
    same run to run (a re-push compares it with the published one)."""
    from converter.engine.checkpoint import Checkpoint

    tmp_path, base, merged, delta = files
    prove(tmp_path, base, merged, delta)  # writes the base folder
    proof = TensorProof(locations(Checkpoint(tmp_path / "b")), Stated(delta), None)
    a = TensorCheck("a", "LoRA", ratio=0.5, numel=10, changed=10)
    b = TensorCheck("b", "LoRA", ratio=0.5, numel=10, changed=10)
    results = []
    for order in ([a, b], [b, a]):
        proof.checks = list(order)
        results.append(proof.result())
    assert results[0] == results[1] and results[0].worst.name == results[0].weakest_effect.name == "a"


def test_each_defect_fails_with_its_name(files):
    tmp_path, base, merged, delta = files
    doubled = {**merged, "w": (base["w"].double() + 2 * delta.double()).to(torch.bfloat16)}
    r = prove(tmp_path, base, doubled, delta)
    assert not r.passed and r.failures[0].name == "w" and r.failures[0].ratio > 10
    assert r.failures[0].relative == pytest.approx(1.0, rel=0.05) and r.failures[0].module == "module.w"
    ulp = {**merged, "n": merged["n"].clone()}
    ulp["n"].view(torch.int32)[3] += 1
    r = prove(tmp_path, base, ulp, delta)
    assert [f.name for f in r.failures] == ["n"] and "1 element(s) differ" in r.failures[0].problem
    r = prove(tmp_path, base, {"w": merged["w"]}, delta)
    assert r.missing == ["n"] and not r.passed
    r = prove(tmp_path, base, {**merged, "x": torch.zeros(2)}, delta)
    assert r.extra == ["x"] and not r.passed
    r = prove(tmp_path, base, {**merged, "w": merged["w"].float()}, delta)  # stored in another dtype
    assert "stored as F32" in r.failures[0].problem
    nan = {**merged, "w": merged["w"].clone()}
    nan["w"][0, 0] = float("nan")
    r = prove(tmp_path, base, nan, delta)
    assert r.failures[0].name == "w" and not math.isfinite(r.failures[0].ratio)


def test_a_dtype_change_is_checked_as_the_exact_cast(files):
    tmp_path, base, merged, delta = files
    cast = {"w": (base["w"].double() + delta.double()).to(torch.float16), "n": base["n"].to(torch.float16)}
    assert prove(tmp_path, base, cast, delta, out_dtype="F16").passed
    cast["n"] = (base["n"].double() * (1 + 2**-9)).to(torch.float16)  # not the exact cast of the base
    assert not prove(tmp_path, base, cast, delta, out_dtype="F16").passed


def test_the_report_renders_both_proofs():
    from converter.verification.render import markdown
    from converter.verification.report import VerificationReport

    r = result(tensors=3, changed=2, untouched=1, elements=100, inexact=1,
               worst=TensorCheck("w", "LoRA", ratio=0.5, numel=100, changed=90, inexact=1))  # fmt: skip
    report = VerificationReport("llm", "pass", tensors=r, behaviour_skipped="PEFT cannot apply the adapters")
    text = markdown(report)
    assert "**Passed** (one proof)" in text and "every tensor within rounding of base + ΔW (referee: PEFT)" in text
    assert "99.00% of their 100 elements exactly" in text and "worst 0.5x" in text
    assert "**Behaviour**: not compared (PEFT cannot apply the adapters)" in text
    skipped = VerificationReport("llm", "skipped", notes=["tensor proof not run: x", "behaviour not run: y"])
    assert markdown(skipped).startswith("**Not verified**")
