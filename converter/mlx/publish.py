"""`push --mlx TYPES`: each proven MLX folder in a repo of its own, `<repo>-4bit`, `<repo>-8bit`, `<repo>-bf16`, one
commit each, as mlx-community names them.

Why separate repos: that is where mlx-lm (`load("org/name-4bit")`) and the Hub's MLX filter look, and it keeps the
safetensors repo loadable by transformers as it is. The folders are written and proven before anything is
uploaded, so a failed proof pushes nothing.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from converter.mlx import card, export
from converter.mlx.types import MLXType


def mlx_repo(repo_id: str, mtype: MLXType) -> str:
    return f"{repo_id}-{mtype.name}"


class PendingMLX:
    """The folders for `<repo>-<type>`, written and proven in a temporary folder before anything is committed.

    A merging push has its merged folder only inside the push: `export` runs there, as the push's `finished` hook
    just before its commit, so a failed proof raises and no repo gets a commit. `push` after the model's own push;
    `discard` in every case."""

    def __init__(self, types: list[MLXType], name: str, log: Callable[[str], None], workdir: str | Path | None = None):
        self.types, self.name, self.log = types, name, log
        self.root = Path(tempfile.mkdtemp(prefix="converter-mlx-push-", dir=workdir))
        self.result: export.MLXResult | None = None

    def export(self, folder: str | Path, base_model: str | None = None) -> None:
        targets = {t.name: self.root / f"{self.name}-{t.name}" for t in self.types}
        self.result = export.export(folder, self.types, targets, base_model=base_model, log=self.log)

    def push(self, base_repo: str, *, token: str | None, private: bool) -> list:
        """Each folder to its repo (its card naming the repo and `base_model` the pushed model); the PushResults."""
        from converter.hub.publish import push_folder

        if self.result is None:
            raise RuntimeError("MLX folders pushed before they were written")
        pushed = []
        for t, folder, fp in zip(self.types, self.result.folders, self.result.proofs, strict=True):
            repo_id = mlx_repo(base_repo, t)
            (folder / "README.md").write_text(card.card(fp, base_repo, repo_id.split("/")[-1], repo_id))
            pushed.append(push_folder(folder, repo_id, token=token, private=private, overwrite=True,
                                      message=f"Upload MLX {t.name} (converter)", log=self.log))  # fmt: skip
        return pushed

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
