"""`converter space deploy`: publish the Gradio app as a Hugging Face Space, in one commit.

The Space gets `app.py`, the `converter` package (without the test Hub and the local launcher) with the
repository's top-level `keymaps/` inside it as `converter/keymaps/` (the layout of an installed wheel) and, from
`spaces/`, its README.md (the Space config) and requirements.txt. They are read from the checkout the package
runs from, so what is deployed is what was tested.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from converter.errors import UsageError
from converter.hub import client as hub
from converter.hub.publish import check_repo_id

SKIP = ("testing/", "app/local.py")  # only for tests and `make run`


def space_files(source: Path) -> dict[str, Path]:
    """path in the Space -> local file."""
    app, spaces, package = source / "app.py", source / "spaces", source / "converter"
    if not app.is_file() or not (spaces / "README.md").is_file() or not package.is_dir():
        raise UsageError(
            f"{source}: no app.py, spaces/README.md and converter/ here; run from a checkout of the converter "
            "repository or pass --source"
        )
    keymaps = sorted((source / "keymaps").glob("*.yaml"))
    if not keymaps:
        raise UsageError(f"{source}: no keymaps/*.yaml here; run from a checkout of the converter repository")
    files = {"app.py": app, "README.md": spaces / "README.md", "requirements.txt": spaces / "requirements.txt"}
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package).as_posix()
        if path.is_file() and path.suffix in (".py", ".yaml", ".json") and not rel.startswith(SKIP) and rel not in SKIP:
            files[f"converter/{rel}"] = path
    # where an installed wheel has them too: converter.engine.keymap.keymap_folder() finds them next to the package
    files.update({f"converter/keymaps/{path.name}": path for path in keymaps})
    return files


def deploy(
    repo_id: str,
    *,
    source: Path | None = None,
    token: str | None = None,
    private: bool = False,
    log: Callable[[str], None] = print,
) -> str:
    """Create the Space (gradio SDK) if needed and upload the app in one commit; returns the Space's URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    check_repo_id(repo_id)
    source = Path(source) if source else Path(__file__).resolve().parents[2]
    files = space_files(source)
    api = HfApi(token=token)
    hub.whoami(token)
    exists = hub.call(repo_id, lambda: api.repo_exists(repo_id, repo_type="space"), repo_id=repo_id)
    if not exists:
        hub.call(
            repo_id,
            lambda: api.create_repo(repo_id, repo_type="space", space_sdk="gradio", private=private, exist_ok=True),
            repo_id=repo_id,
        )
        log(f"created Space {repo_id}")
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=path) for name, path in files.items()]
    try:
        info = hub.call(
            repo_id,
            lambda: api.create_commit(
                repo_id, operations, commit_message="Deploy the converter app", repo_type="space"
            ),
            repo_id=repo_id,
        )
    except BaseException:
        if not exists:  # a failed first deploy leaves no empty Space
            try:
                api.delete_repo(repo_id, repo_type="space")
            except Exception:  # noqa: BLE001 - the upload error is the one to report
                log(f"warning: could not delete the empty Space {repo_id}")
        raise
    url = f"{api.endpoint.rstrip('/')}/spaces/{repo_id}"
    log(f"deployed {len(files)} files to {url} (commit {info.oid})")
    return url
