"""Import what verification needs while the merge runs.

Why: transformers + PEFT (+ bitsandbytes, which PEFT imports) take ~4-5 s of CPU to import, a fifth of the default
`converter merge` of the 0.85 B bench model; the merge is mostly file I/O and torch kernels that release the GIL, so
a thread importing them beside it hides much of that time. It is started only when verification follows, so
`converter merge --no-verify` still never imports them, and only after the merge's own imports are done, so the
two threads never import the same module at once; verification waits for the thread before it imports anything
(transformers' lazy attributes are not safe to import from two threads: `AutoTokenizer` came back missing). A
failure here is ignored: verification imports again itself.
"""

from __future__ import annotations

import threading

from converter.engine.model_class import WARMUP_THREAD

_started: list[threading.Thread] = []


def _imports() -> None:
    try:
        import peft  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    except Exception:  # noqa: BLE001 (verification's own import reports it)
        pass


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
