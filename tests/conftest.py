"""Shared fixtures, used as fixtures (a test names them as arguments; no test module imports this one). The plain
functions the tests share are helper modules beside it: model_helpers.py (tiny LLMs, PEFT adapters, PEFT as the
oracle), diffusion_helpers.py, convert_helpers.py, family_cases.py, venvs.py.

No test reaches the internet: models are made from configs, the real one (SmolLM2) comes from a PyPI
package converted by scripts/build_fixtures.py.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads (torch's) that wait by sleeping, not spinning: the suite runs servers, apps and CLI processes beside
# its own torch work on two cores, where spinning waiters took 4x the CPU (measured on SmolLM2 generation).
# Set before torch loads its OpenMP runtime; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Under pytest-xdist (`make test` runs `-n 2`), each worker gets a temp folder of its own (TMPDIR, inherited by the
# processes it starts): converter removes the temp folders of runs that are gone from the temp folder it uses, and
# a test that kills a run and then sees its leftovers removed must not have the other worker's run remove them, nor
# its removal line printed in another test's output. (tmp_path is per worker already.)
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=f"cvt-{WORKER}-")  # short: AF_UNIX paths must fit 107 bytes
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
# With a worker per core, one torch thread each (subprocesses too): a second one mostly waits for a core the other
# worker holds (test_smollm2.py on two busy cores: 45 s with one thread or two, 7% less CPU with one; measured).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= (os.cpu_count() or 1):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from model_helpers import CliRun  # noqa: E402

from converter.cli.commands import execute  # noqa: E402

# The test modules live in folders that mirror the package (engine/, verification/ ...), the helpers here. A few
# import from a test module of another folder (`from test_community_sd import sdxl_lora`): every folder goes on
# sys.path, as pytest's import mode puts each one there once it collects it, so that one file run alone finds them.
for folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if folder.is_dir() and any(folder.glob("test_*.py")) and str(folder) not in sys.path:
        sys.path.append(str(folder))


def pytest_unconfigure(config):
    if WORKER:
        shutil.rmtree(os.environ["TMPDIR"], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`: whole files, those sharing a session fixture together, slowest first (scheduling.py)."""
    if config.getvalue("dist") == "loadfile":
        from scheduling import make_scheduler

        return make_scheduler(config, log)
    return None


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process; returns (exit code, stdout, stderr) with the command's typed outcome as `.outcome`
    (model_helpers.CliRun).

    Merges skip the built-in verification unless `verify=True`: these tests compare with PEFT themselves, and
    verification has its own tests (test_verify.py) plus the architecture sweep.
    """

    def _run(*args: str | Path, verify: bool = False) -> CliRun:
        capsys.readouterr()  # drop what fixtures printed (transformers' progress bars)
        if args and args[0] == "merge" and not verify:
            args = (*args, "--no-verify")
        outcome = execute([str(a) for a in args])
        captured = capsys.readouterr()
        return CliRun(outcome, captured.out, captured.err)

    return _run


@pytest.fixture
def few_images(monkeypatch):
    """One image of two steps per diffusion verification: enough to compare pictures, cheap on a CPU (modules whose
    every test wants it say `pytestmark = pytest.mark.usefixtures("few_images")`)."""
    import converter.verification.diffusion as diffusion

    monkeypatch.setattr(diffusion, "IMAGE_COUNT", 1)
    monkeypatch.setattr(diffusion, "IMAGE_STEPS", 2)


# Session-wide set-ups that several modules share: built once per run.


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """converter's wheel, built once from this checkout."""
    from venvs import build_wheel

    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def torch_venv(tmp_path_factory):
    """A fresh venv with torch==2.13.0 alone, installed first as everywhere here; others start as copies of it."""
    from venvs import TORCH, Venv, record

    venv = Venv.create(tmp_path_factory.mktemp("torch-venv") / "venv")
    record("torch", venv, lambda: venv.install(TORCH))
    warm = venv.run("python", "-c", "import torch", env=dict(os.environ), cwd=venv.path)  # its bytecode, for all
    assert warm.returncode == 0, warm.stderr
    yield venv
    venv.remove()


@pytest.fixture(scope="session")
def demo_hub(tmp_path_factory):
    """The local Hub seeded like `make run --tiny`: a tiny Llama with LoRAs, a tiny SD pipeline with kohya LoRAs."""
    from converter.app.local import seed_demo
    from converter.testing.hub import HubServer

    root = tmp_path_factory.mktemp("demo-hub")
    hub = HubServer(root / "hub").start()
    seed_demo(hub, root / "seed", fast=True)
    yield hub
    hub.stop()


@pytest.fixture(scope="session")
def training_checkpoints(tmp_path_factory):
    """Every verl-style training checkpoint of converter.testing.training_checkpoints (two gloo processes,
    ~30 s on 2 cores), built once per session for the modules that need them."""
    import subprocess
    import sys

    pytest.importorskip("torch.distributed.fsdp")
    root = tmp_path_factory.mktemp("training")
    proc = subprocess.run(
        [sys.executable, "-m", "converter.testing.training_checkpoints", str(root), "--world", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root
