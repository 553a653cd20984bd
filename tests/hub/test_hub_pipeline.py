"""Pull from the Hub, merge, card, push: the real huggingface_hub client against the local Hub server.

The CLI runs in subprocesses (huggingface_hub reads HF_ENDPOINT at import time; this process is offline).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from model_helpers import make_adapter, make_base, read_tensors, run_cli

from converter.outcome import last_outcome
from converter.testing.hub import HubServer, client_env, run_client

ALICE, BOB = "hf_fake_alice_0123456789", "hf_fake_bob_0123456789"
BASE_CARD = """---
license: other
license_name: tiny-license
license_link: https://example.com/tiny-license
language: [en, fr]
pipeline_tag: text-generation
library_name: transformers
tags: [tiny, base_model:finetune:someone/else]
---
# Tiny base
"""
ADAPTER_CARD = """---
library_name: peft
base_model: alice/tiny-llama
datasets: [alice/pirate-talk]
tags: [lora, base_model:adapter:alice/tiny-llama]
---
# A pirate LoRA
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    server = HubServer(root / "server").start()
    server.add_user("alice", ALICE)
    server.add_user("bob", BOB)
    local = root / "local"
    base = make_base(local / "base", "llama", dtype=torch.bfloat16)
    (base / "README.md").write_text(BASE_CARD)
    lora = make_adapter(base, local / "lora", r=4, lora_alpha=8)
    (lora / "README.md").write_text(ADAPTER_CARD)
    (base / "model.gguf").write_bytes(b"GGUF not needed")  # must never be downloaded
    server.seed_folder("alice/tiny-llama", base)
    server.seed_folder("alice/tiny-lora", lora)
    # A repo holding an adapter in a subfolder, with two versions of it.
    server.seed_folder("alice/loras", lora, revision="main")
    server.commit_files("alice/loras", {f"pirate/{p.name}": p for p in lora.iterdir()}, "add pirate/")
    first = server.head("alice/loras")
    lora2 = make_adapter(base, local / "lora2", seed=7, r=4, lora_alpha=8)
    server.commit_files("alice/loras", {f"pirate/{p.name}": p for p in lora2.iterdir()}, "retrain pirate/")
    server.create_repo("alice/secret-lora", private=True)
    server.seed_folder("alice/secret-lora", lora)
    server.create_repo("alice/gated-base", gated="auto")
    server.seed_folder("alice/gated-base", base)
    server.local = {"base": base, "lora": lora, "lora2": lora2, "first": first}
    yield server
    server.stop()


def cli(hub: HubServer, *args, token: str | None = ALICE, home: Path | None = None):
    proc = subprocess.run(
        [sys.executable, "-m", "converter", *map(str, args)],
        capture_output=True,
        text=True,
        env=client_env(hub, token, home) | {"CONVERTER_HUB_RETRIES": "3"},
        timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


def download(hub: HubServer, repo_id: str, dest: Path, token: str = ALICE, revision: str = "main") -> Path:
    run_client(
        hub,
        f"from huggingface_hub import snapshot_download; "
        f"snapshot_download({repo_id!r}, revision={revision!r}, local_dir={str(dest)!r})",
        token=token,
    )
    return dest


def test_push_end_to_end(hub, tmp_path):
    hub.reset_log()
    code, out, err = cli(
        hub,
        "push",
        "--repo",
        "alice/pirate-llama",
        "--base",
        "alice/tiny-llama",
        "--adapter",
        "alice/tiny-lora",
        "--weight",
        "0.5",
        token=ALICE,
    )
    assert code == 0, err
    assert f"pushed: {hub.url}/alice/pirate-llama/commit/" in out
    assert ALICE not in out + err
    assert hub.requests.count(("GET", "/api/whoami-v2")) == 1  # the token checked once, before the merge
    pushed = download(hub, "alice/pirate-llama", tmp_path / "pushed")
    # Same bytes as a local merge of the same inputs.
    assert (
        run_cli(
            "merge",
            "--base",
            hub.local["base"],
            "--adapter",
            hub.local["lora"],
            "--weight",
            "0.5",
            "--out",
            tmp_path / "local",
            "--no-verify",
        )
        == 0
    )
    ours, local = read_tensors(pushed), read_tensors(tmp_path / "local")
    assert ours.keys() == local.keys() and all(torch.equal(ours[k], local[k]) for k in ours)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(pushed)  # loads as a normal model
    from huggingface_hub import ModelCard

    card = ModelCard.load(pushed / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "alice/tiny-llama" and data["base_model_relation"] == "finetune"
    assert data["license"] == "other" and data["license_name"] == "tiny-license"
    assert data["license_link"] == "https://example.com/tiny-license"
    assert data["language"] == ["en", "fr"] and data["pipeline_tag"] == "text-generation"
    assert data["library_name"] == "transformers" and data["datasets"] == ["alice/pirate-talk"]
    assert {"lora", "merged", "converter", "tiny"} <= set(data["tags"])
    assert not any(t.startswith("base_model:") for t in data["tags"])
    lora_sha = hub.head("alice/tiny-lora")
    assert f"alice/tiny-lora@{lora_sha}" in card.text and "| 0.5 |" in card.text
    assert (
        'from_pretrained("alice/pirate-llama")' in card.text and "**Passed**" in card.text
    )  # push verified before uploading
    recipe = yaml.safe_load((pushed / "converter_recipe.yaml").read_text())
    assert recipe["base"] == f"alice/tiny-llama@{hub.head('alice/tiny-llama')}"
    assert recipe["adapters"][0]["source"] == f"alice/tiny-lora@{lora_sha}"
    everything = "".join(p.read_text(errors="replace") for p in pushed.rglob("*") if p.is_file())
    assert ALICE not in everything and "/tmp/" not in card.text and str(tmp_path) not in everything
    assert "model.gguf" not in {f for f in hub.files("alice/pirate-llama")}

    # Pushing the same thing again: no new commit, also where the repo's report is an older one that stored its
    # Markdown beside the facts.
    published = json.loads(hub.read_file("alice/pirate-llama", "verification.json"))
    assert "markdown" not in published
    older = (json.dumps({**published, "markdown": "**Passed** (two proofs)."}, indent=2) + "\n").encode()
    hub.commit_files("alice/pirate-llama", {"verification.json": older}, "as an older converter wrote it")
    commits = len(hub.history("alice/pirate-llama"))
    code, out, err = cli(
        hub,
        "push",
        "--repo",
        "alice/pirate-llama",
        "--base",
        "alice/tiny-llama",
        "--adapter",
        "alice/tiny-lora",
        "--weight",
        "0.5",
    )
    assert code == 0, err
    assert "nothing changed" in out and len(hub.history("alice/pirate-llama")) == commits
    # Something else into the same repo: refused without --overwrite / --create-pr ...
    code, _, err = cli(
        hub, "push", "--repo", "alice/pirate-llama", "--base", "alice/tiny-llama", "--adapter", "alice/tiny-lora"
    )
    assert code == 2 and "--create-pr" in err and len(hub.history("alice/pirate-llama")) == commits
    # ... and a pull request from someone else, reused on the next run.
    for _ in range(2):
        code, out, err = cli(
            hub,
            "push",
            "--repo",
            "alice/pirate-llama",
            "--base",
            "alice/tiny-llama",
            "--adapter",
            "alice/tiny-lora",
            "--create-pr",
            token=BOB,
        )
        assert code == 0, err
        assert f"pull request: {hub.url}/alice/pirate-llama/discussions/1" in out
    assert len(hub.history("alice/pirate-llama")) == commits


def test_revision_pin_and_file_inside_repo(hub, tmp_path):
    first = hub.local["first"]
    code, out, err = cli(
        hub,
        "merge",
        "--base",
        "alice/tiny-llama",
        "--adapter",
        f"alice/loras@{first}/pirate/adapter_model.safetensors",
        "--out",
        tmp_path / "old",
    )
    assert code == 0, err
    code, _, err = cli(
        hub,
        "merge",
        "--base",
        "alice/tiny-llama",
        "--adapter",
        "alice/loras/pirate/adapter_model.safetensors",
        "--out",
        tmp_path / "new",
    )
    assert code == 0, err
    for name, lora in (("old", hub.local["lora"]), ("new", hub.local["lora2"])):
        assert (
            run_cli(
                "merge",
                "--base",
                hub.local["base"],
                "--adapter",
                lora,
                "--out",
                tmp_path / f"ref-{name}",
                "--no-verify",
            )
            == 0
        )
        a, b = read_tensors(tmp_path / name), read_tensors(tmp_path / f"ref-{name}")
        assert all(torch.equal(a[k], b[k]) for k in a)
    recipe = yaml.safe_load((tmp_path / "new" / "converter_recipe.yaml").read_text())
    assert recipe["adapters"][0]["source"] == f"alice/loras@{hub.head('alice/loras')}/pirate/adapter_model.safetensors"


def test_second_run_downloads_nothing(hub, tmp_path):
    home = tmp_path / "hf-home"
    args = ("merge", "--base", "alice/tiny-llama", "--adapter", "alice/tiny-lora")
    assert cli(hub, *args, "--out", tmp_path / "a", home=home)[0] == 0
    downloads = [s for s in hub.seen if "/resolve/" in s.path and s.method == "GET"]
    assert downloads and not any("gguf" in s.path for s in downloads)
    hub.reset_log()
    code, _, err = cli(hub, *args, "--out", tmp_path / "b", home=home)
    assert code == 0, err
    assert not [s for s in hub.seen if "/resolve/" in s.path and s.method == "GET"]


def test_private_and_gated_sources(hub, tmp_path):
    args = ("merge", "--base", "alice/tiny-llama", "--adapter", "alice/secret-lora", "--out", tmp_path / "m")
    code, _, err = cli(hub, *args, token=None)
    assert code == 2 and "alice/secret-lora@main: repo not found" in err and "--token" in err
    code, _, err = cli(hub, *args, token=BOB)
    assert code == 2 and "repo not found" in err
    code, _, err = cli(hub, *args, token=ALICE)
    assert code == 0, err
    code, _, err = cli(
        hub, "merge", "--base", "alice/gated-base", "--adapter", "alice/tiny-lora", "--out", tmp_path / "g", token=BOB
    )
    assert code == 2 and "gated" in err and "request access" in err
    hub.grant_access("alice/gated-base", "bob")
    assert (
        cli(
            hub,
            "merge",
            "--base",
            "alice/gated-base",
            "--adapter",
            "alice/tiny-lora",
            "--out",
            tmp_path / "g",
            token=BOB,
        )[0]
        == 0
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--base", "alice/no-such-model", "--adapter", "alice/tiny-lora"], "alice/no-such-model@main: repo not found"),
        (["--base", "alice/tiny-llama@v9", "--adapter", "alice/tiny-lora"], "revision not found"),
        (
            ["--base", "alice/tiny-llama", "--adapter", "alice/loras/nope.safetensors"],
            "file nope.safetensors not found",
        ),
        (["--base", "alice/tiny-lora", "--adapter", "alice/tiny-lora"], "not a model repo: no config.json"),
        (["--base", "alice/tiny-llama", "--adapter", "alice/tiny-llama"], "no adapter_config.json"),
    ],
)
def test_source_errors(args, message, hub, tmp_path):
    code, out, err = cli(hub, "merge", *args, "--out", tmp_path / "m")
    assert code == 2, out + err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()


def test_push_errors_leave_nothing(hub, tmp_path):
    code, _, err = cli(
        hub, "push", "--repo", "not a repo", "--base", "alice/tiny-llama", "--adapter", "alice/tiny-lora"
    )
    assert code == 2 and "not a valid repo id" in err
    code, _, err = cli(
        hub,
        "push",
        "--repo",
        "alice/x",
        "--base",
        "alice/tiny-llama",
        "--adapter",
        "alice/tiny-lora",
        token="hf_fake_wrong_token_000",
    )
    assert code == 2 and "token was refused" in err and not hub.exists("alice/x")
    code, out, err = cli(
        hub,
        "push",
        "--repo",
        "alice/bob-cannot",
        "--base",
        "alice/tiny-llama",
        "--adapter",
        "alice/tiny-lora",
        token=BOB,
    )
    # refused before the merge (which a 403 at the upload used to follow), with what to do instead
    assert code == 2 and not hub.exists("alice/bob-cannot") and "merging" not in out, out + err
    assert err == ("error: alice/bob-cannot: you (bob) cannot write under 'alice'; use bob/NAME or one of your "
                   "organizations, or open a pull request\n")  # fmt: skip
    hub.add_token("alice", "hf_fake_alice_read_0000", role="read")
    code, out, err = cli(hub, "push", "--repo", "alice/x", "--base", "alice/tiny-llama", "--adapter", "alice/tiny-lora",
                         token="hf_fake_alice_read_0000")  # fmt: skip
    assert code == 2 and "token is read-only" in err and "merging" not in out and not hub.exists("alice/x"), out + err
    # The commit fails for good: the repo this run created is removed again.
    hub.inject("POST", r"/commit/", status=500, times=10)
    code, _, err = cli(
        hub, "push", "--repo", "alice/failing", "--base", "alice/tiny-llama", "--adapter", "alice/tiny-lora"
    )
    hub.clear_faults()
    assert code == 2 and "Hub error 500" in err and not hub.exists("alice/failing")
    # A merge that fails creates no repo at all.
    code, _, err = cli(
        hub, "push", "--repo", "alice/never", "--base", "alice/tiny-llama", "--adapter", "alice/tiny-llama"
    )
    assert code == 2 and not hub.exists("alice/never")


def test_transient_failures_are_retried(hub, tmp_path):
    hub.inject("GET", r"^/api/models/alice/tiny-llama", status=503, times=2)
    hub.inject("GET", r"^/api/models/alice/tiny-lora", status=429, retry_after=1)
    hub.inject("GET", r"^/api/models/alice/tiny-lora", drop_connection=True)
    hub.inject("POST", r"/commit/", status=502)
    code, out, err = cli(
        hub, "push", "--repo", "alice/flaky", "--base", "alice/tiny-llama", "--adapter", "alice/tiny-lora", "--private"
    )
    hub.clear_faults()
    assert code == 0, err
    assert hub.repo("alice/flaky").private and "model.safetensors" in hub.files("alice/flaky")


def test_push_from_folder(hub, tmp_path):
    assert run_cli("merge", "--base", hub.local["base"], "--adapter", hub.local["lora"], "--out", tmp_path / "m") == 0
    hub.reset_log()
    code, out, err = cli(hub, "push", "--repo", "alice/from-folder", "--from", tmp_path / "m")
    assert code == 0, err
    assert hub.requests.count(("GET", "/api/whoami-v2")) == 1
    files = hub.files("alice/from-folder")
    assert {"model.safetensors", "config.json", "README.md", "converter_provenance.json"} <= set(files)
    card = hub.read_file("alice/from-folder", "README.md").decode()
    assert 'from_pretrained("alice/from-folder")' in card and str(tmp_path) not in card
    provenance = json.loads(hub.read_file("alice/from-folder", "converter_provenance.json"))
    assert provenance["adapters"][0]["coverage"]["unmatched"] == 0
    assert provenance["adapters"][0]["source"] == "local: lora"
    published = b"".join(hub.read_file("alice/from-folder", f) for f in files)
    assert str(tmp_path).encode() not in published and str(hub.local["base"]).encode() not in published
    # Re-pushing the same folder (its public records included) makes no new commit.
    commits = len(hub.history("alice/from-folder"))
    code, out, err = cli(hub, "--json", "push", "--repo", "alice/from-folder", "--from", tmp_path / "m")
    pushed = last_outcome(out).publication
    assert code == 0 and not pushed.changed and pushed.commit == hub.head("alice/from-folder"), out + err
    assert len(hub.history("alice/from-folder")) == commits


def test_inspect_hub_ids(hub):
    code, out, err = cli(hub, "inspect", "alice/tiny-llama", "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    local = read_tensors(hub.local["base"])
    assert info["path"] == f"alice/tiny-llama@{hub.head('alice/tiny-llama')}"
    assert info["parameters"] == sum(t.numel() for t in local.values()) and info["tensors"] == len(local)
    assert info["architecture"] == "LlamaForCausalLM" and info["tensor_dtypes"] == {"BF16": info["parameters"]}
    hub.reset_log()
    code, out, err = cli(hub, "inspect", "alice/tiny-lora", "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    assert info["kind"] == "adapter" and info["r"] == 4 and info["path"].startswith("alice/tiny-lora@")


def test_overwrite_replaces_files_in_one_commit(hub, tmp_path):
    hub.create_repo("alice/replace-me")
    hub.commit_files(
        "alice/replace-me",
        {"config.json": b"{}", "model-00001-of-00002.safetensors": b"old", "notes.txt": b"keep?"},
        "an older model",
    )
    before = len(hub.history("alice/replace-me"))
    args = (
        "push",
        "--repo",
        "alice/replace-me",
        "--base",
        "alice/tiny-llama",
        "--adapter",
        "alice/tiny-lora",
        "--no-verify",
    )
    code, _, err = cli(hub, *args, token=None)  # no HF_TOKEN: only --token below may authenticate
    assert code == 2 and "no Hugging Face token" in err
    code, out, err = cli(hub, *args, "--overwrite", "--token", ALICE, token=None)
    assert code == 0, err
    files = set(hub.files("alice/replace-me"))
    assert "model.safetensors" in files and "model-00001-of-00002.safetensors" not in files
    assert "notes.txt" not in files and len(hub.history("alice/replace-me")) == before + 1
    assert ALICE not in out + err


def test_disk_space_is_checked_before_downloading(monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    from converter.errors import ConverterError
    from converter.hub.sources import check_disk

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda _p: usage(10**12, 10**12 - 5 * 10**8, 5 * 10**8))
    check_disk("org/model@main", 4 * 10**8)
    with pytest.raises(ConverterError, match=r"needs 2.00 GB .* 500.00 MB free .*1.50 GB missing"):
        check_disk("org/model@main", 2 * 10**9)


def test_failed_verification_uploads_nothing(hub, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "m"
    assert (
        run_cli("merge", "--base", hub.local["base"], "--adapter", hub.local["lora"], "--out", out, "--no-verify") == 0
    )
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] += 0.5  # a broken merge
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    code, stdout, err = cli(hub, "push", "--repo", "alice/broken", "--from", out)
    assert code == 3 and "verification failed" in err and "model.layers.0.mlp.up_proj" in err
    assert not hub.exists("alice/broken")
