"""Import what verification needs while the merge runs.

Why: transformers + PEFT take ~4 s of CPU to import, a fifth of the default
`converter merge` of the 0.85 B bench model; the merge is mostly file I/O and torch kernels that release the GIL, so
a thread importing them beside it hides much of that time. It is started only when verification follows, so
`converter merge --no-verify` still never imports them, and only after the merge's own imports are done, so the
two threads never import the same module at once; verification waits for the thread before it imports anything
(transformers' lazy attributes are not safe to import from two threads: `AutoTokenizer` came back missing). A
failure here is ignored: verification imports again itself.
"""

from __future__ import annotations

import threading

_started: list[threading.Thread] = []


def _imports() -> None:
    try:
        import_peft()
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    except Exception:  # noqa: BLE001 (verification's own import reports it)
        pass


class _NoBitsandbytesForPeftHelpers:
    """A meta path finder that fails `import bitsandbytes` when it comes from `peft.helpers` and from nowhere else.

    Why: `import peft` imports bitsandbytes eagerly in one module (peft/helpers.py, for a function verification
    never calls), and bitsandbytes compiles kernels with torch.compile at import, which imports torch's inductor:
    about 1.5 s of CPU on every verified merge, more than a tenth of the tensor proof. Everything else in PEFT imports
    bitsandbytes when a 4-bit layer is actually met, and that import (from PEFT, transformers or our own 4-bit code,
    in any thread) goes through as usual."""

    def find_spec(self, name, path=None, target=None):
        import sys

        if name == "bitsandbytes":
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_globals.get("__name__") == "peft.helpers":
                    raise ImportError("bitsandbytes is imported when a 4-bit layer needs it, not for peft.helpers")
                frame = frame.f_back
        return None


def import_peft() -> None:
    """Import PEFT without the eager bitsandbytes import of peft.helpers (see the finder above)."""
    import sys

    if "peft" in sys.modules:
        return
    finder = _NoBitsandbytesForPeftHelpers()
    sys.meta_path.insert(0, finder)
    try:
        import peft  # noqa: F401
    finally:
        sys.meta_path.remove(finder)


def start() -> threading.Thread:
    """Begin importing in a daemon thread; the merge's own heavy imports first, in this thread."""
    import huggingface_hub  # noqa: F401
    import torch  # noqa: F401
    import yaml  # noqa: F401

    from converter.model_class import WARMUP_THREAD

    thread = threading.Thread(target=_imports, name=WARMUP_THREAD, daemon=True)
    thread.start()
    _started.append(thread)
    return thread


def wait() -> None:
    """Let a warm-up still importing finish, so this thread never imports the same modules at the same time."""
    while _started:
        _started.pop().join()
