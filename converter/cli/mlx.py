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


def prepare_push(args: argparse.Namespace, base: str | None, log: Callable[[str], None]):
    """`push --mlx`: types, extra and base checked, the pending folders (None without --mlx); from `--from FOLDER`,
    written and proven now."""
    types = check(args, args.from_folder or base)
    if not types:
        return None
    from converter.mlx.publish import PendingMLX

    pending = PendingMLX(types, args.repo.split("/")[-1], log)
    if args.from_folder:
        try:
            pending.export(args.from_folder, base_model=args.repo)
        except BaseException:
            pending.discard()
            raise
    return pending


def export_pending(pending, folder, args: argparse.Namespace, merged: bool) -> None:
    """A merging push's MLX folders, written and proven inside the push, before its commit (a --from folder's
    were made in prepare_push)."""
    if pending is not None and merged:
        pending.export(folder, base_model=args.repo)


def finish_push(pending, args: argparse.Namespace, log: Callable[[str], None]) -> list:
    """Each MLX repo's push, after the model's own; their Published records."""
    if pending is None:
        return []
    pushed = pending.push(args.repo, token=args.token, private=args.private)
    for p in pushed:
        log(f"MLX: {p.summary()}")
    return [p.published() for p in pushed]


def discard(pending) -> None:
    if pending is not None:
        pending.discard()


def with_proofs(outcome: Outcome, pending) -> Outcome:
    return outcome.with_proofs(pending.result.as_proofs()) if pending is not None and pending.result else outcome
