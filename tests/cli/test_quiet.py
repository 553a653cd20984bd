"""The command line speaks only for itself: a merge with verification prints converter's own lines and nothing
from transformers, PEFT, bitsandbytes or huggingface_hub (their warnings, log lines and progress bars are held
back, and `-v` shows them); progress is one bar on a terminal and plain lines elsewhere; errors stay one line."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
from model_helpers import make_adapter, make_base

from converter.io import progress, quiet

# Markers of what the libraries print during a merge + verification on this stack (any one shows up in -v).
THIRD_PARTY = ("Loading weights", "Warning", "warn", "gemm_4bit", "it/s]", "%|")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("quiet")
    base = make_base(root / "base")
    return base, make_adapter(base, root / "lora", r=4, lora_alpha=8)


def converter(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: its own process, output piped (as in a script or a CI log)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSFORMERS_", "HF_HUB_DISABLE_PROGRESS"))}
    return subprocess.run([sys.executable, "-m", "converter", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def own_lines(base, adapter, out) -> list[str]:
    """What converter itself says for this merge + verification: its `log` lines through the Python API."""
    from converter.engine.merging import merge
    from converter.engine.recipe import AdapterSpec, Recipe
    from converter.jobs.pipeline import verify_folder

    lines: list[str] = []
    recipe = Recipe(base=str(base), adapters=[AdapterSpec(str(adapter), 1.0)], out=str(out))
    result = merge(recipe, log=lines.append)
    verify_folder(result.out, recipe, log=lines.append, prompts=None, max_new_tokens=16, memory=None, mode="quick")
    return lines


def shape(line: str) -> str:
    """A line with its numbers and paths blanked: timings and temp folders differ from run to run."""
    return re.sub(r"\d+(\.\d+)?", "#", re.sub(r"/\S+", "PATH", line)).strip()


def test_a_merge_with_verification_prints_only_converters_own_lines(llm, tmp_path):
    base, adapter = llm
    proc = converter("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "cli" / "merged")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""  # no warnings, no log lines, no progress bars
    printed = [shape(line) for line in proc.stdout.splitlines()]
    logged = own_lines(base, adapter, tmp_path / "api" / "merged")
    expected = [shape(line) for entry in logged for line in entry.splitlines()]
    assert printed == expected, proc.stdout
    assert "passed" in proc.stdout.lower()

    loud = converter("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "loud" / "merged", "-v")
    assert loud.returncode == 0, loud.stdout + loud.stderr
    assert any(marker in loud.stderr for marker in THIRD_PARTY), loud.stderr  # what -v shows, the default hides
    assert set(proc.stdout.splitlines()) <= set(loud.stdout.splitlines()) | {
        line
        for line in proc.stdout.splitlines()
        if re.search(r"\d", line)  # timings differ
    }


def test_an_error_stays_one_line(llm, tmp_path):
    base, _ = llm
    proc = converter("merge", "--base", base, "--adapter", tmp_path / "missing", "--out", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: ")
    assert str(tmp_path / "missing") in proc.stderr


def test_verbose_works_before_and_after_the_command():
    from converter.cli.commands import build_parser

    parser = build_parser()
    assert parser.parse_args(["-v", "inspect", "x"]).verbose
    assert parser.parse_args(["inspect", "x", "-v"]).verbose
    assert parser.parse_args(["space", "deploy", "--repo", "a/b", "--verbose"]).verbose
    assert not parser.parse_args(["inspect", "x"]).verbose


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_one_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    lines: list[str] = []
    with progress.Progress(10**7, "merging", lines.append) as bar:
        for _ in range(10):
            bar.update(10**6)
    assert len(lines) == 10 and lines[0] == "  merging:  10% 1.00 MB / 10.00 MB", lines
    assert lines[-1].startswith("  merging: 100%")

    jobs: list[str] = []
    with progress.Progress(3, "converter batch", jobs.append, unit="job", every=0) as bar:
        for i in range(3):
            bar.update(done=i + 1)
    assert jobs == [f"  converter batch: {s} {i}/3 jobs, done {i}" for i, s in ((1, " 33%"), (2, " 67%"), (3, "100%"))]

    terminal = Terminal()
    monkeypatch.setattr(progress, "bar_file", terminal)
    lines.clear()
    with progress.Progress(10**7, "merging", lines.append) as bar:
        for _ in range(10):
            bar.update(10**6)
    assert lines == []  # the bar, not lines
    drawn = terminal.getvalue()
    assert "\r" in drawn and "merging" in drawn and "\n" not in drawn.rstrip("\n")  # redrawn in place


def test_the_session_holds_back_output_below_python_and_shows_it_with_verbose(capfd):
    script = (
        "import os, sys, warnings\n"
        "from converter.io import quiet\n"
        "verbose = sys.argv[1] == '-v'\n"
        "with quiet.session(verbose) as console:\n"
        "    console.line('converter says this')\n"
        "    print('converter prints this')\n"
        "    print('a library logs this', file=sys.stderr)\n"
        "    warnings.warn('a library warns', FutureWarning)\n"
        "    os.write(2, b'a C library writes this\\n')\n"
        "    os.system('echo a child process says this')\n"
        "    console.error('error: one line')\n"
        "    assert 'C library' in console.held_back() or verbose\n"
        "print('after the session')\n"
    )
    quiet_run = subprocess.run([sys.executable, "-c", script, "-"], capture_output=True, text=True, timeout=60)
    assert quiet_run.returncode == 0, quiet_run.stderr
    assert quiet_run.stdout == "converter says this\nconverter prints this\nafter the session\n"
    assert quiet_run.stderr == "error: one line\n"
    loud = subprocess.run([sys.executable, "-c", script, "-v"], capture_output=True, text=True, timeout=60)
    assert "a library logs this" in loud.stderr and "a child process says this" in loud.stdout
    assert "a library warns" in loud.stderr and "a C library writes this" in loud.stderr
    assert quiet.TAIL > 0
