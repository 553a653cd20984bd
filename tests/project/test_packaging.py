"""What the package promises about itself: the tested pins are written down and current, a missing extra is one
line naming the `pip install` to run (never a weaker check), the shipped testing utility needs no test tools, and
the Python API offers what its documentation shows. (The wheel installed into fresh venvs: test_install.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from converter.errors import MissingExtraError

ROOT = Path(__file__).resolve().parents[2]


def test_the_tested_pins_are_written_down_and_current():
    """constraints.txt is what this venv runs; pyproject's lower bounds are those versions; the Space's
    requirements.txt pins converter[app]'s closure to them (scripts/lock.py rewrites all of it)."""
    proc = subprocess.run([sys.executable, "scripts/lock.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    pins = (ROOT / "constraints.txt").read_text()
    assert "\ntorch==2.13.0\n" in pins and "+cpu" not in pins
    space = (ROOT / "spaces" / "requirements.txt").read_text()
    assert "\ndiffusers==" in space and "\ntorch==2.13.0\n" in space
    assert "\ngradio==" not in space  # the Space's own sdk_version brings it


def test_extras_match_what_each_part_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "ray" not in base and "diffusers" not in base and "gradio" not in base
    assert any(r.startswith("diffusers") for r in extras["diffusion"])
    assert any(r.startswith("gradio[oauth]") for r in extras["app"]) and "converter[diffusion]" in extras["app"]
    assert any(r.startswith("ray") for r in extras["batch"])
    assert any(r.startswith("llama-cpp-python") for r in extras["gguf"]) and "llama" not in base
    assert any(r.startswith("gguf>=") for r in project["dependencies"])  # F16 / Q8_0 GGUF need no extra
    assert any(r.startswith("mlx-lm") for r in extras["mlx"]) and "mlx" not in base
    assert extras["all"] == ["converter[diffusion,app,batch,gguf,mlx]"]
    pinned = [r for r in project["dependencies"] + sum(extras.values(), []) if "==" in r.split(";")[0]]
    assert not pinned  # ranges, not pins (a marker's `sys_platform == ...` is no pin)


@pytest.fixture
def without(monkeypatch):
    """Make an optional package unimportable, as in an install without its extra."""

    def hide(module: str) -> None:
        for name in [m for m in sys.modules if m == module or m.startswith(f"{module}.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, module, None)

    return hide


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    from diffusion_helpers import TE_TARGETS, UNET_TARGETS, kohya_lora, kohya_modules, make_pipeline, save

    root = tmp_path_factory.mktemp("sd")
    models = make_pipeline(root / "base", "sd15")
    modules = kohya_modules(models["unet"], "lora_unet", UNET_TARGETS) | kohya_modules(
        models["text_encoder"], "lora_te", TE_TARGETS
    )
    return root / "base", save(kohya_lora(modules, rank=2), root / "lora.safetensors")


DIFFUSERS_MISSING = (
    "error: verifying a diffusion merge needs diffusers, which is not installed: pip install 'converter[diffusion]'"
)


def test_without_diffusers_a_diffusion_merge_is_refused_before_anything_is_written(sd, tmp_path, cli, without):
    base, lora = sd
    without("diffusers")
    code, out, err = cli("merge", "--base", base, "--adapter", lora, "--out", tmp_path / "merged", verify=True)
    assert code == 2 and err.strip() == DIFFUSERS_MISSING, out + err
    assert not (tmp_path / "merged").exists()
    code, out, err = cli("merge", "--base", base, "--adapter", lora, "--out", tmp_path / "unverified")
    assert code == 0, err  # --no-verify needs no referee


def test_without_diffusers_verification_is_never_done_by_a_weaker_referee(sd, tmp_path, cli, without):
    """Verifying a merged folder: the published formula must not stand in for diffusers because it is missing."""
    from converter.engine.recipe import AdapterSpec, Recipe
    from converter.jobs.pipeline import verify_folder

    base, lora = sd
    code, _, err = cli("merge", "--base", base, "--adapter", lora, "--out", tmp_path / "merged")
    assert code == 0, err
    without("diffusers")
    recipe = Recipe(base=str(base), adapters=[AdapterSpec(str(lora), 1.0)])
    with pytest.raises(MissingExtraError, match=r"pip install 'converter\[diffusion\]'") as caught:
        verify_folder(tmp_path / "merged", recipe, log=lambda _: None)
    assert caught.value.extra == "diffusion" and caught.value.package == "diffusers"
    assert not (tmp_path / "merged" / "verification.json").exists()
    code, out, err = cli("verify", tmp_path / "merged")
    assert code == 2 and err.strip() == DIFFUSERS_MISSING, out + err


def test_without_ray_batch_is_one_line_and_writes_nothing(tmp_path, cli, without):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("jobs:\n  - merge: me/out\n    base: org/base\n    adapter: org/lora\n")
    without("ray")
    code, out, err = cli("batch", jobs)
    assert code == 2 and out == ""
    assert err == "error: converter batch needs ray, which is not installed: pip install 'converter[batch]'\n"
    assert [p.name for p in tmp_path.iterdir()] == ["jobs.yaml"]


def test_without_gradio_the_app_says_which_extra_to_install():
    code = "import runpy, sys; sys.modules['gradio'] = None; runpy.run_path('app.py', run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == (
        "error: the converter app needs gradio, which is not installed: pip install 'converter[app]'\n"
    )


def test_the_testing_utility_ships_and_needs_no_test_tools(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {"converter/testing/__init__.py", "converter/testing/hub/__init__.py", "converter/testing/hub/jobs.py",
            "converter/testing/training_checkpoints.py"} <= names  # fmt: skip
    assert "Requires-Dist: pytest" in metadata and 'extra == "test"' in metadata  # test tools: the test extra only
    code = ("import sys; import converter.testing.hub, converter.testing.training_checkpoints\n"
            "print([m for m in ('pytest', 'hypothesis', 'playwright', 'gguf', 'gradio', 'diffusers', 'ray')"
            " if m in sys.modules])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == []


DOCUMENTED_API = {  # what the Python API page imports, module -> names
    "converter": ["Recipe", "AdapterSpec", "merge", "push", "verify", "push_folder", "convert", "extract", "resize",
                  "combine", "inspect", "deploy", "errors", "ConverterError", "VerificationFailed", "Outcome",
                  "Verdict", "__version__", "push_pr", "ConvertOptions", "ExtractOptions", "ResizeOptions",
                  "CombineOptions", "PushOptions"],
    "converter.jobs.describe": ["render"],
    "converter.jobs.pipeline": ["STAGES"],
    "converter.hub.publish": ["PushResult"],
    "converter.conversion.pr": ["push_pr", "PullRequest"],
    "converter.outcome": ["Outcome", "Verdict", "last_outcome"],
    "converter.jobs.demo": ["build_demo_inputs"],
    "converter.errors": ["ConverterError", "UsageError", "BadInputError", "AdapterFormatError", "RecipeError",
                         "KeymapError", "CheckpointError", "CheckpointNotFound", "NoModelWeights", "OutputError",
                         "HubError", "PushError", "VerificationFailed", "NotVerified",
                         "MissingExtraError"],
    "converter.testing.hub": ["HubServer", "run_client", "client_env", "hub_env"],
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(DOCUMENTED_API))
def test_the_python_api_offers_what_its_page_shows(module):
    import importlib

    loaded = importlib.import_module(module)
    missing = [name for name in DOCUMENTED_API[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} lacks {missing}"
    exported = getattr(loaded, "__all__", None)
    if exported is not None:
        assert set(DOCUMENTED_API[module]) <= set(exported) | {"__version__"}, f"{module}.__all__: {exported}"


def test_without_diffusers_the_app_job_fails_with_the_readable_line_and_pushes_nothing(demo_hub, tmp_path):
    """The Space's job on a kohya SD merge, where diffusers is missing: the one line, nothing on the Hub."""
    from converter.app.local import MOCK_TOKEN, SD_BASE, SD_LORA
    from converter.testing.hub import run_client

    code = f"""
import sys
sys.modules["diffusers"] = None
from pathlib import Path
from converter.app.merge_job import JobRequest, run_job
from converter.errors import MissingExtraError
try:
    run_job(JobRequest(base={SD_BASE!r}, adapters={SD_LORA!r}, repo_id="demo/no-diffusers"), {MOCK_TOKEN!r},
            workroot=Path({str(tmp_path / "jobs")!r}), log=lambda line: None)
except MissingExtraError as e:
    print("refused:", e)
"""
    out = run_client(demo_hub, code, token=MOCK_TOKEN, home=tmp_path / "home", timeout=600).stdout
    assert out == f"refused: {DIFFUSERS_MISSING.removeprefix('error: ')}\n"
    assert not demo_hub.exists("demo/no-diffusers") and not list((tmp_path / "jobs").iterdir())
