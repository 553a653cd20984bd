"""The Space as deployed: `converter space deploy` to the local Hub, the Space's files downloaded from there, a venv
built the way a Space builds one (gradio[oauth] at README.md's sdk_version, plus requirements.txt; torch==2.13.0
first and the tested pins as constraints, as everywhere here), and app.py served from those files alone. Two jobs
complete through Gradio's API, signed in with Gradio's local login mock: an LLM merge refereed by PEFT, and a kohya
SD merge refereed by diffusers' own loader, with pictures.

What the venv costs is written to tests/artifacts/install.json (tests/venvs.py says why it is cheap).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from venvs import record

from converter.app.local import BASE, LORA, MOCK_TOKEN, SD_BASE, SD_LORA
from converter.testing.hub import client_env

SPACE = "demo/converter-space"
JOB_TIMEOUT = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployed(demo_hub, tmp_path_factory) -> Path:
    """The Space's files, as the Hub holds them after `converter space deploy`."""
    root = tmp_path_factory.mktemp("space")
    env = client_env(demo_hub, token=MOCK_TOKEN, home=root / "home")
    proc = subprocess.run([sys.executable, "-m", "converter", "space", "deploy", "--repo", SPACE], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = root / "files"
    for name in demo_hub.files(SPACE, repo_type="space"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(demo_hub.read_file(SPACE, name, repo_type="space"))
    return folder


@pytest.fixture(scope="module")
def space_venv(deployed, torch_venv, tmp_path_factory):
    config = yaml.safe_load((deployed / "README.md").read_text().split("---")[1])
    assert config["sdk"] == "gradio" and config["hf_oauth"] is True
    venv = torch_venv.clone(tmp_path_factory.mktemp("space-venv") / "venv")
    record("space", venv, lambda: venv.install("-r", deployed / "requirements.txt",
                                               f"gradio[oauth]=={config['sdk_version']}"))  # fmt: skip
    yield venv
    venv.remove()


@pytest.fixture(scope="module")
def app(deployed, space_venv, demo_hub, tmp_path_factory):
    """app.py from the deployed files, in the Space's venv, against the local Hub; yields its URL."""
    root = tmp_path_factory.mktemp("space-run")
    port = _free_port()
    env = client_env(demo_hub, token=MOCK_TOKEN, home=root / "home") | {
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "CONVERTER_APP_WORKDIR": str(root / "jobs"),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # nothing was compiled at install (tests/venvs.py)
    log_path = root / "app.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(space_venv.python), "app.py"], cwd=deployed, env=env, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the app exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the app did not start in 300 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield url, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _signed_in_client(url: str):
    from gradio_client import Client

    with httpx.Client(follow_redirects=True, timeout=60) as http:  # Gradio's local login mock, as a browser
        http.get(f"{url}/login/huggingface")
        cookie = next(c.value for c in http.cookies.jar if c.name == "session")
    return Client(url, verbose=False, headers={"Cookie": f"session={cookie}"}, download_files=False,
                  analytics_enabled=False)  # fmt: skip


def test_the_space_venv_is_the_deployed_requirements(space_venv, deployed):
    space_venv.check()
    installed = space_venv.packages()
    assert "converter" not in installed  # the Space runs the deployed package folder, nothing installed
    assert {"diffusers", "gradio", "peft", "transformers", "torch"} <= set(installed)
    assert (deployed / "converter" / "keymaps").is_dir() and not (deployed / "converter" / "testing").exists()


def test_the_deployed_space_completes_an_llm_job_and_a_kohya_sd_job_with_pictures(app, demo_hub):
    url, log_path = app
    client = _signed_in_client(url)

    log, summary, verification, _table, _images, card = client.predict(
        BASE, LORA, "demo/space-llm", "keep", "original", True, "", False, False, api_name="/run"
    )
    assert "Pushed" in summary and "demo/space-llm" in summary, log
    assert "Passed" in verification and "PEFT" in verification, verification
    assert demo_hub.exists("demo/space-llm")

    log, summary, verification, _table, images, card = client.predict(
        SD_BASE, SD_LORA, "demo/space-sd", "keep", "original", True, "", False, False, api_name="/run"
    )
    assert "Pushed" in summary, log
    assert "Passed" in verification and "diffusers" in verification, verification
    assert "published formula" not in verification.lower()  # diffusers referees, no fallback
    pictures = images["value"] if isinstance(images, dict) else images
    assert pictures and len(pictures) >= 3, images  # base, base + LoRA (diffusers), merged
    report = json.loads(demo_hub.read_file("demo/space-sd", "verification.json"))
    assert report["verdict"] == "pass" and "load_lora_weights" in report["reference"], report
    assert MOCK_TOKEN not in log_path.read_text()
