"""The verification report as a record: typed in memory, plain JSON in verification.json, read back into the same
types (reports written before it was typed included), and written in words only by render.py (log, card, app)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from converter.hub.card import build_card
from converter.verification import VerificationReport, card_section, markdown
from converter.verification.referee import RefereeInfo
from converter.verification.report import (
    ComponentComparison,
    DiffusionBehaviour,
    DiffusionInputs,
    DiffusionTolerance,
    Disagreement,
    Generation,
    ImageRow,
    LLMBehaviour,
    LLMInputs,
    LLMTolerance,
    LogitComparison,
    MetricSummary,
    OutputDifference,
    QLoRAMerge,
    QLoRAStudy,
)
from converter.verification.tensors import TensorCheck, TensorGroup, TensorProofResult

DATA = Path(__file__).parents[1] / "data"


def logits(kl: float, perplexity: float = math.nan) -> LogitComparison:
    return LogitComparison(0.5, 0.01, kl, 0.9, 12, 1.0, 3, 4, [None, 2, None, None], perplexity, 9.5)


def llm_report(**kw) -> VerificationReport:
    summary = MetricSummary(1e-3, 0.2, 0.97, 2, 4)
    behaviour = LLMBehaviour(
        mode="full", reference="the base + adapters applied unmerged through PEFT", compute_dtype="float32",
        weights_in_memory="BF16", offloaded=False, execution="in memory", offload_memory_bytes=None,
        output_dtype="BF16", tolerance=LLMTolerance(1e-5, 0.99, 1e-2, kernel_noise_mean_kl=2e-6),
        inputs=LLMInputs(4, True, True, 16), merged_vs_reference=logits(1e-6), base_vs_reference=logits(0.3, 11.0),
        first_disagreeing_module=Disagreement("model.layers.0.mlp", 0.4),
        generations=[Generation("why?", "a", "b", "b")],
        qlora=QLoRAStudy("base in NF4", {"original": QLoRAMerge(True, summary, summary, 10.0),
                                         "dequantized": QLoRAMerge(False, summary, summary, 10.5)},
                         "original", math.inf, 10.1, 9.9, 0.05),
    )  # fmt: skip
    worst = TensorCheck("w", "LoRA", "m", ratio=math.inf, numel=10, changed=9, relative=1.0, problem="off")
    referee = RefereeInfo("PEFT", "PEFT's merge", notes=["n"])
    tensors = TensorProofResult(referee, tensors=3, changed=2, worst=worst, failures=[worst], failed=1,
                                groups={"model": TensorGroup(3, 2, 1, math.inf)})  # fmt: skip
    return VerificationReport("llm", "fail", ["w: off"], ["a note"], tensors, behaviour=behaviour,
                              phase_seconds={"run": 1.5}, **kw)  # fmt: skip


def diffusion_report() -> VerificationReport:
    diff = OutputDifference(1e-7, 1e-5, 1e-8)
    behaviour = DiffusionBehaviour(
        "the base + adapters applied unmerged by diffusers' load_lora_weights / set_adapters", "float32", "F32",
        DiffusionTolerance(1e-6, 1e-5), DiffusionInputs([900, 500, 100], ["unet"], 4),
        {"unet": ComponentComparison(diff, OutputDifference(0.2, 1.0, 0.1))},
    )  # fmt: skip
    images = [ImageRow("(random token ids #0)", "verification/base-0.png", "verification/reference-0.png",
                       "verification/merged-0.png", 41.5, 3)]  # fmt: skip
    return VerificationReport("diffusion", "pass", behaviour=behaviour, images=images)


def test_a_report_round_trips_through_json_infinities_and_nan_included():
    for report in (llm_report(), diffusion_report(), VerificationReport("llm", tensors_skipped="no referee")):
        text = report.to_json()
        again = VerificationReport.from_json(text)
        assert again == report and again.to_json() == text
        assert type(again.behaviour) is type(report.behaviour)
    again = VerificationReport.from_json(llm_report().to_json())
    assert math.isinf(again.tensors.worst.ratio) and math.isnan(again.behaviour.merged_vs_reference.perplexity)
    assert again.behaviour.qlora.modes["dequantized"].vs_qlora_reference.top1_agreement == 0.97
    assert again.tensors.groups["model"] == TensorGroup(3, 2, 1, math.inf)


def test_the_behaviours_fields_never_shadow_the_reports_own():
    """verification.json holds the behaviour's fields at its top level, beside the report's own ("reference" is
    the report's property, in words)."""
    from dataclasses import fields

    own = {f.name for f in fields(VerificationReport)} | {"reference"}
    for behaviour in (LLMBehaviour, DiffusionBehaviour):
        assert not ({f.name for f in fields(behaviour)} - {"reference"}) & own


def test_reports_that_say_something_else_are_not_equal():
    changed = llm_report()
    changed.behaviour.merged_vs_reference.mean_kl = 2e-6
    assert changed != llm_report() and llm_report(peak_rss_mb=1.0) != llm_report()


def test_the_json_keeps_its_layout_and_holds_no_markdown():
    data = json.loads(llm_report().to_json())
    assert "markdown" not in data and data["mode"] == "full" and data["reference"].startswith("the base")
    assert data["merged_vs_reference"]["perplexity"] == "nan" and data["tensors"]["worst"]["ratio"] == "inf"
    assert data["tolerance"]["kernel_noise_mean_kl"] == 2e-6
    data = json.loads(diffusion_report().to_json())
    assert data["components"]["unet"]["base_vs_reference"]["rel_err"] == 0.2
    no_noise = llm_report()
    no_noise.behaviour.tolerance.kernel_noise_mean_kl = None  # a key only a 4-bit reference's report has
    assert "kernel_noise_mean_kl" not in json.loads(no_noise.to_json())["tolerance"]


def test_reports_written_with_their_markdown_read_back_and_render_the_same():
    for name in ("verification_llm_with_markdown.json", "verification_diffusion_with_markdown.json"):
        data = json.loads((DATA / name).read_text())
        report = VerificationReport.from_dict(data)
        assert report.behaviour is not None and report.verdict == "pass"
        assert markdown(report) == data["markdown"]  # the renderer writes what was stored


def test_an_older_report_missing_fields_is_still_readable():
    old = {"kind": "llm", "verdict": "pass", "problems": [], "notes": [], "seconds": 3.0, "markdown": "**Passed**",
           "mode": "quick", "reference": "PEFT", "compute_dtype": "float32", "output_dtype": "BF16", "offloaded": False,
           "tolerance": {"mean_kl": 1e-5, "confident_top1_agreement": 0.99, "module_rel_err": 0.01},
           "inputs": {"count": 4, "chat_template": False, "tokenizer": True, "max_new_tokens": 0},
           "merged_vs_reference": {"mean_kl": 1e-7, "top1_agreement": 1.0, "max_abs_logit_diff": 0.01},
           "base_vs_reference": None, "first_disagreeing_module": None}  # fmt: skip
    report = VerificationReport.from_dict(old)
    assert report.behaviour.weights_in_memory == "" and report.phase_cpu_seconds == {}
    assert report.behaviour.merged_vs_reference.mean_kl == 1e-7
    assert math.isnan(report.behaviour.merged_vs_reference.perplexity_reference)


def test_the_cards_verification_section_is_the_report_and_its_image_grid():
    report = diffusion_report()
    section = card_section(report)
    assert section.startswith(markdown(report)) and "![merged](verification/merged-0.png)" in section
    assert "| prompt | base | reference (unmerged) | merged |" in section and "41.5 dB (max diff 3)" in section
    assert card_section(None) is None and "![" not in card_section(llm_report())
    prov = {"base": {"source": "/x/base", "layout": "diffusers"}, "adapters": [], "version": "0", "precision": "fp32",
            "dtype": "as base", "tensors": {"changed": [], "total": 1}}  # fmt: skip
    assert section in build_card(prov, section)
    assert "**Not verified.**" in build_card(prov, None)
