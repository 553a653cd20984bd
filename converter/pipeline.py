"""The whole job, as every front end runs it: merge → card → upload."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from converter.card import public_records, write_card
from converter.errors import ConverterError
from converter.merge import PROVENANCE_FILE, merge
from converter.publish import PushResult, check_repo_id, push_folder
from converter.recipe import Recipe


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
    log: Callable[[str], None] = print,
) -> PushResult:
    """Publish `folder`, or merge `recipe` into a temporary folder first and publish that."""
    check_repo_id(repo_id)
    if (recipe is None) == (folder is None):
        raise ConverterError("push needs either --from FOLDER or sources to merge (--base/--adapter or --recipe)")
    tmp = None
    try:
        if recipe is not None:
            tmp = Path(tempfile.mkdtemp(prefix="converter-push-", dir=workdir))
            recipe.out = str(tmp / repo_id.split("/")[1])
            folder = merge(recipe, token=token, log=log).out
        folder = Path(folder)
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
