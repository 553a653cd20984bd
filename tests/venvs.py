"""Virtual environments built the way users build them: pip, torch==2.13.0 first, then the package with the tested
pins (constraints.txt), offline from the wheelhouse `make wheelhouse` fills (every pinned wheel, downloaded once).

Why this is cheap enough for every `make test`: nothing is downloaded or byte-compiled (`--no-index`,
`--no-compile`), torch is installed once, and each environment that adds to another starts as a hard-linked copy
of it (`cp -al`: a second, not a reinstall; pip replaces files by new ones, so the copies never write into each
other). A copy holds exactly what a fresh install of its extra set would hold: the pins decide every version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
TORCH = "torch==2.13.0"  # first and pinned: resolved as a dependency, pip would take the CUDA build


def wheelhouse() -> Path:
    """Where `make wheelhouse` put the pinned wheels; a test that needs them fails in CI and skips elsewhere."""
    folder = Path(os.environ.get("CONVERTER_WHEELHOUSE", Path.home() / ".cache" / "converter-wheelhouse"))
    key = hashlib.sha256(CONSTRAINTS.read_bytes()).hexdigest()[:12]  # the Makefile's stamp for these pins
    if not (folder / f".complete-{key}").is_file():
        message = f"{folder}: no wheelhouse of the pinned set; `make wheelhouse` (run by `make test`) fills it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return folder


def user_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) as a user's shell would have it: no PYTHONPATH, which would put this
    checkout (or the test run's own packages) on the fresh venv's path and hide what the venv itself holds."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONPATH"}


class Venv:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.python = path / "bin" / "python"

    @classmethod
    def create(cls, path: Path) -> Venv:
        """An empty venv (no pip of its own: the test's pip installs into it with --python)."""
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
        return cls(path)

    def clone(self, path: Path) -> Venv:
        """A hard-linked copy (seconds, little disk), to install more into."""
        subprocess.run(["cp", "-al", str(self.path), str(path)], check=True)
        return Venv(path)

    def install(self, *requirements: str | Path, constraints: bool = True, options: tuple[str, ...] = ()) -> str:
        cmd = [sys.executable, "-m", "pip", "--python", str(self.python), "install", "--no-index", "--find-links",
               str(wheelhouse()), "--no-compile", "--disable-pip-version-check", "--no-input", *options]  # fmt: skip
        if constraints:
            cmd += ["-c", str(CONSTRAINTS)]
        proc = subprocess.run([*cmd, *map(str, requirements)], capture_output=True, text=True, timeout=900,
                              env=user_env())  # fmt: skip
        assert proc.returncode == 0, f"{' '.join(cmd)} {requirements}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    def run(self, *args: str | Path, env: dict[str, str], cwd: Path, timeout: float = 900):
        """A command of this venv (`converter`, `python`), with bytecode written: the first process compiles what it
        imports (nothing is compiled at install), the later ones and the copies made after it reuse that."""
        env = {k: v for k, v in user_env(env).items() if k != "PYTHONDONTWRITEBYTECODE"}
        command = [str(self.path / "bin" / str(args[0])), *map(str, args[1:])]
        return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)

    def packages(self) -> dict[str, str]:
        """Installed distributions, canonical name -> version."""
        code = ("import importlib.metadata as m, json, re\n"
                "print(json.dumps({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(): d.version "
                "for d in m.distributions()}))")  # fmt: skip
        # run from the venv's folder: from a checkout, `-c` would also list the checkout's own converter.egg-info
        out = subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, check=True, cwd=self.path,
                             env=user_env())  # fmt: skip
        return json.loads(out.stdout)

    def check(self) -> None:
        """pip check: every installed package's requirements are met."""
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(self.python), "check"],
                              capture_output=True, text=True, cwd=self.path, env=user_env())  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def size(self) -> int:
        """Bytes of the environment, as a fresh install would take (hard links counted in full)."""
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file() and not p.is_symlink())

    def remove(self) -> None:
        """In the background: tens of thousands of files; the run need not wait for them to go."""
        subprocess.Popen(["rm", "-rf", str(self.path)], start_new_session=True)


def build_wheel(out: Path) -> Path:
    """converter's wheel, built from a copy of the checkout (no build folder in the tree; no network: the build
    backend is this venv's setuptools)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("converter", "keymaps"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out / "dist")], cwd=src, check=True, capture_output=True)  # fmt: skip
    (wheel,) = (out / "dist").glob("converter-*.whl")
    return wheel


ARTIFACTS = ROOT / "tests" / "artifacts"
_MEASURED: dict[str, dict] = {}


def record(name: str, venv: Venv, install) -> Venv:
    """Run `install` into `venv`, and write what it cost (seconds, bytes of the venv) to tests/artifacts."""
    started = time.monotonic()
    install()
    _MEASURED[name] = {"install_seconds": round(time.monotonic() - started, 1), "bytes": venv.size()}
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "install.json").write_text(json.dumps(_MEASURED, indent=2) + "\n")
    return venv
