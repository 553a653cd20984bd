"""The Space's logic without a browser: form parsing, the header-only Check, the job runner's guarantees (own temp
folder removed on failure, size limit up front, nothing created on failure), Hub-only sources, and the deploy.

Hub code runs in subprocesses (huggingface_hub reads HF_ENDPOINT at import time; this process is offline).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from model_helpers import make_adapter, make_base
from safetensors.torch import save_file

from converter.app.check import _sparse_standin, space_machine
from converter.app.demo_pipelines import FLUX_BASE, FLUX_LORA, SDXL_BASE, SDXL_LORA
from converter.app.local import BASE, LORA, LORA_B, MOCK_TOKEN, SD_BAD, SD_BASE, SD_LORA, SD_REPO, WRONG, seed_demo
from converter.app.merge_job import JobRequest, default_repo, parse_adapters, redactor, report_images
from converter.errors import ConverterError
from converter.hub.sources import job_sources, parse_source
from converter.io.safetensors_file import SafetensorsFile
from converter.testing.hub import HubServer, client_env, run_client

ROOT = Path(__file__).resolve().parents[2]
OTHER = "hf_fake_other_user_token_42"


def test_parse_adapters_lines_and_weights():
    specs = parse_adapters("a/one\n\n  b/two@main/x.safetensors 0.5 \n")
    assert [(s.source, s.weight) for s in specs] == [("a/one", 1.0), ("b/two@main/x.safetensors", 0.5)]
    with pytest.raises(ConverterError, match="line 1: weight 'heavy' is not a number"):
        parse_adapters("a/one heavy")
    with pytest.raises(ConverterError, match="at least one adapter"):
        parse_adapters(" \n")
    with pytest.raises(ConverterError, match="line 2: write `org/name \\[weight\\]`"):
        parse_adapters("a/one\na/two 1 2")


def test_per_component_weights_of_a_diffusion_lora():
    specs = parse_adapters("o/sd/style.safetensors unet=0.8,text_encoder=0.5\no/other 0.3")
    assert [s.weight for s in specs] == [{"unet": 0.8, "text_encoder": 0.5}, 0.3]
    assert specs[0].weight_for("text_encoder") == 0.5 and specs[0].weight_for("unet") == 0.8
    with pytest.raises(ConverterError, match="line 1: weight 'unet=strong' is not a number or `component=number"):
        parse_adapters("o/sd unet=strong")
    with pytest.raises(ConverterError, match="unknown component 'vae'"):
        JobRequest(base="o/sd", adapters="o/lora vae=1").recipe()


def test_report_images_follow_the_diffusion_report_contract(tmp_path):
    """verification.json of a diffusion merge: "kind": "diffusion", "images": [{prompt, base, reference, merged
    (PNGs relative to the merged folder), psnr, max_abs}]; read into memory, in gallery order, with captions."""
    from PIL import Image

    (tmp_path / "verify").mkdir()
    for i, name in enumerate(("base", "ref", "merged")):
        Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / "verify" / f"{name}.png")
    row = {"prompt": "a red fox", "base": "verify/base.png", "reference": "verify/ref.png",
           "merged": "verify/merged.png", "psnr": 48.2, "max_abs": 1}  # fmt: skip
    images = report_images(tmp_path, {"kind": "diffusion", "images": [row]})
    assert [caption.split(":")[0] for _, caption in images] == ["base", "base + LoRA (diffusers, unmerged)", "merged"]
    assert [im.getpixel((0, 0))[0] for im, _ in images] == [0, 40, 80]
    assert "a red fox" in images[2][1] and "PSNR 48.2 dB" in images[2][1] and "max |Δ| 1" in images[2][1]
    assert report_images(tmp_path, {"verdict": "pass", "generations": []}) == []  # an LLM report: the table
    assert report_images(tmp_path, None) == []


def test_request_and_default_repo():
    assert default_repo("me", "org/Base-7B@v1", "x/my-lora\n") == "me/Base-7B-my-lora-merged"
    assert default_repo("me", "org/base", "not a weight") == "me/base-adapter-merged"
    assert default_repo("me", "org/base", "x/style-lora@abc/sub/file.safetensors 0.3") == "me/base-style-lora-merged"
    recipe = JobRequest(base=" org/base ", adapters="x/a 0.5", dtype="bfloat16").recipe()
    assert recipe.base == "org/base" and recipe.dtype == "bfloat16" and recipe.adapters[0].weight == 0.5
    assert JobRequest(base="org/base", adapters="x/a").recipe().dtype is None  # "keep"
    with pytest.raises(ConverterError, match="output dtype 'int8'"):
        JobRequest(base="org/base", adapters="x/a", dtype="int8").recipe()
    with pytest.raises(ConverterError, match="base model: give a Hub repo id"):
        JobRequest(base=" ", adapters="x/a").recipe()


def test_redactor_and_the_space_machine(monkeypatch, tmp_path):
    assert redactor("hf_secret")("Bearer hf_secret failed") == "Bearer <token> failed"
    assert redactor(None)("unchanged") == "unchanged"
    monkeypatch.setenv("CONVERTER_APP_MAX_DISK", "3GB")
    monkeypatch.setenv("CONVERTER_APP_CONCURRENCY", "2")
    machine = space_machine(tmp_path)  # a job's share of this machine: what the estimate is held against
    assert machine.name == "this Space" and machine.disk <= 1_500_000_000 and machine.where == str(tmp_path)


def test_job_sources_are_hub_only(tmp_path):
    """A web form must not read files on the server: inside a job, paths are refused, even existing folders."""
    assert parse_source("converter").local is not None  # outside a job: an existing folder is local
    with job_sources(tmp_path / "cache"):
        for spec in ("/etc/passwd", "./converter", "~/x", "a/../../b"):
            with pytest.raises(ConverterError, match="not a Hub id"):
                parse_source(spec)
        source = parse_source("converter/formats")  # exists in the checkout, but here it is a Hub id
        assert source.local is None and source.repo_id == "converter/formats"
    assert parse_source("converter/formats").local is not None


def test_sparse_standin_plans_like_the_real_file(tmp_path):
    """The Check plans from headers written into a sparse file of the real size: same names, shapes, offsets."""
    real = tmp_path / "real" / "model.safetensors"
    real.parent.mkdir()
    save_file(
        {"b.weight": torch.ones(512, 1024), "a.bias": torch.zeros(3, dtype=torch.bfloat16)}, real, {"format": "pt"}
    )
    original = SafetensorsFile(real)
    meta = SimpleNamespace(
        metadata=original.metadata,
        tensors={
            n: SimpleNamespace(dtype=t.dtype, shape=list(t.shape), data_offsets=(t.start - original.header_bytes,
                                                                                  t.end - original.header_bytes))
            for n, t in original.tensors.items()
        },
    )  # fmt: skip
    standin = tmp_path / "standin" / "model.safetensors"
    standin.parent.mkdir()
    _sparse_standin(standin, meta)
    copy = SafetensorsFile(standin)
    assert copy.metadata == {"format": "pt"}
    assert {n: (t.dtype, t.shape, t.nbytes) for n, t in copy.tensors.items()} == {
        n: (t.dtype, t.shape, t.nbytes) for n, t in original.tensors.items()
    }
    assert copy.size - copy.header_bytes == original.size - original.header_bytes
    assert standin.stat().st_blocks * 512 < real.stat().st_size // 4  # a hole, not 2 MB of zeros


# ---------------------------------------------------------------------------------------------------------------
# Against the local Hub
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("apphub")
    server = HubServer(root / "server").start()
    seed_demo(server, root / "seed", fast=True)
    server.add_user("other", OTHER)
    yield server
    server.stop()


def _client(hub: HubServer, code: str, tmp_path: Path) -> dict:
    prelude = (
        "import json, sys\n"
        "from converter.errors import ConverterError\n"
        "def result(obj):\n    print('RESULT ' + json.dumps(obj, default=str))\n"
    )
    proc = run_client(hub, prelude + code, token=None, home=tmp_path / "home", timeout=600)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_check_plans_from_headers_like_a_dry_run(hub, tmp_path):
    hub.reset_log()
    out = _client(
        hub,
        f"""
from pathlib import Path
from converter.app.check import check
from converter.engine.recipe import Recipe, AdapterSpec
from converter.hub.sources import job_sources
recipe = Recipe(base={BASE!r}, adapters=[AdapterSpec({LORA!r}), AdapterSpec({LORA_B!r}, 0.5)], dtype="float32")
with job_sources(Path({str(tmp_path)!r}) / "cache"):
    report = check(recipe, {MOCK_TOKEN!r}, Path({str(tmp_path)!r}) / "standin")
    nf4 = check(Recipe(base={BASE!r}, adapters=[AdapterSpec({LORA!r})], dtype="bnb-nf4"), {MOCK_TOKEN!r},
                Path({str(tmp_path)!r}) / "standin4")
result(dict(write=report.bytes_to_write, download=report.bytes_to_download, changed=report.changed_tensors,
            total=report.total_tensors, adapters=report.adapters, warnings=report.warnings, md=report.markdown(),
            nf4=nf4.notes))
""",
        tmp_path,
    )
    weights = [
        s
        for s in hub.seen
        if s.method == "GET" and s.path.startswith(f"/{BASE}/resolve/") and s.path.endswith(".safetensors")
    ]
    assert weights and all(s.range for s in weights)  # only header ranges of the base weights were read
    dry = subprocess.run(
        [sys.executable, "-m", "converter", "merge", "--base", BASE, "--adapter", LORA, "--adapter", LORA_B,
         "--weight", "1", "--weight", "0.5", "--dtype", "float32", "--dry-run"],
        env=client_env(hub, MOCK_TOKEN, tmp_path / "home2"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert dry.returncode == 0, hub.redact(dry.stderr)
    assert f"tensors: {out['total']} out, {out['changed']} changed" in dry.stdout
    base_file = tmp_path / "base.safetensors"
    base_file.write_bytes(hub.read_file(BASE, "model.safetensors"))
    stored = SafetensorsFile(base_file).tensors.values()
    assert {t.dtype for t in stored} == {"BF16"}
    assert out["write"] == 2 * sum(t.nbytes for t in stored)  # the bf16 base written as float32
    assert [(a["used"], a["tensors"], a["weight"], a["rank"]) for a in out["adapters"]] == [
        (56, 56, 1.0, "8"),
        (56, 56, 0.5, "4"),
    ]
    assert out["download"] > out["write"] // 4 and out["warnings"] == []
    assert f"2. `{LORA_B}@" in out["md"] and "weight 0.5 · peft · rank 4" in out["md"]
    assert any("stored as bitsandbytes NF4 4-bit" in note for note in out["nf4"])  # 4-bit output planned too


def test_check_says_where_a_job_fits_and_refuses_wrong_adapters(hub, tmp_path):
    """The Space's limit is the estimate against its own machine: a job that does not fit is shown with the Jobs
    flavor that does (this Hub serves no hardware list: the built-in table), and refused before any download."""
    out = _client(
        hub,
        f"""
from pathlib import Path
from converter.app.check import check
from converter.app.merge_job import JobRequest, run_job
from converter.engine.recipe import Recipe, AdapterSpec
from converter.jobs.fit import Machine
tmp = Path({str(tmp_path)!r})
small = Machine("a small Space", disk=1000, memory=10**10, cores=2, link=1e6)
recipe = Recipe(base={BASE!r}, adapters=[AdapterSpec({LORA!r})])
report, roomy = check(recipe, {MOCK_TOKEN!r}, tmp / "a", small), check(recipe, {MOCK_TOKEN!r}, tmp / "b")
errors = []
try:
    check(Recipe(base={BASE!r}, adapters=[AdapterSpec({WRONG!r})]), {MOCK_TOKEN!r}, tmp / "c")
except ConverterError as e:
    errors.append(str(e))
try:
    run_job(JobRequest(base={BASE!r}, adapters={LORA!r}, repo_id="demo/too-big", verify=False), {MOCK_TOKEN!r},
            workroot=tmp / "jobs", machine=small)
except ConverterError as e:
    errors.append([type(e).__name__, e.flavor])
result(dict(fits=[report.fits, roomy.fits], flavor=report.jobs.machine.name, md=report.markdown(), errors=errors))
""",
        tmp_path,
    )
    assert out["fits"] == [False, True] and out["flavor"] == "cpu-basic"
    assert "Too big for this Space" in out["md"] and "`cpu-basic`" in out["md"]
    assert out["errors"][0].startswith(WRONG) and "adapter trained on a different model size?" in out["errors"][0]
    assert out["errors"][1] == ["DoesNotFit", "cpu-basic"] and not hub.exists("demo/too-big")


def _run_job(hub: HubServer, tmp_path: Path, token: str | None, **request) -> dict:
    return _client(
        hub,
        f"""
from pathlib import Path
from converter.app.merge_job import JobRequest, run_job
work = Path({str(tmp_path)!r}) / "jobs"
stages, lines = [], []
try:
    r = run_job(JobRequest(**{request!r}), {token!r}, workroot=work, stage=stages.append, log=lines.append)
    out = dict(url=r.url, pr=r.pr_url, changed=r.changed, card=r.card, report=r.report, gguf=r.gguf_url)
except ConverterError as e:
    out = dict(error=str(e))
result(dict(out, stages=stages, log=lines, left=[p.name for p in work.iterdir()] if work.exists() else []))
""",
        tmp_path,
    )


def test_run_job_failure_leaves_nothing(hub, tmp_path):
    out = _run_job(hub, tmp_path, MOCK_TOKEN, base=BASE, adapters=WRONG, repo_id="demo/wrong-job", verify=False)
    assert "different model size" in out["error"] and out["stages"] == ["check"]
    assert out["left"] == [] and not hub.exists("demo/wrong-job")
    out = _run_job(hub, tmp_path, MOCK_TOKEN, base=BASE, adapters=LORA, repo_id="other/x", verify=False)
    assert "you (demo) cannot write under 'other'" in out["error"] and out["left"] == []
    out = _run_job(hub, tmp_path, None, base=BASE, adapters=LORA, repo_id="demo/x", verify=False)
    assert out["error"].startswith("sign in with Hugging Face first") and out["stages"] == []


def test_run_job_pushes_then_opens_a_pull_request(hub, tmp_path):
    hub.reset_log()
    first = _run_job(hub, tmp_path, MOCK_TOKEN, base=BASE, adapters=LORA, repo_id="demo/jobs-pr", verify=False)
    assert first["stages"] == ["check", "download, merge, upload", "commit"] and first["changed"], first
    # The pipelined push: the base's weights streamed by Range reads while the merge read them, one commit.
    weights = [s for s in hub.seen if s.method == "GET" and f"/{BASE}/resolve/" in s.path and ".safetensors" in s.path]
    assert weights and all(s.range for s in weights), weights
    assert len([s for s in hub.seen if "/commit/" in s.path]) == 1
    assert first["left"] == [] and first["report"] is None and "demo/jobs-pr" in first["card"]
    second = _run_job(
        hub, tmp_path, MOCK_TOKEN, base=BASE, adapters=f"{LORA} 0.5", repo_id="demo/jobs-pr", verify=False,
        create_pr=True,
    )  # fmt: skip
    assert second["pr"] == f"{hub.url}/demo/jobs-pr/discussions/1", second
    assert all(MOCK_TOKEN not in line for line in first["log"] + second["log"])
    # The demo adapters name BASE as their base: the same repo as the pinned base, so no warning (it
    # used to compare the name with the cache folder '<sha>'); and the log names repos, never server paths.
    assert not [line for line in first["log"] if "trained on" in line], first["log"]
    leaks = [x for x in first["log"] + second["log"] if str(tmp_path) in x or "converter-" in x or "/tmp" in x]
    assert not leaks and any(line.startswith("wrote jobs-pr ") for line in first["log"]), first["log"]


def test_run_job_with_a_gguf_type_pushes_a_proven_gguf_repo_or_nothing(hub, tmp_path):
    """The GGUF choice (off by default): the merged model also as a proven GGUF in REPO-GGUF, one commit there. A
    base llama.cpp cannot take (the demo's tiny base has no tokenizer) fails before the commit: neither repo."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_fixtures import cache_dir

    assert JobRequest(base="a/b", adapters="c/d").gguf == "none"
    with pytest.raises(ConverterError, match="GGUF type 'Q9_X': choose one of none, F32, F16, BF16, Q8_0, "):
        JobRequest(base="a/b", adapters="c/d", gguf="Q9_X").recipe()
    base = make_base(tmp_path / "base", "llama", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (base / name).write_bytes((cache_dir() / "smollm2-135m-instruct" / name).read_bytes())
    hub.seed_folder("demo/tiny-tokenized", base)
    hub.seed_folder("demo/tiny-tokenized-lora", make_adapter(base, tmp_path / "lora", r=2))
    out = _run_job(hub, tmp_path, MOCK_TOKEN, base="demo/tiny-tokenized", adapters="demo/tiny-tokenized-lora",
                   repo_id="demo/jobs-gguf", verify=False, gguf="Q8_0")  # fmt: skip
    assert out.get("error") is None and out["gguf"] == f"{hub.url}/demo/jobs-gguf-GGUF", out
    assert set(hub.files("demo/jobs-gguf-GGUF")) - {".gitattributes"} == {"README.md", "gguf-proof.json",
                                                                          "jobs-gguf-Q8_0.gguf"}  # fmt: skip
    assert "model.safetensors" in hub.files("demo/jobs-gguf") and out["left"] == []
    assert any(line.startswith("GGUF: pushed: ") for line in out["log"])
    assert any(line.startswith("  tensors: ok: ") for line in out["log"])
    failed = _run_job(hub, tmp_path, MOCK_TOKEN, base=BASE, adapters=LORA, repo_id="demo/jobs-gguf-no", verify=False,
                      gguf="Q8_0")  # fmt: skip
    assert "no tokenizer.json or tokenizer.model: a GGUF needs the tokenizer" in failed["error"], failed
    assert not hub.exists("demo/jobs-gguf-no") and not hub.exists("demo/jobs-gguf-no-GGUF") and failed["left"] == []


def test_public_paths_show_repo_names_only(tmp_path):
    from converter.app.merge_job import public_paths

    job = tmp_path / "jobs" / "converter-job-abc"
    sha = "0123456789abcdef0123456789abcdef01234567"
    cached = f"{job}/hf-cache/models--org--my-lora/snapshots/{sha}/adapter_model.safetensors"
    line = f"warning: {cached}: something; wrote {job}/out/merged (3 MB); {job}/check/base/config.json"
    assert public_paths(line, job, tmp_path / "jobs") == (
        "warning: org/my-lora@0123456: something; wrote merged (3 MB); base/config.json"
    ).replace("org/my-lora@0123456", "org/my-lora@0123456/adapter_model.safetensors")
    assert public_paths(f"left {tmp_path}/jobs/other-job", job, tmp_path / "jobs") == "left other-job"
    # The pipelined push's own temp folder inside the job's: its name (owner, host) is not shown either.
    line = f"wrote {job}/converter-push.4242-1-0f@host/out/merged (3 MB)"
    assert public_paths(line, job, tmp_path / "jobs") == "wrote merged (3 MB)"


def test_same_base_is_decided_by_pinned_ids():
    from converter.hub.sources import same_hub_model

    sha = "0123456789abcdef0123456789abcdef01234567"
    assert same_hub_model("Org/Base", None, f"org/base@{sha}") is True  # Hub ids are case-insensitive
    assert same_hub_model("org/base", "0123456", f"org/base@{sha}") is True  # declared commit = resolved sha
    assert same_hub_model("org/base", "main", f"org/base@{sha}") is True  # a branch: not resolvable offline
    assert same_hub_model("org/base@fedcba9", None, f"org/base@{sha}") is False
    assert same_hub_model("org/other", None, f"org/base@{sha}") is False
    assert same_hub_model("/data/models/base", None, f"org/base@{sha}") is None  # a path: names decide


def test_space_deploy(hub, tmp_path):
    import gradio

    env = client_env(hub, MOCK_TOKEN, tmp_path / "home")
    proc = subprocess.run(
        [sys.executable, "-m", "converter", "space", "deploy", "--repo", "demo/lora-merge"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, hub.redact(proc.stderr)
    assert "deployed" in proc.stdout and f"{hub.url}/spaces/demo/lora-merge" in proc.stdout
    files = hub.files("demo/lora-merge", repo_type="space")
    assert {
        "app.py",
        "README.md",
        "requirements.txt",
        "converter/app/merge_job.py",
        "converter/keymaps/generic.yaml",
    } <= set(files)
    assert not any(f.startswith("converter/testing/") or "__pycache__" in f for f in files)
    readme = hub.read_file("demo/lora-merge", "README.md", repo_type="space").decode()
    config = yaml.safe_load(readme.split("---")[1])
    assert config["sdk"] == "gradio" and config["sdk_version"] == gradio.__version__  # the tested version
    assert config["app_file"] == "app.py" and config["hf_oauth"] is True
    assert config["hf_oauth_scopes"] == ["read-repos", "contribute-repos", "write-discussions", "jobs"]
    assert len(config["short_description"]) <= 60 and config["suggested_hardware"]
    # The Space installs exactly the pins the package is tested with (constraints.txt), diffusers included.
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    requirements = hub.read_file("demo/lora-merge", "requirements.txt", repo_type="space").decode().splitlines()
    assert "diffusers" in {line.split("==")[0] for line in requirements}
    for line in requirements:
        if line and not line.startswith("#"):
            assert line in pins, line
    bad = subprocess.run(
        [sys.executable, "-m", "converter", "space", "deploy", "--repo", "not a repo"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "not a valid repo id" in bad.stderr


def test_make_run_serves_the_app_signed_in_as_demo(tmp_path):
    """`make run`: the embedded Hub is seeded, Gradio's login mock accepts the demo user, the app answers."""
    import os
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}  # no developer token or offline switch
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "converter.app.local", "--tiny", "--dir", str(tmp_path / "demo"),
             "--port", str(port)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        with httpx.Client(follow_redirects=True, timeout=60) as http:
            assert http.get(f"http://127.0.0.1:{port}/login/huggingface").status_code == 200
            assert any(c.name == "session" for c in http.cookies.jar)
        printed = log.read_text()
        assert f"Open http://127.0.0.1:{port}" in printed and "you are 'demo'" in printed
        assert (tmp_path / "demo" / "hub").is_dir()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_make_run_seeds_smollm2_with_its_trained_loras(tmp_path):
    """The `make run` seeding with the real SmolLM2 (not --tiny): the LoRAs are trained a few steps (2 here,
    cached where seeding looks first, so the 12-step training of `make run` is not repeated in the test), the
    repos carry SmolLM2 with cards naming the Hub base, and a second start reuses the cache."""
    from safetensors.torch import load_file

    from converter.app.local import FRENCH, PIRATE, smollm2_fixture, train_lora

    smollm2 = smollm2_fixture()  # `make fixtures` (make test builds it first)
    cache = tmp_path / "cache"
    for name, texts, seed in (("pirate-lora", PIRATE, 1), ("french-lora", FRENCH, 2)):
        folder = train_lora(smollm2, texts, cache / name, steps=2, seed=seed)
        ups = [v for k, v in load_file(folder / "adapter_model.safetensors").items() if "lora_B" in k]
        assert ups and all(v.abs().max() > 0 for v in ups)  # PEFT starts B at zero: these were trained
    stamp = (cache / "pirate-lora" / "adapter_model.safetensors").stat().st_mtime_ns
    server = HubServer(tmp_path / "hub").start()
    try:
        seed_demo(server, tmp_path / "seed", cache=cache)
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(server.files(BASE))
        for lora in (LORA, LORA_B):
            config = json.loads(server.read_file(lora, "adapter_config.json"))
            assert config["base_model_name_or_path"] == BASE and config["r"] == 8
            assert f"base_model: {BASE}" in server.read_file(lora, "README.md").decode()
        assert server.exists(SDXL_BASE) and server.exists(FLUX_BASE) and server.exists(SD_BASE)
    finally:
        server.stop()
    assert (cache / "pirate-lora" / "adapter_model.safetensors").stat().st_mtime_ns == stamp  # reused


def test_trained_on_warning_compares_pinned_ids(tmp_path):
    """A Hub base lives in the cache under its commit sha: the warning compares the adapter's declared base with
    the pinned repo id (and a declared commit with the resolved one), never with that folder's name."""
    from converter.engine.plan import sanity_warnings

    sha = "0123456789abcdef0123456789abcdef01234567"
    cached = SimpleNamespace(folder=tmp_path / sha, config={"_name_or_path": str(tmp_path / sha)})

    def warnings(base_model, revision=None, base_id=f"org/Base-7B@{sha}"):
        adapter = SimpleNamespace(
            base_model=base_model, config={"revision": revision}, path="org/lora@abc1234", model_config=None
        )
        return sanity_warnings(adapter, cached, base_id)

    assert warnings("org/base-7b") == [] and warnings("org/Base-7B", revision=sha[:7]) == []
    assert warnings("/home/me/models/Base-7B") == []  # a local path: the repo name decides, not the sha folder
    assert warnings("org/Base-7B", revision="fedcba9") == [
        f"org/lora@abc1234: adapter was trained on 'org/Base-7B@fedcba9', merging into 'org/Base-7B@{sha}'"
    ]
    assert "trained on 'other/Model'" in warnings("other/Model")[0]
    assert "merging into" in warnings("other/Model", base_id=None)[0]  # a local base: names as before


def test_diffusion_merge_job_with_component_strengths(hub, tmp_path):
    """A kohya LoRA into a diffusers pipeline on the Hub: the plan names the family, components and matched
    modules; the job pushes the pipeline with the per-component strengths recorded."""
    out = _client(
        hub,
        f"""
from pathlib import Path
from converter.app.check import check
from converter.app.merge_job import JobRequest, run_job
from converter.hub.sources import job_sources
request = JobRequest(base={SD_BASE!r}, adapters={SD_LORA + " unet=0.8,text_encoder=0.5"!r}, repo_id="demo/sd-job")
with job_sources(Path({str(tmp_path)!r}) / "cache"):
    md = check(request.recipe(), {MOCK_TOKEN!r}, Path({str(tmp_path)!r}) / "standin").markdown()
lines = []
r = run_job(request, {MOCK_TOKEN!r}, workroot=Path({str(tmp_path)!r}) / "jobs", log=lines.append)
result(dict(md=md, url=r.url, verdict=(r.report or {{}}).get("verdict"), images=len(r.images), log=lines))
""",
        tmp_path,
    )
    assert "StableDiffusionPipeline (sd)" in out["md"] and "**Diffusion family** `sd`" in out["md"]
    assert "text_encoder 12, unet 40, vae 0" in out["md"]  # tensors changed per component; the VAE untouched
    assert "weight unet=0.8, text_encoder=0.5 · kohya-lora" in out["md"] and "104/104" in out["md"]
    assert out["url"] == f"{hub.url}/demo/sd-job"
    files = set(hub.files("demo/sd-job"))
    assert {"model_index.json", "unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"} <= files
    provenance = json.loads(hub.read_file("demo/sd-job", "converter_provenance.json"))
    assert provenance["adapters"][0]["weight"] == {"unet": 0.8, "text_encoder": 0.5}
    # verified by diffusers' own loader with the same strengths, its pictures back on the page
    assert out["verdict"] == "pass" and out["images"] == 3 * 2
    assert not [line for line in out["log"] if "/tmp" in line or str(tmp_path) in line]


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_kohya_sdxl_and_flux_jobs_end_passed_with_images_in_the_card(hub, tmp_path, family):
    """The Space's job, end to end on the local Hub: a kohya SDXL (both text encoders) or Flux (fused qkv onto
    diffusers' to_q/to_k/to_v) LoRA is merged, verified by diffusers' own loader and pushed with its pictures."""
    base, lora = {"sdxl": (SDXL_BASE, SDXL_LORA), "flux": (FLUX_BASE, FLUX_LORA)}[family]
    repo = f"demo/{family}-job"
    out = _client(
        hub,
        f"""
from pathlib import Path
from converter.app.merge_job import JobRequest, run_job
r = run_job(JobRequest(base={base!r}, adapters={lora!r}, repo_id={repo!r}), {MOCK_TOKEN!r},
            workroot=Path({str(tmp_path)!r}) / "jobs")
result(dict(report=r.report, card=r.card, captions=[c for _, c in r.images]))
""",
        tmp_path,
    )
    report = out["report"]
    assert report["verdict"] == "pass" and "diffusers' load_lora_weights" in report["reference"], report["problems"]
    components = {"sdxl": {"unet", "text_encoder", "text_encoder_2"}, "flux": {"transformer"}}[family]
    assert set(report["components"]) == components
    assert len(out["captions"]) == 3 * len(report["images"]) > 0  # base / reference / merged per prompt
    assert "**Passed**" in out["card"] and "](verification/merged-0.png)" in out["card"]
    files = set(hub.files(repo))
    assert {"verification/base-0.png", "verification/reference-0.png", "verification/merged-0.png"} <= files


def _convert(hub: HubServer, tmp_path: Path, **request) -> dict:
    return _client(
        hub,
        f"""
from pathlib import Path
from converter.app.convert_job import ConvertRequest, run_convert
work = Path({str(tmp_path)!r}) / "jobs"
lines = []
try:
    r = run_convert(ConvertRequest(**{request!r}), {MOCK_TOKEN!r}, workroot=work, log=lines.append)
    out = dict(url=r.url, repo=r.repo_id, modules=r.modules, files=r.files, updated=r.updated, proofs=r.proofs)
except ConverterError as e:
    out = dict(error=str(e), kind=type(e).__name__)
result(dict(out, log=lines, left=[p.name for p in work.iterdir()] if work.exists() else []))
""",
        tmp_path,
    )


def test_convert_job_opens_a_pr_pushes_and_refuses_a_broken_file(hub, tmp_path):
    first = _convert(hub, tmp_path, adapter=SD_LORA, to="diffusers", base=SD_BASE, mode="pr")
    assert first["url"].startswith(f"{hub.url}/{SD_REPO}/discussions/") and first["modules"] == 52, first
    assert not first["updated"] and first["proofs"], first  # its ΔW proof, rendered from the typed result
    again = _convert(hub, tmp_path, adapter=SD_LORA, to="diffusers", base=SD_BASE, mode="pr")
    assert again["url"] == first["url"] and again["updated"]  # our open PR is updated, not a second one opened
    pushed = _convert(hub, tmp_path, adapter=SD_LORA, to="peft", base=SD_BASE, mode="push", repo_id="demo/sd-peft")
    assert pushed["url"] == f"{hub.url}/demo/sd-peft" and pushed["modules"] == 52
    assert {"unet/adapter_config.json", "text_encoder/adapter_model.safetensors"} <= set(hub.files("demo/sd-peft"))
    bad = _convert(hub, tmp_path, adapter=SD_BAD, to="diffusers", mode="push", repo_id="demo/never-converted")
    assert bad["kind"] == "AdapterFormatError" and "no lora_up" in bad["error"] and SD_REPO in bad["error"]
    assert "\n" not in bad["error"] and not hub.exists("demo/never-converted")
    other = _convert(hub, tmp_path, adapter=SD_LORA, to="kohya", mode="push", repo_id="other/x")
    assert "you (demo) cannot write under 'other'" in other["error"]
    for out in (first, again, pushed, bad, other):
        assert out["left"] == [] and not [x for x in out["log"] if "/tmp" in x or "converter-convert" in x], out
        assert all(MOCK_TOKEN not in line for line in out["log"])


def test_convert_job_to_comfyui_pushes_one_file_named_for_comfyui(hub, tmp_path):
    """The Space's ComfyUI target: one .safetensors of diffusion_model.<LDM key> modules, pushed as a repo."""
    pushed = _convert(hub, tmp_path, adapter=SD_LORA, to="comfyui", base=SD_BASE, mode="push", repo_id="demo/sd-comfy")
    assert pushed.get("url") == f"{hub.url}/demo/sd-comfy" and pushed["modules"] == 52, pushed
    files = [f for f in hub.files("demo/sd-comfy") if f.endswith(".safetensors")]
    assert len(files) == 1 and files[0].endswith("_comfyui.safetensors"), files
    assert pushed["left"] == [] and all(MOCK_TOKEN not in line for line in pushed["log"])
