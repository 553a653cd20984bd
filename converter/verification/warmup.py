"""Import what verification needs while the merge runs.

Why: importing transformers + PEFT takes seconds of CPU; the merge is mostly file I/O and kernels that release the
GIL, so a thread importing them beside it hides much of that time. It is started only when verification follows, so
`converter merge --no-verify` still never imports them, and only once the merge has found and planned its inputs
(`merge(on_planned=)`), so input that fails is refused in a second, without them, and the merge's own imports are
done: the two threads never import the same module at once; verification waits for the thread before it imports anything
(transformers' lazy attributes are not safe to import from two threads: `AutoTokenizer` came back missing). A
failure here is ignored: verification imports again itself.
"""

from __future__ import annotations

import threading

from converter.engine.model_class import WARMUP_THREAD

_started: list[threading.Thread] = []


def _imports() -> None:
    try:
        import_peft()
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    except Exception:  # noqa: BLE001 (verification's own import reports it)
        pass


class _NoBitsandbytesForPeftHelpers:
    """A meta path finder that fails `import bitsandbytes` when it comes from `peft.helpers`, and from nowhere else
    (see `import_peft`)."""

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
    """Import PEFT so that it imports bitsandbytes only once a 4-bit layer exists.

    Why: bitsandbytes compiles kernels with torch.compile when imported, which imports torch's inductor: about 1.5 s
    of CPU that a merge without 4-bit layers never needs (a tenth of its verification). PEFT imports it in two places
    regardless: peft.helpers at import (for a function verification never calls; here that import fails quietly,
    as if bitsandbytes were absent, and no other import is touched), and LoRA's layer dispatch whenever bitsandbytes
    is installed. A bitsandbytes layer cannot exist before bitsandbytes is imported (transformers imports it to load
    a 4-bit model, our 4-bit code to quantize), so LoRA's dispatch is told bitsandbytes is there only once it is.
    """
    import sys

    if "peft" not in sys.modules:
        finder = _NoBitsandbytesForPeftHelpers()
        sys.meta_path.insert(0, finder)
        try:
            import peft  # noqa: F401
        finally:
            sys.meta_path.remove(finder)
    from peft.tuners.lora import model as lora_model

    for name in ("is_bnb_available", "is_bnb_4bit_available"):
        original = getattr(lora_model, name, None)
        if original is not None and not hasattr(original, "once_imported"):
            setattr(lora_model, name, _once_imported(original))


def _once_imported(available):
    """`available()` once bitsandbytes is imported; False before (no layer of it can exist yet)."""
    import sys

    def check() -> bool:
        return "bitsandbytes" in sys.modules and available()

    check.once_imported = True
    return check


def start() -> threading.Thread:
    """Begin importing in a daemon thread; the merge's own heavy imports first, in this thread."""
    import huggingface_hub  # noqa: F401
    import torch  # noqa: F401
    import yaml  # noqa: F401

    thread = threading.Thread(target=_imports, name=WARMUP_THREAD, daemon=True)
    thread.start()
    _started.append(thread)
    return thread


def wait() -> None:
    """Let a warm-up still importing finish, so this thread never imports the same modules at the same time."""
    while _started:
        _started.pop().join()
