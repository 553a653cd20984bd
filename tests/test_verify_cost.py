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
    out = run(
        """
        import sys
        from converter.verify.warmup import import_peft
        import_peft()
        import peft, peft.helpers
        print("after peft:", "bitsandbytes" in sys.modules, peft.helpers.bnb)
        from peft.import_utils import is_bnb_4bit_available, is_bnb_available
        import bitsandbytes
        print("later:", is_bnb_available(), is_bnb_4bit_available(), bitsandbytes.nn.Linear4bit.__name__)
        """
    )
    assert "after peft: False None" in out and "later: True True Linear4bit" in out


def test_reused_heap_serves_row_blocks_without_fresh_pages():
    """40 blocks of 16 MiB (the proof's float32 row block) allocated, written and freed in turn: inside the
    context the pages of the first block are reused (a fresh one each time would be 40 x 4096 page faults)."""
    out = run(
        """
        import resource, torch
        from converter.verify.heap import reused_heap

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
