"""converter: fold LoRA adapters into base models exactly, stream the result, and prove it.

One import path for Python callers: `from converter import merge, push, verify, Recipe, AdapterSpec, errors ...`
(docs/python-api.md). The names load their modules on first use (as huggingface_hub's top level does), so
`import converter` stays cheap: torch, transformers, peft, diffusers and gradio are imported only by the functions
that need them. No module of the package has the name of one of these functions, so importing any of them never
replaces the function here.
"""

from __future__ import annotations

import importlib

from converter import errors
from converter.errors import ConverterError, NotVerified, VerificationFailed
from converter.outcome import Outcome, Verdict

__version__ = "0.1.0"

# The packages that register readers of bases with converter.engine.readers (training checkpoints): the engine opens
# them without naming them, and imports these on its first open.
BASE_READER_PACKAGES = ("converter.training",)

# public name -> (module, attribute in it). Paths as strings: nothing is imported until asked for, and the
# layers contract never sees this package as importing every layer (the engine reads `__version__` from here).
_LAZY = {
    "AdapterSpec": ("converter.engine.recipe", "AdapterSpec"),
    "Recipe": ("converter.engine.recipe", "Recipe"),
    "combine": ("converter.methods.combination", "combine"),
    "convert": ("converter.jobs.convert", "convert"),
    "deploy": ("converter.app.deploy", "deploy"),
    "extract": ("converter.methods.extraction", "extract"),
    "inspect": ("converter.jobs.describe", "inspect_path"),
    "merge": ("converter.engine.merging", "merge"),
    "push": ("converter.jobs.pipeline", "push"),
    "push_folder": ("converter.hub.publish", "push_folder"),
    "resize": ("converter.methods.resizing", "resize"),
    "verify": ("converter.jobs.pipeline", "verify_folder"),
}

__all__ = [
    "AdapterSpec", "ConverterError", "NotVerified", "Outcome", "Recipe", "Verdict", "VerificationFailed", "__version__",
    "combine", "convert", "deploy", "errors", "extract", "inspect", "merge", "push", "push_folder", "resize", "verify",
]  # fmt: skip


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'converter' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return list(__all__)
