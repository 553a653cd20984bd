"""A module imported on first attribute access, so a plain LoRA merge never pays for importing torch (~1 s).

`from converter.io.lazy import torch` gives an object that behaves like the torch module once touched; modules on
the merge path use it instead of `import torch`, and only the patches that need torch (LoHa, LoKr, DoRA, conv,
4-bit, task merges) touch it. tests/cli/test_errors.py checks a plain merge leaves torch out of sys.modules.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule:
    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def _load(self) -> ModuleType:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return self._module

    def __getattr__(self, attr: str):
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name}{' (loaded)' if self._module is not None else ''}>"


torch = LazyModule("torch")
