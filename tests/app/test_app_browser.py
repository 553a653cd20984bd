"""The Space app end to end: a real browser (Playwright + the system Chromium) and gradio_client against the app,
which runs in a subprocess against the local Hub server, signed in through Gradio's local login mock.

Timeouts are generous and nothing asserts on wall-clock time: CI machines are slow and shared.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from converter.app.local import BASE, LORA, LORA_B, MOCK_TOKEN, SD_BAD, SD_BASE, SD_LORA, SD_REPO, WRONG, seed_demo
from converter.testing.hub import HubServer, client_env, run_client

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
# Without the background-networking switches Chromium's own calls home make the closed network refuse connections.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
QUEUE_SIZE = 3
JOB_TIMEOUT = 900  # seconds; a job takes ~10 s on an idle machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """The local Hub (seeded like `make run`) and the app serving against it; yields (hub, url, app log path)."""
    root = tmp_path_factory.mktemp("space")
    hub = HubServer(root / "hub").start()
    seed_demo(hub, root / "seed", fast=True)
    port = _free_port()
    env = client_env(hub, token=MOCK_TOKEN, home=root / "home") | {
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "CONVERTER_APP_WORKDIR": str(root / "jobs"),
        "CONVERTER_APP_QUEUE_SIZE": str(QUEUE_SIZE),
        "CONVERTER_HUB_RETRIES": "2",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    log_path = root / "app.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the app exited with {proc.returncode}:\n{hub.redact(log_path.read_text())[-3000:]}")
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the app did not start in 300 s:\n{hub.redact(log_path.read_text())[-3000:]}")
            time.sleep(1)
        hub.workdir = root / "jobs"
        yield hub, url, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        hub.stop()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} missing: `make test` installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _signed_in_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    page.set_default_timeout(120_000)
    page.goto(url)
    page.get_by_role("button", name="Sign in with Hugging Face").click()
    page.wait_for_selector("#user:has-text('Signed in as')")
    return page


def _fill(page, elem_id: str, text: str) -> None:
    page.locator(f"#{elem_id} textarea, #{elem_id} input").first.fill(text)


def _repo_files(hub: HubServer, repo: str) -> dict[str, bytes]:
    return {name: hub.read_file(repo, name) for name in hub.files(repo)}


def test_browser_end_to_end(space, browser, tmp_path):
    hub, url, log_path = space
    page = _signed_in_page(browser, url)
    assert "demo" in page.inner_text("#user")

    _fill(page, "base", BASE)
    page.wait_for_selector("#base-status:has-text('parameters')")
    assert "LlamaForCausalLM" in page.inner_text("#base-status")
    _fill(page, "adapters", f"{LORA}\n{LORA_B} 0.5")
    page.wait_for_selector("#adapter-status:has-text('rank 4')")
    status = page.inner_text("#adapter-status")
    assert "peft, rank 8" in status and "× 0.5" in status
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    # the repo placeholder follows the adapters in an event of its own: wait for it rather than race it
    want = f"demo/{BASE.split('/')[1]}-{LORA.split('/')[1]}-merged"
    repo = page.locator("#repo textarea, #repo input").first
    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_function(
            "want => [...document.querySelectorAll('#repo textarea, #repo input')].some(e => e.placeholder === want)",
            arg=want, timeout=10_000,
        )  # fmt: skip
    assert repo.get_attribute("placeholder") == want
    _fill(page, "repo", "demo/e2e-merged")

    page.locator("#check").click()
    page.wait_for_selector("#plan:has-text('Download')")
    plan = page.inner_text("#plan")
    assert "demo/e2e-merged" in plan and plan.count("56/56") == 2  # coverage of both adapters
    assert "warning" not in plan
    assert not hub.exists("demo/e2e-merged")  # the check creates nothing

    page.locator("#run").click()
    page.wait_for_selector("#result:has-text('Pushed')", timeout=JOB_TIMEOUT * 1000)
    assert page.locator("#result a", has_text="demo/e2e-merged").get_attribute("href") == f"{hub.url}/demo/e2e-merged"
    verification = page.inner_text("#verification")
    assert "Passed" in verification and "mean KL" in verification
    generations = page.inner_text("#generations")  # base, base + adapters, merged side by side, per prompt
    assert "base + adapters (PEFT)" in generations and all(f"random token ids #{i}" in generations for i in range(3))
    log_text = page.locator("#log textarea").input_value()
    assert "pushed:" in log_text and "verifying" in log_text
    page.get_by_text("Model card preview").click()
    page.wait_for_selector("#card:has-text('How to load')")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "space-end-to-end.png"), full_page=True)
    html = page.content()
    page.close()

    # The pushed repo downloads and loads like any model, and its card holds the verification.
    files = _repo_files(hub, "demo/e2e-merged")
    assert "Passed" in files["README.md"].decode()
    provenance = json.loads(files["converter_provenance.json"])
    assert [a["weight"] for a in provenance["adapters"]] == [1.0, 0.5]
    out = run_client(
        hub,
        "import torch; from huggingface_hub import snapshot_download\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(snapshot_download('demo/e2e-merged'))\n"
        "print(m(torch.tensor([[1, 5, 9]])).logits.shape, sum(p.numel() for p in m.parameters()))",
        token=MOCK_TOKEN,
        home=tmp_path / "home",
        timeout=300,
    )
    assert "torch.Size([1, 3, 512])" in out.stdout

    # Token hygiene: the token the sign-in handed the app is nowhere in the page, the pushed files or the logs.
    for where, text in [("page", html), ("app log", log_path.read_text())] + [
        (name, data.decode(errors="replace")) for name, data in files.items()
    ]:
        assert MOCK_TOKEN not in text, f"the token leaked into {where}"
    assert not list(hub.workdir.iterdir())  # the job's temp folder (and its HF cache) is gone


def test_browser_wrong_adapter_is_a_readable_error_and_creates_nothing(space, browser):
    hub, url, log_path = space
    page = _signed_in_page(browser, url)
    _fill(page, "base", BASE)
    _fill(page, "adapters", WRONG)
    _fill(page, "repo", "demo/never-created")
    page.locator("#run").click()
    toast = page.locator(".toast-body", has_text="different model size")
    toast.wait_for(timeout=JOB_TIMEOUT * 1000)
    message = toast.inner_text()
    assert WRONG in message and "implies shape" in message
    assert "Traceback" not in message and "&lt;" not in message and "&#x27;" not in message
    assert "error:" in page.locator("#log textarea").input_value()
    assert not hub.exists("demo/never-created")
    assert MOCK_TOKEN not in page.content() + message + log_path.read_text()
    # Bad input is refused before the job takes a worker; quotes and markup in messages are shown as typed.
    _fill(page, "adapters", f"{LORA} <b>heavy</b>")
    page.locator("#run").click()
    toast = page.locator(".toast-body", has_text="is not a number")
    toast.wait_for()
    assert "weight '<b>heavy</b>' is not a number" in toast.inner_text()
    page.close()


def test_browser_diffusion_merge_with_component_strengths(space, browser):
    """The merge tab with a diffusers pipeline and a kohya LoRA: the plan shows family, components and matched
    modules; the job pushes; the result shows the verification (images when diffusion verification is there)."""
    hub, url, log_path = space
    page = _signed_in_page(browser, url)
    _fill(page, "base", SD_BASE)
    page.wait_for_selector("#base-status:has-text('parameters')")
    assert "diffusion family sd: text_encoder, unet, vae" in page.inner_text("#base-status")
    _fill(page, "adapters", f"{SD_LORA} unet=0.8,text_encoder=0.5")
    page.wait_for_selector("#adapter-status:has-text('kohya-lora')")
    _fill(page, "repo", "demo/sd-e2e")
    page.locator("#check").click()
    page.wait_for_selector("#plan:has-text('Download')")
    plan = page.inner_text("#plan")
    assert "Diffusion family sd" in plan and "text_encoder 12, unet 40, vae 0" in plan and "104/104" in plan
    assert "unet=0.8, text_encoder=0.5" in plan
    page.locator("#run").click()
    page.wait_for_selector("#result:has-text('Pushed')", timeout=JOB_TIMEOUT * 1000)
    verification = page.inner_text("#verification")
    if "Not verified" in verification:  # diffusion verification not there yet: no pictures, honestly said
        assert "diffusion model" in verification and not page.locator("#images").is_visible()
    else:
        assert "Passed" in verification
        page.wait_for_selector("#images img >> nth=2", timeout=60_000)  # base, reference, merged: served as files
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "space-diffusion-merge.png"), full_page=True)
    assert {"model_index.json", "unet/diffusion_pytorch_model.safetensors"} <= set(hub.files("demo/sd-e2e"))
    page.close()


def _convert_tab(page, adapter: str, to: str, mode: str, base: str = "", repo: str = "") -> None:
    page.get_by_role("tab", name="Convert a LoRA").click()
    _fill(page, "convert-adapter", adapter)
    _fill(page, "convert-base", base)
    page.locator("#convert-to input").first.fill(to)
    page.locator("#convert-to input").first.press("Enter")
    page.locator("#convert-mode").get_by_label(mode).check()
    _fill(page, "convert-repo", repo)
    page.locator("#convert-run").click()


def test_browser_convert_tab_pull_request_and_push(space, browser):
    """Convert a LoRA: a PR on the adapter's repo (the `convert --push-pr` flow) on the local Hub, then a push to
    the signed-in user's account; the result links the PR and says what was converted."""
    hub, url, log_path = space
    page = _signed_in_page(browser, url)
    _convert_tab(page, SD_LORA, "diffusers", "Open a pull request on the adapter's repo", base=SD_BASE)
    page.wait_for_selector("#convert-result:has-text('Pull request opened')", timeout=JOB_TIMEOUT * 1000)
    link = page.locator("#convert-result a").first.get_attribute("href")
    assert link.startswith(f"{hub.url}/{SD_REPO}/discussions/"), link
    assert "52 LoRA modules converted to diffusers" in page.inner_text("#convert-result")
    prs = run_client(
        hub,
        "from huggingface_hub import HfApi\n"
        f"print([(d.num, d.title) for d in HfApi().get_repo_discussions({SD_REPO!r}) if d.is_pull_request])",
        token=MOCK_TOKEN,
        home=Path(log_path).parent / "home-prs",
        timeout=120,
    ).stdout
    assert "Add a diffusers version of this adapter" in prs
    page.close()
    page = _signed_in_page(browser, url)
    _convert_tab(page, SD_LORA, "peft", "Push to my account", base=SD_BASE, repo="demo/sd-lora-peft")
    try:
        page.wait_for_selector("#convert-result:has-text('Pushed')", timeout=JOB_TIMEOUT * 1000)
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "space-convert-failed.png"), full_page=True)
        raise AssertionError(page.locator(".toast-body").all_inner_texts()) from None
    assert "unet/adapter_config.json" in page.inner_text("#convert-result")
    assert "text_encoder/adapter_model.safetensors" in set(hub.files("demo/sd-lora-peft"))
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "space-convert.png"), full_page=True)
    assert MOCK_TOKEN not in page.content() + log_path.read_text()
    page.close()


def test_browser_broken_kohya_file_is_a_readable_error_and_creates_nothing(space, browser):
    hub, url, log_path = space
    page = _signed_in_page(browser, url)
    _convert_tab(page, SD_BAD, "diffusers", "Push to my account", repo="demo/never-converted")
    toast = page.locator(".toast-body", has_text="no lora_up")
    toast.wait_for(timeout=JOB_TIMEOUT * 1000)
    message = toast.inner_text()
    assert SD_REPO in message and "incomplete or damaged file" in message and "Traceback" not in message
    assert "/tmp" not in message and not hub.exists("demo/never-converted")
    # The same file in the merge tab: the same one-line error, nothing created either.
    page.close()
    page = _signed_in_page(browser, url)
    _fill(page, "base", SD_BASE)
    _fill(page, "adapters", SD_BAD)
    _fill(page, "repo", "demo/never-merged")
    page.locator("#run").click()
    page.locator(".toast-body", has_text="no lora_up").wait_for(timeout=JOB_TIMEOUT * 1000)
    assert not hub.exists("demo/never-merged") and not list(hub.workdir.iterdir())
    page.close()


def _session_cookie(url: str) -> str:
    """Sign in through the local login mock like a browser does; the session cookie carries the OAuth info."""
    with httpx.Client(follow_redirects=True, timeout=60) as http:
        http.get(f"{url}/login/huggingface")
        for cookie in http.cookies.jar:
            if cookie.name == "session":
                return cookie.value
    raise AssertionError("the login mock set no session cookie")


def test_signed_out_runs_nothing(space):
    from gradio_client import Client

    hub, url, _ = space
    client = Client(url, verbose=False, download_files=False, analytics_enabled=False)
    with pytest.raises(Exception, match="Sign in with Hugging Face"):
        client.predict(BASE, LORA, "demo/signed-out", "keep", "original", False, "", False, False, api_name="/run")
    assert not hub.exists("demo/signed-out")


def test_load_eight_concurrent_submissions(space):
    """Every submission completes with its own result or is refused cleanly by the bounded queue; none is lost,
    none gets another's result, and no temp folder is left behind."""
    from gradio_client import Client

    hub, url, log_path = space
    headers = {"Cookie": f"session={_session_cookie(url)}"}
    client = Client(url, verbose=False, headers=headers, download_files=False, analytics_enabled=False)
    weights = [0.25 + 0.125 * i for i in range(8)]
    outcomes: dict[int, object] = {}

    def submit(i: int) -> None:
        try:
            outcomes[i] = client.predict(
                BASE, f"{LORA} {weights[i]}", f"demo/load-{i}", "keep", "original", False, "", False, False,
                api_name="/run",
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - classified below
            outcomes[i] = e

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOB_TIMEOUT * 3)
    assert sorted(outcomes) == list(range(8)), "a submission got no answer"
    done, refused = [], []
    for i, outcome in sorted(outcomes.items()):
        if isinstance(outcome, Exception):
            assert "queue is full" in str(outcome).lower(), repr(outcome)
            refused.append(i)
            assert not hub.exists(f"demo/load-{i}")
            continue
        log_text, summary, verification, _generations, _images, card = outcome
        assert f"demo/load-{i}" in summary and f"demo/load-{i}" in card
        assert "verification was switched off" in verification
        for j in range(8):
            assert j == i or f"demo/load-{j}" not in summary + log_text
        provenance = json.loads(hub.read_file(f"demo/load-{i}", "converter_provenance.json"))
        assert provenance["adapters"][0]["weight"] == weights[i]  # its own submission's weight
        done.append(i)
    print(f"load: {len(done)} served, {len(refused)} refused (queue size {QUEUE_SIZE})")
    assert len(done) >= QUEUE_SIZE, (done, refused)  # at least a full queue's worth is served
    assert not list(hub.workdir.iterdir())
    assert MOCK_TOKEN not in log_path.read_text()
