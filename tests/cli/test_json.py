"""`--json`: every verb prints its outcome (converter.outcome) as the one line of stdout, for a success and for every
failure, and exits with the code the outcome derives from its verdict. The tests read the outcome, not the prose."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from model_helpers import make_adapter, make_base

from converter.cli import main
from converter.errors import BadInputError, HubError, NotVerified, UsageError, VerificationFailed
from converter.outcome import (
    NOT_ASKED,
    BehaviourProof,
    Outcome,
    Proofs,
    Published,
    TensorProof,
    Verdict,
    exit_code,
    last_outcome,
)

ALICE = "hf_fake_alice_json_0123456789"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("llama") / "base", "llama")


@pytest.fixture(scope="module")
def lora(llama, tmp_path_factory):
    return make_adapter(llama, tmp_path_factory.mktemp("lora") / "lora", r=4, lora_alpha=8)


def run(capsys, *args) -> Outcome:
    """`converter --json ARGS` in this process: stdout is the outcome alone, and the exit code is the outcome's."""
    capsys.readouterr()
    code = main(["--json", *map(str, args)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    data = json.loads(lines[0])
    outcome = Outcome.from_dict(data)
    assert data["exit_code"] == outcome.exit_code == code and data["version"] == 1
    assert outcome.verb == args[0]
    return outcome


def sabotage(merged: Path, base: Path, name: str) -> None:
    """The adapters' change to `name` negated in the merged folder (as tests/cli/test_errors.py does)."""
    from safetensors.torch import load_file, save_file

    shard = next(merged.glob("*.safetensors"))
    tensors = load_file(shard)
    original = load_file(next(base.glob("*.safetensors")))[name]
    tensors[name] = (2 * original.double() - tensors[name].double()).to(tensors[name].dtype)
    save_file(tensors, shard, metadata={"format": "pt"})


# --- the outcome itself ---------------------------------------------------------------------------------------------


def test_exit_codes_come_from_the_verdict():
    assert [exit_code(v) for v in Verdict] == [0, 3, 5, 2, 1, 130]
    assert exit_code(Verdict.NOT_VERIFIED, proof_asked=False) == 0  # --no-verify, a verb with nothing to prove
    assert exit_code(Verdict.FAILED, verb="batch") == 4  # some jobs failed
    for error, verdict in ((UsageError, Verdict.REFUSED), (BadInputError, Verdict.REFUSED),
                           (VerificationFailed, Verdict.FAILED), (NotVerified, Verdict.NOT_VERIFIED)):  # fmt: skip
        assert error.verdict is verdict and error.exit_code == exit_code(verdict)


def test_an_outcome_round_trips_through_json():
    outcome = Outcome(
        "push", Verdict.PROVEN, files=("a/model.safetensors",),
        published=(Published("me/m", "https://hub/me/m", "abc", None, changed=True),),
        proofs=Proofs(tensors=TensorProof(True, referee="PEFT", tensors=3, changed=2, worst_ratio=0.5, passed=True),
                      behaviour=BehaviourProof(True, metrics={"mean_kl": 1e-7, "perplexity": math.nan})),
    )  # fmt: skip
    text = outcome.to_json()
    assert "\n" not in text and json.loads(text)["proofs"]["behaviour"]["metrics"]["perplexity"] is None  # strict
    back = Outcome.from_json(text)
    assert back.publication == outcome.publication and back.proofs.tensors == outcome.proofs.tensors
    assert back.to_json() == text.replace("NaN", "null")
    newer = dict(json.loads(text), version=2, something_new={"x": 1})
    assert Outcome.from_dict(newer).verdict is Verdict.PROVEN  # later layouts: what this one knows is read
    with pytest.raises(ValueError, match="no outcome"):
        last_outcome("a line of prose\n")


def test_the_outcome_of_an_error_carries_its_data():
    hub = Outcome.failure("push", HubError("me/x: the Hub said 429", repo_id="me/x", status=429, reason="rate-limited"))
    assert hub.verdict is Verdict.REFUSED and hub.exit_code == 2 and hub.error.transient
    assert hub.error.type == "HubError" and hub.error.fields["repo_id"] == "me/x" and hub.error.fields["status"] == 429
    bad = Outcome.failure("merge", BadInputError("x: no", file="x", tensor="t"))
    assert (bad.reason, bad.error.fields, bad.error.transient) == ("x: no", {"file": "x", "tensor": "t"}, False)
    assert Outcome.failure("merge", KeyboardInterrupt()).exit_code == 130
    crash = Outcome.failure("merge", ZeroDivisionError("division by zero"))
    assert crash.verdict is Verdict.CRASHED and crash.exit_code == 1 and crash.error.message == "division by zero"


# --- every verb ----------------------------------------------------------------------------------------------------


def test_inspect(capsys, lora, tmp_path):
    outcome = run(capsys, "inspect", lora)
    assert (outcome.verdict, outcome.proof_asked, outcome.exit_code) == (Verdict.NOT_VERIFIED, False, 0)
    assert outcome.details["kind"] == "adapter" and outcome.details["format"] == "peft"
    capsys.readouterr()
    assert main(["inspect", str(lora), "--json"]) == 0  # after the command too, as inspect always took it
    assert Outcome.from_json(capsys.readouterr().out).details["r"] == 4
    missing = run(capsys, "inspect", tmp_path / "nothing-here")
    assert missing.verdict is Verdict.REFUSED and missing.exit_code == 2 and missing.error is not None


def test_merge(capsys, llama, lora, tmp_path):
    unproven = run(capsys, "merge", "--base", llama, "--adapter", lora, "--out", tmp_path / "a", "--no-verify")
    assert (unproven.verdict, unproven.reason, unproven.exit_code) == (Verdict.NOT_VERIFIED, NOT_ASKED, 0)
    assert str(tmp_path / "a" / "model.safetensors") in unproven.files
    assert all(Path(f).is_file() for f in unproven.files) and unproven.proofs == Proofs()

    proven = run(capsys, "merge", "--base", llama, "--adapter", lora, "--out", tmp_path / "b")
    assert proven.verdict is Verdict.PROVEN and proven.exit_code == 0 and proven.reason == ""
    tensors, behaviour = proven.proofs.tensors, proven.proofs.behaviour
    assert tensors.passed and tensors.referee == "PEFT" and tensors.changed > 0 and 0 <= tensors.worst_ratio <= 1
    assert behaviour.ran and behaviour.passed and behaviour.metrics["mean_kl"] <= behaviour.metrics["limit_mean_kl"]
    assert str(tmp_path / "b" / "verification.json") in proven.files

    dry = run(capsys, "merge", "--base", llama, "--adapter", lora, "--out", tmp_path / "c", "--dry-run")
    assert dry.verdict is Verdict.NOT_VERIFIED and dry.exit_code == 0 and not (tmp_path / "c").exists()

    bigger = make_base(tmp_path / "big", "llama", hidden_size=96)
    other = make_adapter(bigger, tmp_path / "big-lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    refused = run(capsys, "merge", "--base", llama, "--adapter", other, "--out", tmp_path / "d", "--no-verify")
    assert refused.verdict is Verdict.REFUSED and refused.exit_code == 2 and not (tmp_path / "d").exists()
    assert refused.error.type == "BadInputError" and "q_proj" in refused.error.fields["tensor"]


def test_a_usage_error_argparse_finds_is_refused_too(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--json", "merge", "--no-such-option"])
    outcome = Outcome.from_json(capsys.readouterr().out)
    assert caught.value.code == outcome.exit_code == 2 and outcome.verb == "merge"
    assert outcome.verdict is Verdict.REFUSED and "--no-such-option" in outcome.reason


def test_verify_of_a_sabotaged_merge_fails_with_the_tensor_named(capsys, llama, lora, tmp_path):
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(llama), "--adapter", str(lora), "--out", str(out), "--no-verify"]) == 0
    assert run(capsys, "verify", out).verdict is Verdict.PROVEN
    name = "model.layers.0.self_attn.q_proj.weight"
    sabotage(out, llama, name)
    failed = run(capsys, "verify", out)
    assert failed.verdict is Verdict.FAILED and failed.exit_code == 3
    tensors = failed.proofs.tensors
    assert not tensors.passed and tensors.failed == 1 and tensors.worst_tensor == name and tensors.worst_ratio > 1
    assert failed.error.type == "VerificationFailed" and name in failed.reason


def test_a_merge_no_referee_can_judge_is_not_verified_exit_5(capsys, llama, tmp_path):
    from test_verify_unavailable import unknown_type

    toy = tmp_path / "toy"
    toy.mkdir()
    for f in llama.iterdir():
        (toy / f.name).write_bytes(f.read_bytes())
    unknown_type(toy)
    patterned = make_adapter(llama, tmp_path / "patterned", seed=2, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2})  # fmt: skip
    outcome = run(capsys, "merge", "--base", toy, "--adapter", patterned, "--out", tmp_path / "m")
    assert outcome.verdict is Verdict.NOT_VERIFIED and outcome.proof_asked and outcome.exit_code == 5
    assert outcome.proofs.tensors is None or not outcome.proofs.tensors.ran
    assert outcome.proofs.behaviour is not None and not outcome.proofs.behaviour.ran


def test_convert(capsys, llama, lora, tmp_path):
    kohya = run(capsys, "convert", "--adapter", lora, "--to", "kohya", "--out", tmp_path / "k.safetensors",
                "--component", "text_encoder")  # fmt: skip
    assert kohya.verdict is Verdict.PROVEN and kohya.exit_code == 0 and kohya.modules > 0
    assert kohya.files == (str(tmp_path / "k.safetensors"),) and kohya.proofs.conversion.identical == kohya.modules
    back = run(capsys, "convert", "--adapter", tmp_path / "k.safetensors", "--to", "peft", "--out", tmp_path / "p",
               "--base", llama, "--no-verify")  # fmt: skip
    assert back.verdict is Verdict.NOT_VERIFIED and back.reason == NOT_ASKED and back.exit_code == 0
    refused = run(capsys, "convert", "--adapter", lora, "--to", "gguf")
    assert refused.verdict is Verdict.REFUSED and refused.exit_code == 2 and refused.error.type == "UsageError"


def test_extract_resize_combine(capsys, llama, lora, tmp_path):
    resized = run(capsys, "resize", "--adapter", lora, "--rank", "2", "--out", tmp_path / "r")
    assert resized.verdict is Verdict.NOT_VERIFIED and not resized.proof_asked and resized.exit_code == 0
    assert resized.modules > 0 and all(Path(f).exists() for f in resized.files)
    combined = run(capsys, "combine", "--adapter", lora, "--adapter", lora, "--out", tmp_path / "c")
    assert combined.exit_code == 0 and combined.modules == resized.modules
    tuned = make_base(tmp_path / "tuned", "llama", seed=3)
    extracted = run(capsys, "extract", "--base", llama, "--tuned", tuned, "--rank", "2", "--out", tmp_path / "e")
    assert extracted.exit_code == 0 and extracted.modules and extracted.out == str(tmp_path / "e")
    bad = {
        "resize": ["--adapter", lora, "--rank", "0"],
        "combine": ["--adapter", lora, "--method", "ties"],  # ties needs --density
        "extract": ["--base", llama, "--tuned", tmp_path / "none", "--rank", "2"],
    }
    for verb, args in bad.items():
        refused = run(capsys, verb, *args, "--out", tmp_path / f"bad-{verb}")
        assert refused.verdict is Verdict.REFUSED and refused.exit_code == 2, refused


def test_gguf(capsys, tmp_path, monkeypatch):
    from test_gguf import tiny

    from converter.gguf import arch

    model = tiny(tmp_path / "tiny", "llama")
    proven = run(capsys, "gguf", model, "--type", "F32", "--out", tmp_path / "g")
    assert proven.verdict is Verdict.PROVEN and proven.exit_code == 0
    (file,) = proven.proofs.gguf
    assert file.passed and file.type == "F32" and file.parts["tensors"] == "ok"
    assert str(tmp_path / "g" / "tiny-F32.gguf") in proven.files
    refused = run(capsys, "gguf", model, "--type", "Q3_X", "--out", tmp_path / "h")
    assert refused.verdict is Verdict.REFUSED and refused.exit_code == 2
    monkeypatch.setattr(arch, "permute", lambda w, n: w)  # the writer forgets to reorder Q/K rows
    failed = run(capsys, "gguf", model, "--type", "F32", "--out", tmp_path / "sabotaged")
    assert failed.verdict is Verdict.FAILED and failed.exit_code == 3
    (file,) = failed.proofs.gguf
    assert not file.passed and file.parts["tensors"] == "FAILED"


def test_demo(capsys, tmp_path):
    outcome = run(capsys, "demo", "--dir", tmp_path / "demo")
    assert outcome.verdict is Verdict.PROVEN and outcome.proofs.tensors.passed and outcome.proofs.behaviour.passed
    assert outcome.out == str(tmp_path / "demo" / "merged")


def test_batch_and_space_refusals(capsys, tmp_path):
    pytest.importorskip("ray")
    (tmp_path / "jobs.yaml").write_text("jobs: []")
    batch = run(capsys, "batch", tmp_path / "jobs.yaml")
    assert batch.verdict is Verdict.REFUSED and batch.exit_code == 2 and batch.error.type == "RecipeError"
    space = run(capsys, "space", "deploy", "--repo", "not a repo id")
    assert space.verdict is Verdict.REFUSED and space.exit_code == 2 and space.verb == "space"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, llama, lora):
    from converter.testing.hub import HubServer

    server = HubServer(tmp_path_factory.mktemp("hub") / "server").start()
    server.add_user("alice", ALICE)
    server.seed_folder("alice/base", llama)
    server.seed_folder("alice/lora", lora)
    yield server
    server.stop()


def hub_run(hub, *args) -> Outcome:
    """The CLI against the local Hub, in a subprocess (huggingface_hub reads HF_ENDPOINT when it is imported)."""
    from converter.testing.hub import client_env

    env = client_env(hub, ALICE) | {"CONVERTER_HUB_RETRIES": "1"}
    command = [sys.executable, "-m", "converter", "--json", *map(str, args)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert len(proc.stdout.splitlines()) == 1, proc.stdout + proc.stderr
    outcome = last_outcome(proc.stdout)
    assert outcome.exit_code == proc.returncode, proc.stderr
    return outcome


def test_push(hub, llama, lora, tmp_path):
    pushed = hub_run(hub, "push", "--repo", "alice/merged", "--base", "alice/base", "--adapter", "alice/lora")
    assert pushed.verdict is Verdict.PROVEN and pushed.exit_code == 0 and pushed.proofs.tensors.passed
    (commit,) = pushed.published
    assert commit.repo_id == "alice/merged" and commit.changed and commit.url == f"{hub.url}/alice/merged"
    assert commit.commit == hub.head("alice/merged") and commit.pr_url is None

    folder = tmp_path / "m"
    assert main(["merge", "--base", str(llama), "--adapter", str(lora), "--out", str(folder), "--no-verify"]) == 0
    first = hub_run(hub, "push", "--repo", "alice/from-folder", "--from", folder, "--no-verify")
    again = hub_run(hub, "push", "--repo", "alice/from-folder", "--from", folder, "--no-verify")
    assert first.reason == again.reason == NOT_ASKED and first.publication.changed
    assert not again.publication.changed and again.publication.commit == first.publication.commit
    other = tmp_path / "half"
    assert main(["merge", "--base", str(llama), "--adapter", str(lora), "--weight", "0.5", "--out", str(other),
                 "--no-verify"]) == 0  # fmt: skip
    pr = hub_run(hub, "push", "--repo", "alice/from-folder", "--from", other, "--no-verify", "--create-pr")
    assert pr.publication.pr_url.startswith(f"{hub.url}/alice/from-folder/discussions/")
    assert pr.publication.changed and not pr.publication.pr_updated
    updated = hub_run(hub, "push", "--repo", "alice/from-folder", "--from", folder, "--no-verify", "--create-pr")
    assert updated.publication.pr_updated and updated.publication.pr_url == pr.publication.pr_url

    refused = hub_run(hub, "push", "--repo", "bob/not-mine", "--from", folder, "--no-verify")
    assert refused.verdict is Verdict.REFUSED and refused.error.type == "PushError"
    assert refused.error.fields["repo_id"] == "bob/not-mine" and not refused.error.transient
    hub.inject("GET", r"^/api/whoami", status=503, times=10)
    try:
        down = hub_run(hub, "push", "--repo", "alice/down", "--from", folder, "--no-verify")
    finally:
        hub.clear_faults()
    assert down.verdict is Verdict.REFUSED and down.error.transient and down.error.fields["status"] == 503
