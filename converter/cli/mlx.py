"""`--mlx TYPE[,TYPE...]` on merge and push: argument parsing and printing only (converter.mlx does the work)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from converter.outcome import Outcome

HELP = ("also write the merged model as MLX folders of these types, as mlx-lm writes them, proven by mlx-lm: "
        "4bit, 8bit, bf16 (comma-separated; needs converter[mlx])")  # fmt: skip


def add_option(p: argparse.ArgumentParser, push: bool = False) -> None:
    where = "into the repos REPO-4bit, REPO-8bit, REPO-bf16" if push else "into the folders OUT-4bit, OUT-8bit ..."
    p.add_argument("--mlx", metavar="TYPE[,TYPE...]", help=f"{HELP}; {where}")


def check(args: argparse.Namespace, base: str | None):
    """The types, the extra and the base, before the merge (None without --mlx: nothing of converter.mlx imported)."""
    if not getattr(args, "mlx", None):
        return None
    from converter.mlx.export import check as check_mlx

    return check_mlx(getattr(args, "mlx", None), base, getattr(args, "token", None))


def export_merged(folder, types, outcome: Outcome, log: Callable[[str], None], force: bool = False) -> Outcome:
    """After a merge: OUT-<type> beside it, proven; the outcome with their proofs and folders."""
    from converter.mlx.export import PROOF_FILE, export, folder_for

    folder = Path(folder)
    result = export(folder, types, {t.name: folder_for(folder, t) for t in types}, force=True, log=log)
    log(f"MLX: {', '.join(str(f) for f in result.folders)} (proof: {PROOF_FILE})")
    outcome = outcome.with_proofs(result.as_proofs())
    return replace(outcome, files=outcome.files + tuple(result.files()))
