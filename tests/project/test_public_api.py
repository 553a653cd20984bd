"""The package's face and its bones: one import path for callers (`from converter import merge, push, verify ...`),
cheap to import, each public name the function whatever was imported before; and the tree keeps its layers where
import-linter cannot look (names, not modules: no `_private` name is imported from another package)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import converter

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "peft", "accelerate", "diffusers", "gradio", "ray", "bitsandbytes")


def _imported_after(code: str) -> list[str]:
    code += f"\nimport sys, json; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(out.splitlines()[-1])


def test_import_converter_imports_no_heavy_library():
    assert _imported_after("import converter; converter.Recipe, converter.errors.ConverterError") == []


def test_the_help_imports_no_heavy_library():
    code = "import contextlib, io\nfrom converter.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n"
    code += "    try:\n        main(['--help'])\n    except SystemExit:\n        pass"
    assert _imported_after(code) == []


@pytest.mark.parametrize("name", converter.__all__)
def test_each_public_name_resolves(name):
    assert getattr(converter, name) is not None
    assert name in dir(converter)


def test_the_lazy_names_are_the_public_ones():
    assert set(converter._LAZY) <= set(converter.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        converter.nothing  # noqa: B018


def test_each_verb_is_the_function_whatever_was_imported_before():
    """No module of the package is named after a public function, so importing one never replaces it."""
    verbs = [n for n in converter.__all__ if n[0].islower() and n not in ("errors", "__version__")]
    modules = sorted({converter._LAZY[n][0] for n in verbs})
    code = f"import {', '.join(modules)}\nimport converter\n"
    code += f"print(' '.join(type(getattr(converter, n)).__name__ for n in {verbs!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["function"] * len(verbs)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_private_name_is_imported_from_another_package():
    """import-linter sees modules; this sees names: a `_name` used from another package should be public."""
    crossing = []
    for path in sorted((ROOT / "converter").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("converter."):
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and _package(node.module) != _package(module):
                        crossing.append(f"{module}: from {node.module} import {alias.name}")
    assert crossing == []


def test_the_python_api_page_imports_only_from_converter():
    """docs/python-api.md shows the one import path: its code imports `converter`'s public names, no module of it."""
    page = (ROOT / "docs" / "python-api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert blocks
    wrong = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "converter":
                if node.module != "converter":
                    wrong.append(f"from {node.module} import ...")
                wrong += [f"from converter import {a.name}" for a in node.names if a.name not in converter.__all__]
            elif isinstance(node, ast.Import):
                wrong += [f"import {a.name}" for a in node.names if a.name.startswith("converter.")]
    assert wrong == []
