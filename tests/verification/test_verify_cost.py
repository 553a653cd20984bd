"""What keeps verification's CPU down, each checked for what it promises (not for time: that is bench/).

- PEFT is imported without the eager bitsandbytes import of peft.helpers (bitsandbytes compiles kernels with
  torch.compile at import), and bitsandbytes still imports, and PEFT still sees it, when a 4-bit layer needs it.
- Inside `reused_heap()` the proof's row blocks are served from the heap again and again instead of fresh pages.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_peft_imports_without_bitsandbytes_which_still_imports_when_needed():
    """A LoRA built by PEFT on plain layers leaves bitsandbytes unimported; once it is imported (as transformers
    does to load a 4-bit model), PEFT's dispatch sees it and wraps a 4-bit layer with its 4-bit LoRA."""
    out = run(
        """
        import sys, torch
        from converter.verification.warmup import import_peft
        import_peft()
        import peft, peft.helpers
        from peft import LoraConfig, inject_adapter_in_model
        plain = torch.nn.Sequential(torch.nn.Linear(8, 8))
        plain = inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"]), plain)
        print("plain:", type(plain[0]).__name__, "bitsandbytes" in sys.modules, peft.helpers.bnb)
        import bitsandbytes as bnb
        four = torch.nn.Sequential(bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32))
        four.is_loaded_in_4bit = True  # as transformers marks a model it loaded in 4-bit
        four = inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"]), four)
        print("4-bit:", type(four[0]).__module__, type(four[0]).__name__)
        """
    )
    assert "plain: Linear False None" in out, out
    assert "4-bit: peft.tuners.lora.bnb Linear4bit" in out, out


def test_reused_heap_serves_row_blocks_without_fresh_pages():
    """40 blocks of 16 MiB (a layer's float32 weights in the behaviour check) allocated, written and freed in
    turn: inside the context the pages of the first block are reused (a fresh one each time would be 40 x 4096
    page faults)."""
    out = run(
        """
        import resource, torch
        from converter.verification.heap import reused_heap

        def faults(n=40):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(n):
                torch.empty(4 * 2**20, dtype=torch.float32).fill_(1.0)
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        with reused_heap():
            print("inside", faults())
        """
    )
    inside = int(out.split("inside")[1])
    assert inside < 2 * 4096, out  # at most the first block's pages, twice over
