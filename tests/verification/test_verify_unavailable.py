"""A verifier that cannot judge never deletes a correct merge, never calls itself a bug, and never lets an unproven
output through as "passed": each referee that cannot be built says why in one line and the next is asked; when
none can judge the tensors the output is kept, marked not verified (exit 5), and a push pushes nothing.

The base is a Llama whose config names a model type transformers does not know (as a model with custom code
does): its checkpoint keys equal its module names, so the merge needs nothing from transformers, but neither
PEFT nor the behavioural comparison can build it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_helpers import make_adapter, make_base, peft_merged_fp64, read_tensors

from converter.testing.hub import HubServer, client_env
from converter.verification.judge import judge

ALICE = "hf_fake_alice_0123456789"


def unknown_type(folder: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="toyllama", architectures=["ToyLlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("unavailable")
    base = make_base(root / "llama", "llama")
    plain = make_adapter(base, root / "lora", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    patterned = make_adapter(base, root / "patterned", seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             rank_pattern={"v_proj": 2})  # fmt: skip
    expected = peft_merged_fp64(base, plain)
    toy = root / "toy"
    toy.mkdir()
    for f in base.iterdir():
        (toy / f.name).write_bytes(f.read_bytes())
    return {"base": unknown_type(toy), "plain": plain, "patterned": patterned, "expected": expected}


def test_a_referee_that_cannot_be_built_says_why_and_the_next_one_judges(models, cli, tmp_path):
    out = tmp_path / "merged"
    code, stdout, stderr = cli("merge", "--base", models["base"], "--adapter", models["plain"], "--out", out,
                               verify=True)  # fmt: skip
    assert code == 0, stderr
    assert "Traceback" not in stdout + stderr and "a bug in converter" not in stderr
    assert "PEFT needs the base's transformers model: transformers cannot read" in stdout  # its own words in it
    assert "referee: published formula" in stdout
    assert "behavioural comparison not run: the behaviour needs the base's transformers model" in stdout
    merged = read_tensors(out)
    for name, want in models["expected"].items():  # the merge itself is right (PEFT's own, in float64)
        torch.testing.assert_close(merged[name], want.float(), rtol=2e-6, atol=1e-7)


def test_no_referee_can_judge_the_output_is_kept_not_verified_exit_5(models, cli, tmp_path):
    out = tmp_path / "merged"
    code, stdout, stderr = cli("merge", "--base", models["base"], "--adapter", models["patterned"], "--out", out,
                               verify=True)  # fmt: skip
    assert code == 5, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: not verified: ")
    assert "no single published scale" in stderr and "--no-verify" in stderr
    assert "Traceback" not in stdout + stderr
    assert (out / "model.safetensors").is_file()  # kept: nothing is wrong with it that anyone found
    report = json.loads((out / "verification.json").read_text())
    assert report["verdict"] == "skipped" and report["tensors"] is None
    assert "**Not verified**" in (out / "README.md").read_text()
    code, _, _ = cli("merge", "--base", models["base"], "--adapter", models["patterned"], "--out", tmp_path / "b")
    assert code == 0  # --no-verify (the fixture's default): the user takes it unproven


def test_the_trace_of_a_referee_that_could_not_be_built_is_behind_verbose(models, cli, tmp_path):
    code, stdout, stderr = cli("-v", "merge", "--base", models["base"], "--adapter", models["patterned"], "--out",
                               tmp_path / "m", verify=True)  # fmt: skip
    assert code == 5
    assert "Traceback" in stderr  # what the library raised, for a bug report


def test_a_push_of_an_unverifiable_merge_pushes_nothing(models, tmp_path):
    hub = HubServer(tmp_path / "hub").start()
    try:
        hub.add_user("alice", ALICE)
        proc = subprocess.run(
            [sys.executable, "-m", "converter", "push", "--repo", "alice/never", "--base", str(models["base"]),
             "--adapter", str(models["patterned"])],
            capture_output=True, text=True, env=client_env(hub, ALICE, tmp_path / "home"), timeout=300,
        )  # fmt: skip
        assert proc.returncode == 5, proc.stderr
        assert "nothing was pushed" in proc.stderr and "Traceback" not in proc.stderr
        assert not hub.exists("alice/never")
    finally:
        hub.stop()


def test_judge_needs_the_tensor_proof_unless_the_behaviour_is_the_proof():
    assert judge(None, ([], []), ("no referee", None), tensors_needed=True).verdict == "skipped"
    assert judge(None, (["mean KL too high"], []), ("no referee", None), tensors_needed=True).verdict == "fail"
    assert judge(None, ([], []), ("a 4-bit output", None), tensors_needed=False).verdict == "pass"
