"""The package as users install it: the built wheel in a fresh venv per extra set (torch==2.13.0 first, the tested
pins as constraints), each running the command its extra is for, against the local Hub:

- base (`pip install converter`): an LLM merge with verification (PEFT referees); a diffusion merge and `batch`
  refuse in one line naming the extra to install, and write nothing;
- `converter[diffusion]`: a kohya SD merge refereed by diffusers' own loader, with pictures;
- `converter[batch]`: `converter batch` runs two jobs on a local Ray cluster.

How the venvs are made cheap: tests/venvs.py. What each costs is written to tests/artifacts/install.json.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from venvs import Venv, record

from converter.app.local import BASE, LORA, LORA_B, MOCK_TOKEN, SD_BASE, SD_LORA
from converter.testing.hub import client_env

OPTIONAL = ("diffusers", "gradio", "ray")


@pytest.fixture(scope="module")
def venvs(tmp_path_factory, wheel, torch_venv):
    """The base install on a copy of the torch venv; [diffusion] and [batch] each add to a copy of the base."""
    root = tmp_path_factory.mktemp("venvs")
    made: list[Venv] = []

    def build(name: str, start: Venv, *requirements) -> Venv:
        venv = start.clone(root / name)
        made.append(venv)
        return record(name, venv, lambda: venv.install(*requirements))

    def extra(name: str) -> Venv:
        venv = build(name, base, f"{wheel}[{name}]")
        # its console script still names the base's python: made anew for this venv
        venv.install(wheel, constraints=False, options=("--no-deps", "--force-reinstall"))
        return venv

    base = build("base", torch_venv, wheel)
    yield {"base": base, "extra": extra}
    for venv in made:
        venv.remove()


def converter(venv: Venv, hub, *args, home: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """The venv's `converter` command, a Hub client of the local Hub, signed in as the demo user."""
    env = client_env(hub, token=MOCK_TOKEN, home=home) | {"TOKENIZERS_PARALLELISM": "false"} | env
    return venv.run("converter", *args, env=env, cwd=cwd)


def test_the_base_install_merges_and_verifies_an_llm_and_names_the_extras_it_lacks(venvs, demo_hub, tmp_path):
    base = venvs["base"]
    base.check()
    installed = base.packages()
    assert "converter" in installed and not [m for m in OPTIONAL if m in installed], sorted(installed)
    run = lambda *args: converter(base, demo_hub, *args, home=tmp_path / "home", cwd=tmp_path)  # noqa: E731

    proc = run("merge", "--base", BASE, "--adapter", LORA, "--adapter", LORA_B, "--weight", "1", "--weight", "0.5",
               "--out", "merged")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr  # converter's own lines only
    report = json.loads((tmp_path / "merged" / "verification.json").read_text())
    assert report["verdict"] == "pass" and "PEFT" in report["reference"], report

    proc = run("merge", "--base", SD_BASE, "--adapter", SD_LORA, "--out", "sd")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        "error: verifying a diffusion merge needs diffusers, which is not installed: "
        "pip install 'converter[diffusion]'\n"
    )
    assert not (tmp_path / "sd").exists()  # refused before anything was written

    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(yaml.safe_dump({"jobs": [{"merge": "demo/never", "base": BASE, "adapter": LORA}]}))
    proc = run("batch", jobs)
    assert proc.returncode == 2
    assert proc.stderr == "error: converter batch needs ray, which is not installed: pip install 'converter[batch]'\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "jobs.yaml", "merged"]  # no state, no report


def test_diffusion_extra_verifies_a_kohya_sd_merge_with_diffusers_and_pictures(venvs, demo_hub, tmp_path):
    venv = venvs["extra"]("diffusion")
    venv.check()
    assert "diffusers" in venv.packages()
    proc = converter(venv, demo_hub, "merge", "--base", SD_BASE, "--adapter", SD_LORA, "--out", "sd",
                     home=tmp_path / "home", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr
    report = json.loads((tmp_path / "sd" / "verification.json").read_text())
    assert report["verdict"] == "pass", report
    assert report["kind"] == "diffusion" and "load_lora_weights" in report["reference"], report["reference"]
    pictures = list((tmp_path / "sd" / "verification").glob("*.png"))
    assert len(pictures) >= 3, pictures  # base, base + LoRA (diffusers), merged


def test_batch_extra_runs_two_jobs_on_a_local_ray_cluster(venvs, demo_hub, tmp_path):
    venv = venvs["extra"]("batch")
    venv.check()
    assert "ray" in venv.packages()
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(yaml.safe_dump({"jobs": [
        {"merge": "demo/install-batch-merged", "base": BASE, "adapter": LORA},
        {"convert": SD_LORA, "to": "peft", "base": SD_BASE},
    ]}))  # fmt: skip
    # Ray's socket paths must fit 107 bytes: its session folder goes under a short temp folder
    with tempfile.TemporaryDirectory(prefix="cvi-ray-", dir="/tmp") as ray_tmp:
        proc = converter(venv, demo_hub, "batch", jobs, "--num-cpus", "2", home=tmp_path / "home", cwd=tmp_path,
                         RAY_TMPDIR=ray_tmp)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 jobs: 2 done, 0 failed, 0 skipped" in jobs.with_suffix(".report.md").read_text()
    assert demo_hub.exists("demo/install-batch-merged")
    assert any(d["isPullRequest"] for d in demo_hub.repo(SD_LORA.rsplit("/", 1)[0]).discussions)
    assert "converter batch" in proc.stdout  # piped: progress as plain lines
