"""Optional dependencies: import one, or say in one line which extra to install.

Why: the base install (`pip install converter`) merges and verifies LLM adapters; diffusers (`converter[diffusion]`),
Gradio (`converter[app]`), Ray (`converter[batch]`)
and llama.cpp (`converter[gguf]`) come with extras. Without this, a missing one surfaced as a
traceback, or worse, as a silent downgrade (a diffusion merge "verified" by a weaker referee because diffusers'
loader failed to import). Every import of an optional package goes through `require`.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from converter.errors import MissingExtraError

#: module -> (the package to install, the extra of converter that brings it)
EXTRAS = {
    "diffusers": ("diffusers", "diffusion"),
    "gradio": ("gradio", "app"),
    "ray": ("ray", "batch"),
    "llama_cpp": ("llama-cpp-python", "gguf"),
}


def install_hint(extra: str) -> str:
    return f"pip install 'converter[{extra}]'"


def check(module: str, why: str) -> None:
    """Like `require`, without importing it (for a caller that must set the environment up first: gradio and
    diffusers import huggingface_hub, which reads HF_ENDPOINT at import time)."""
    if importlib.util.find_spec(module) is None:
        package, extra = EXTRAS[module]
        raise MissingExtraError(
            f"{why} needs {package}, which is not installed: {install_hint(extra)}", package=package, extra=extra
        )


def require(module: str, why: str) -> ModuleType:
    """Import `module` (a key of EXTRAS), or raise MissingExtraError: "`why` needs `package`, which is not
    installed: pip install 'converter[extra]'". `why` says what needed it, e.g. "verifying a diffusion merge"."""
    package, extra = EXTRAS[module]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != module:
            raise  # the package is there but one of its own dependencies is not: its traceback says which
        raise MissingExtraError(
            f"{why} needs {package}, which is not installed: {install_hint(extra)}", package=package, extra=extra
        ) from None
