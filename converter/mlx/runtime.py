"""mlx and mlx-lm, imported on first use, or one line naming the extra to install.

Why a module: the `converter` command must not import them (nor transformers) to parse its options, and mlx-lm
prints its progress to stdout, which `--json` keeps for the outcome: everything it runs goes through `quietly`.
"""

from __future__ import annotations

import contextlib
import io
import os
from types import ModuleType

from converter.errors import MissingExtraError

INSTALL = "pip install 'converter[mlx]'"


def require(why: str) -> tuple[ModuleType, ModuleType]:
    """(mlx.core, mlx_lm.utils) on the CPU, or MissingExtraError naming the extra."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import mlx.core as mx
        import mlx_lm.utils as lm
    except ModuleNotFoundError as e:
        package = "mlx-lm" if (e.name or "").startswith("mlx_lm") else "mlx"
        raise MissingExtraError(f"{why} needs {package}, which is not installed: {INSTALL}", package=package,
                                extra="mlx") from None  # fmt: skip
    mx.set_default_device(mx.cpu)
    return mx, lm


@contextlib.contextmanager
def quietly():
    """mlx-lm's prints (quantize_model's bits per weight, convert's progress) held back."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
