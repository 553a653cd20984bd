"""The whole job, as every front end runs it: merge → card → upload."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from converter import hub
from converter.card import public_records, write_card
from converter.errors import ConverterError
from converter.merge import merge
from converter.publish import PushResult, check_repo_id, push_folder
from converter.recipe import Recipe
from converter.records import PROVENANCE_FILE, RECIPE_FILE, recorded_recipe
from converter.scratch import make_temp
from converter.verify import require_pass, verify


def push(
    repo_id: str,
    *,
    recipe: Recipe | None = None,
    folder: str | Path | None = None,
    token: str | None = None,
    private: bool = False,
    create_pr: bool = False,
    overwrite: bool = False,
    workdir: str | Path | None = None,
    verify: dict | None = None,
    log: Callable[[str], None] = print,
) -> PushResult:
    """Publish `folder`, or merge `recipe` into a temporary folder first and publish that.

    With `verify` (settings for `verify_folder`, {} for the defaults) the folder is verified first (against the
    recipe it was merged from) and nothing is uploaded when it fails.
    """
    check_repo_id(repo_id)
    if (recipe is None) == (folder is None):
        raise ConverterError("push needs either --from FOLDER or sources to merge (--base/--adapter or --recipe)")
    hub.whoami(token)  # a missing or refused token fails now, not after the merge
    tmp = None
    try:
        if recipe is not None:
            tmp = make_temp("push", workdir, log)
            recipe.out = str(tmp / repo_id.split("/")[1])
            folder = merge(recipe, token=token, log=log).out
        folder = Path(folder)
        if verify is not None and (recipe is not None or (folder / RECIPE_FILE).is_file()):
            verify_folder(folder, recipe or recorded_recipe(folder), token=token, log=log, **verify)
        replace = {}
        if (folder / PROVENANCE_FILE).is_file():
            write_card(folder, load_name=repo_id)
            replace = public_records(folder)
        return push_folder(
            folder,
            repo_id,
            token=token,
            private=private,
            create_pr=create_pr,
            overwrite=overwrite,
            replace=replace,
            log=log,
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def verify_folder(
    folder: str | Path,
    recipe: Recipe,
    *,
    token: str | None = None,
    report_path: str | Path | None = None,
    log: Callable[[str], None] = print,
    **settings,
):
    """Verify, record the report next to the model, refresh the card, and raise VerificationFailed on a fail.
    Returns the VerificationReport."""
    folder = Path(folder)
    from converter.training import is_training_checkpoint
    from converter.verify.warmup import wait

    wait()  # the warm-up import beside the merge (cli) finishes before anything here imports transformers

    if recipe.base and is_training_checkpoint(Path(recipe.base)):
        from converter.verify.training import verify_training

        report = verify_training(folder, recipe, verify, token=token, log=log, **settings)
    else:
        report = verify(folder, recipe, token=token, log=log, **settings)
    if report_path:
        Path(report_path).write_text(report.to_json())
    if (folder / PROVENANCE_FILE).is_file():
        write_card(folder, load_name=f"./{folder.name}")
    log(report.markdown)
    require_pass(report)
    return report
