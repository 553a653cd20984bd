"""`converter convert --push-pr` against the local Hub server (the real huggingface_hub client in subprocesses):
one PR on the adapter's own repo with the converted files, reused on a second run, none where the format exists."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from convert_helpers import assert_same_deltas, deltas
from diffusion_helpers import TE_TARGETS, kohya_lora, kohya_modules, save, tiny_clip

from converter.testing.hub import HubServer, client_env

ALICE, BOB = "hf_fake_alice_0123456789", "hf_fake_bob_0123456789"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert-hub")
    server = HubServer(root / "server").start()
    server.add_user("alice", ALICE)
    server.add_user("bob", BOB)
    clip = tiny_clip(24)
    clip.save_pretrained(root / "clip")
    lora = kohya_lora(kohya_modules(clip, "lora_te", TE_TARGETS), rank=3, alpha=1.5)
    src = save(lora, root / "kohya" / "style.safetensors")
    (root / "kohya" / "README.md").write_text("# A style LoRA\n")
    server.seed_folder("alice/style-lora", root / "kohya")
    server.local = {"clip": root / "clip", "src": src}
    yield server
    server.stop()


def cli(hub: HubServer, *args, token: str = BOB):
    proc = subprocess.run(
        [sys.executable, "-m", "converter", *map(str, args)],
        capture_output=True,
        text=True,
        env=client_env(hub, token) | {"CONVERTER_HUB_RETRIES": "2"},
        timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_push_pr_opens_one_pr_reuses_it_and_skips_repos_that_have_the_format(hub, tmp_path):
    args = ("convert", "--adapter", "alice/style-lora/style.safetensors", "--to", "diffusers", "--push-pr",
            "--base", hub.local["clip"], "--component", "text_encoder")  # fmt: skip
    code, out, err = cli(hub, *args)
    assert code == 0, err
    assert f"pull request: {hub.url}/alice/style-lora/discussions/1" in out
    assert BOB not in out + err
    (pr,) = hub.repo("alice/style-lora").discussions
    assert (
        pr["isPullRequest"]
        and pr["author"] == "bob"
        and pr["title"] == "Add a diffusers version of this adapter (converter)"
    )
    description = pr["events"][0]["data"]["latest"]["raw"]
    assert "alice/style-lora/style.safetensors" in description and "alpha_pattern" in description
    files = hub.files("alice/style-lora", revision="refs/pr/1")
    assert set(files) >= {"style.safetensors", "README.md", "pytorch_lora_weights.safetensors"}
    assert "pytorch_lora_weights.safetensors" not in hub.files("alice/style-lora")  # main untouched
    converted = tmp_path / "pr" / "pytorch_lora_weights.safetensors"
    converted.parent.mkdir()
    converted.write_bytes(hub.read_file("alice/style-lora", "pytorch_lora_weights.safetensors", revision="refs/pr/1"))
    assert_same_deltas(deltas(converted, hub.local["clip"]), deltas(hub.local["src"], hub.local["clip"]))

    code, out, err = cli(hub, *args)  # a re-run updates our open PR instead of opening another
    assert code == 0, err
    assert "updating our open pull request #1" in out and "/discussions/1" in out
    assert len(hub.repo("alice/style-lora").discussions) == 1

    hub.seed_folder("alice/has-diffusers", converted.parent)  # already in the target format: no PR
    hub.commit_files("alice/has-diffusers", {"style.safetensors": hub.local["src"]}, "kohya too")
    code, out, err = cli(hub, "convert", "--adapter", "alice/has-diffusers/style.safetensors", "--to", "diffusers",
                         "--push-pr", "--base", hub.local["clip"], "--component", "text_encoder")  # fmt: skip
    assert code == 0, err
    assert "already has a diffusers version (pytorch_lora_weights.safetensors)" in out
    assert hub.repo("alice/has-diffusers").discussions == []

    code, _, err = cli(hub, "convert", "--adapter", hub.local["src"], "--to", "diffusers", "--push-pr")
    assert code == 2 and "Hub id" in err


def test_hub_base_is_read_from_headers_only(hub, tmp_path, capsys):
    """`--base org/name` (a diffusers pipeline repo) gives the same names as the local folder, and downloads
    configs and safetensors headers only: no weights file lands in the HF cache. `inspect` of the repo agrees with
    `inspect` of the folder."""
    from diffusion_helpers import make_pipeline
    from safetensors.torch import load_file
    from test_convert import sd15_kohya

    from converter.cli import main

    models = make_pipeline(tmp_path / "sd15", "sd15")
    hub.seed_folder("alice/tiny-sd15", tmp_path / "sd15")
    src = save(sd15_kohya(models), tmp_path / "lora.safetensors")
    home = tmp_path / "home"
    proc = subprocess.run(
        [sys.executable, "-m", "converter", "convert", "--adapter", str(src), "--to", "diffusers",
         "--out", str(tmp_path / "via-hub"), "--base", "alice/tiny-sd15"],
        capture_output=True, text=True, env=client_env(hub, BOB, home), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    args = ["convert", "--adapter", str(src), "--to", "diffusers", "--out", str(tmp_path / "local")]
    assert main([*args, "--base", str(tmp_path / "sd15")]) == 0
    name = "pytorch_lora_weights.safetensors"
    a, b = load_file(tmp_path / "via-hub" / name), load_file(tmp_path / "local" / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cached = [p.name for p in home.rglob("*") if p.is_file() or p.is_symlink()]
    assert "model_index.json" in cached and "config.json" in cached
    assert not [n for n in cached if n.endswith(".safetensors")], cached

    # `inspect` reads a Hub pipeline the same way (headers only) and describes it as it describes the folder
    code, out, err = cli(hub, "inspect", "alice/tiny-sd15", "--json")
    assert code == 0, err
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "sd15"), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)["details"]
    remote = json.loads(out)["details"]
    assert remote.pop("path") == f"alice/tiny-sd15@{hub.head('alice/tiny-sd15')}"
    assert {**local, "path": None} == {**remote, "path": None} and local["parameters"] > 0
