"""The tensor proof of a pipelined push, shard by shard: each output shard is proven the moment the merge has
written it, before its upload starts, so a wrong tensor stops the job before its shard leaves the machine (and
the push commits nothing; the repo it created is deleted). When every shard has come, the proof's verdict is the
verification's tensor proof: the output is not read a second time.

The referee is built on the upload thread at the first shard (transformers and PEFT imported beside the merge,
not before it). Where a per-shard proof cannot run (a training checkpoint as the base, whose referees need it
written unmerged first; a 4-bit output; a referee that needs the finished output, such as the vocabulary size of
a resized embedding), `check` does nothing and verification proves the finished folder as it always does, still
before the one commit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from converter.engine.bnb4 import parse_output
from converter.engine.recipe import Recipe
from converter.engine.writer import Shard
from converter.errors import VerificationFailed
from converter.io.scratch import temp_folder
from converter.training import is_training_checkpoint
from converter.verification import sources
from converter.verification.judge import judge_tensors
from converter.verification.prove import open_proof
from converter.verification.referee import Referee, RefereeUnavailable
from converter.verification.tensors import TensorProof, TensorProofResult
from converter.verification.warmup import wait


class ShardProof:
    """`check(shard)` for `push(check_shard=...)`; `finish()` the verdict once the merge is done."""

    def __init__(
        self,
        recipe: Recipe,
        *,
        token: str | None = None,
        log: Callable[[str], None] = print,
        base: Path | None = None,
    ):
        """`base`: the base as the merge reads it, when the job already has it (a streamed download, whose
        tensors are on disk by the time the merge has written a shard of them); else it is fetched."""
        self.recipe, self.token, self.log, self.base = recipe, token, log, base
        self.proof: TensorProof | None = None
        self.declined: str | None = _declined(recipe)
        self._resources = ExitStack()
        self._lock = threading.Lock()

    def check(self, shard: Shard) -> None:
        """Prove every tensor of this shard; VerificationFailed (naming the tensor, its module and how far off
        in units of its rounding bound) when one is wrong."""
        with self._lock:
            proof = self._open()
            if proof is None:
                return
            try:
                checks = proof.check_file(shard.path, _prefix(shard.name))
            except RefereeUnavailable as e:  # verification says it again, after the merge, before any commit
                self.proof, self.declined = None, str(e)
                return
            if all(c.ok for c in checks):
                return
            problems = judge_tensors(proof.result())[0]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            self.declined = "a shard failed"
            raise VerificationFailed(f"verification failed: tensor proof of {shard.name}: {problems[0]}{more}")

    def open(self) -> bool:
        """Build the referee now, before the merge: whether shards will be proven as they come (False: the proof
        reads the finished output)."""
        with self._lock:
            return self._open() is not None

    def finish(self) -> tuple[TensorProofResult, Referee] | None:
        """The tensor proof over every shard that came (tensors that never came are missing), or None when the
        per-shard proof did not run (verification then proves the finished folder)."""
        with self._lock:
            if self.proof is None:
                return None
            proof, self.proof = self.proof, None
            return proof.result(), proof.referee

    def close(self) -> None:
        self._resources.close()

    def _open(self) -> TensorProof | None:
        if self.proof is not None or self.declined is not None:
            return self.proof

        wait()
        base, adapters = sources(self.recipe, self.token, base=self.base)
        scratch = Path(self._resources.enter_context(temp_folder("proof", log=self.log)))
        try:
            self.proof, _ = open_proof(Path(self.recipe.out), self.recipe, base, adapters, scratch)
            self._resources.callback(self.proof.close)
        except RefereeUnavailable as e:  # verification says it again, after the merge, before any commit
            self.declined = str(e)
            self.log(f"tensor proof: after the merge ({e})")
            return None
        self.log(f"tensor proof: each output shard against the base and the {self.proof.referee.info.name} "
                 "referee, before it is uploaded")  # fmt: skip
        return self.proof


def _declined(recipe: Recipe) -> str | None:
    """Why shards cannot be proven as they come (None: they can)."""
    if parse_output(recipe.dtype) is not None:
        return "a 4-bit output is judged by its behaviour"
    if recipe.base and is_training_checkpoint(Path(recipe.base)):
        return "the base is a training checkpoint, proven once written unmerged"
    return None


def _prefix(name: str) -> str:
    """The namespace of a shard's tensors: a diffusers component's folder ("unet/"), else none."""
    folder, _, _ = name.rpartition("/")
    return f"{folder}/" if folder else ""
