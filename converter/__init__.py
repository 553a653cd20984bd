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
    "CombineOptions": ("converter.methods.options", "CombineOptions"),
    "ConvertOptions": ("converter.conversion.options", "ConvertOptions"),
    "ExtractOptions": ("converter.methods.options", "ExtractOptions"),
    "HubServer": ("converter.testing.hub", "HubServer"),
    "PushOptions": ("converter.jobs.options", "PushOptions"),
    "Recipe": ("converter.engine.recipe", "Recipe"),
    "ResizeOptions": ("converter.methods.options", "ResizeOptions"),
    "build_demo_inputs": ("converter.jobs.demo", "build_demo_inputs"),
    "combine": ("converter.methods.combination", "combine"),
    "convert": ("converter.jobs.convert", "convert"),
    "deploy": ("converter.app.deploy", "deploy"),
    "extract": ("converter.methods.extraction", "extract"),
    "inspect": ("converter.jobs.describe", "inspect_path"),
    "last_outcome": ("converter.outcome", "last_outcome"),
    "merge": ("converter.engine.merging", "merge"),
    "plan_on_jobs": ("converter.jobs.remote", "plan"),
    "push": ("converter.jobs.pipeline", "push"),
    "push_folder": ("converter.hub.publish", "push_folder"),
    "push_pr": ("converter.conversion.pr", "push_pr"),
    "render_inspect": ("converter.jobs.describe", "render"),
    "report_markdown": ("converter.verification.render", "markdown"),
    "resize": ("converter.methods.resizing", "resize"),
    "run_on_jobs": ("converter.jobs.remote", "run"),
    "verify": ("converter.jobs.pipeline", "verify_folder"),
}

__all__ = [
    "AdapterSpec", "CombineOptions", "ConvertOptions", "ConverterError", "ExtractOptions", "HubServer",
    "NotVerified", "Outcome", "PushOptions", "Recipe", "ResizeOptions", "Verdict", "VerificationFailed",
    "__version__", "build_demo_inputs", "combine", "convert", "deploy", "errors", "extract", "inspect",
    "last_outcome", "merge", "plan_on_jobs", "push", "push_folder", "push_pr", "render_inspect", "report_markdown",
    "resize", "run_on_jobs", "verify"
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
