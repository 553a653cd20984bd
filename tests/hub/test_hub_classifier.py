"""`converter push` of a reward model made from a causal LM on the Hub (the real huggingface_hub client against
the local Hub server, the CLI in subprocesses): the plan says it writes the classifier and compares it loaded
whole; the push proves each shard (the head the base lacks included), compares PEFT's unmerged classifier after
the merge, and publishes the classifier, its card loading it with its Auto class."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from model_helpers import make_base, make_classifier_adapter

from converter.outcome import last_outcome
from converter.testing.hub import HubServer, client_env, run_client

ALICE = "hf_fake_alice_0123456789"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    server = HubServer(root / "server").start()
    server.add_user("alice", ALICE)
    base = make_base(root / "base", "llama", dtype=torch.bfloat16, pad_token_id=None)
    server.seed_folder("alice/tiny-llama", base)
    server.seed_folder("alice/tiny-reward", make_classifier_adapter(base, root / "reward", "SEQ_CLS", 1, r=4))
    yield server
    server.stop()


def cli(hub: HubServer, *args):
    proc = subprocess.run([sys.executable, "-m", "converter", "--json", *map(str, args)], capture_output=True,
                          text=True, env=client_env(hub, ALICE), timeout=300)  # fmt: skip
    return proc.returncode, last_outcome(proc.stdout), proc.stderr


SOURCES = ("--base", "alice/tiny-llama", "--adapter", "alice/tiny-reward")


def test_the_push_plan_compares_the_classifier_whole(hub):
    code, outcome, err = cli(hub, "push", "--repo", "alice/reward", *SOURCES, "--dry-run")
    assert code == 0, err
    assert outcome.details["fit"]["here"]["streamed"] is False
    assert "SEQ_CLS" in outcome.details["fit"]["shape"]["cannot_stream"]
    assert not hub.exists("alice/reward")


def test_a_reward_model_is_pushed_proven(hub, tmp_path):
    code, outcome, err = cli(hub, "push", "--repo", "alice/reward", *SOURCES)
    assert code == 0, err
    assert outcome.proofs.tensors.passed and outcome.proofs.behaviour.passed
    pushed = tmp_path / "pushed"
    run_client(hub, f"from huggingface_hub import snapshot_download; "
                    f"snapshot_download('alice/reward', local_dir={str(pushed)!r})", token=ALICE)  # fmt: skip
    report = json.loads((pushed / "verification.json").read_text())
    assert report["verdict"] == "pass" and report["tensors"]["referee"]["name"] == "PEFT"
    assert report["tensors"]["added"] == ["score.weight"] and report["tensors"]["dropped"] == ["lm_head.weight"]
    assert "LlamaForSequenceClassification" in report["reference"]
    config = json.loads((pushed / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    assert config["pad_token_id"] == config["eos_token_id"]
    provenance = json.loads((pushed / "converter_provenance.json").read_text())
    assert provenance["task_head"]["dropped"] == ["lm_head.weight"]
    assert "AutoModelForSequenceClassification.from_pretrained(" in (pushed / "README.md").read_text()
    from transformers import AutoModelForSequenceClassification

    _, info = AutoModelForSequenceClassification.from_pretrained(pushed, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
