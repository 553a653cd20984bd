"""The repos published beside a push (`PushOptions.gguf`: `<repo>-GGUF`; `PushOptions.mlx`: `<repo>-4bit` ...), as
push() runs them for every front end: the CLI, the Space and the Python API.

Why in one place: each is checked before anything runs (types, extras, the base's architecture), written and
proven from the merged folder inside the push, just before the model's commit, so a failed proof commits nothing
anywhere; pushed after the model; and its scratch folder is removed whatever happens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from converter.engine.merging import TensorTee
from converter.hub.publish import PushResult
from converter.jobs.options import PushOptions
from converter.outcome import Proofs


def _pending_gguf(types: str, source: str | None, name: str, token: str | None, log, workdir):
    from converter.gguf.export import check_merge_gguf, is_diffusion_source, names_single_file
    from converter.gguf.publish import PendingGGUF

    checked = check_merge_gguf(types, source, token)  # (a diffusion model's types too)
    if source and (names_single_file(source) or is_diffusion_source(source)):
        from converter.gguf.diffusion_publish import PendingDiffusionGGUF

        return PendingDiffusionGGUF(checked, name, log, workdir=workdir)
    return PendingGGUF(checked, name, log, workdir=workdir)


def _pending_mlx(types: str, source: str | None, name: str, token: str | None, log, workdir):
    from converter.mlx.export import check
    from converter.mlx.publish import PendingMLX

    return PendingMLX(check(types, source, token), name, log, workdir=workdir)


class Companions:
    """The GGUF and MLX exports of one push: None for each not asked for."""

    def __init__(self, repo_id: str, options: PushOptions, source: str | None, token: str | None,
                 log: Callable[[str], None], workdir: str | Path | None = None):  # fmt: skip
        """Checked now, before any download; `source`: the base being merged, or the folder pushed."""
        name = repo_id.split("/")[-1]
        self.repo_id, self.log = repo_id, log
        self.gguf = _pending_gguf(options.gguf, source, name, token, log, workdir) if options.gguf else None
        try:
            self.mlx = _pending_mlx(options.mlx, source, name, token, log, workdir) if options.mlx else None
        except BaseException:
            self.discard()
            raise

    @property
    def asked(self) -> bool:
        return self.gguf is not None or self.mlx is not None

    def tee(self) -> TensorTee | None:
        """For a merging push: the GGUF files written as the merge streams (a language model's; None otherwise)."""
        return self.gguf.tee() if self.gguf is not None else None

    def export(self, folder: str | Path, report=None) -> None:
        """Write and prove every export from `folder`; a failed proof raises (VerificationFailed)."""
        if self.gguf is not None:
            self.gguf.export(folder, report)
        if self.mlx is not None:
            self.mlx.export(folder, base_model=self.repo_id)

    def push(self, *, token: str | None, private: bool) -> tuple[PushResult, ...]:
        """Each repo's push, after the model's own, each told in one line."""
        pushed = []
        for what, pending in (("GGUF", self.gguf), ("MLX", self.mlx)):
            if pending is None:
                continue
            done = pending.push(self.repo_id, token=token, private=private)
            for result in done if isinstance(done, list) else [done]:
                self.log(f"{what}: {result.summary()}")
                pushed.append(result)
        return tuple(pushed)

    def proofs(self) -> Proofs:
        """Every exported file's proof."""
        done = [pending.result for pending in (self.gguf, self.mlx) if pending is not None and pending.result]
        return sum((result.as_proofs() for result in done), Proofs())

    def discard(self) -> None:
        for pending in (getattr(self, "gguf", None), getattr(self, "mlx", None)):
            if pending is not None:
                pending.discard()
