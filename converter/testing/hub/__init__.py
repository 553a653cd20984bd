"""A small in-process Hugging Face Hub that the real ``huggingface_hub`` client (2.4) talks to over HTTP.

Why: the converter downloads bases/adapters and publishes merged repos, PRs and a Space, and may run its push as a
Hugging Face Job. Mocking ``huggingface_hub`` functions would test our assumptions about the client, not the client;
this server speaks the wire protocol the client really uses (docs/PEERS.md, "The huggingface_hub protocol"), keeps
real commit history on disk, enforces auth/private/gated rules, runs Jobs as local subprocesses (``jobs=True``), and
injects faults (5xx, 429, dropped connections, slowness) on demand so retry and resume paths can be tested offline.
For benchmarks it can also hold transfers to a bandwidth (``down_rate`` / ``up_rate``: one shared link each way).

Usage::

    with HubServer(tmp_path / "hub") as hub:
        hub.add_user("alice", "hf_alice")
        hub.seed_folder("alice/base", folder)
        run_client(hub, "from huggingface_hub import snapshot_download; print(snapshot_download('alice/base'))")

``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HUB_DISABLE_XET`` and ``HF_HOME`` at import time, so client code must
run in a subprocess (``run_client`` / ``client_env``) or the env (``hub_env``) must be set before the first import of
``huggingface_hub`` (e.g. start the server at the top of a conftest). ``HF_HUB_DISABLE_XET=1`` is mandatory: with
hf_xet installed the 2.x client uploads through Xet and never calls the LFS endpoints served here.

One module per area, as the client splits its own: ``server`` (state, lifecycle, routing), ``transport`` (HTTP),
``model`` (files, commits, repos, users), ``store`` (repos on disk and their rules), ``users``, ``repos``, ``files``,
``commits`` (and pull requests), ``lfs``, ``faults``, ``link`` (bandwidth), ``jobs`` with ``local_job`` and
``hardware``, ``client`` (running the client against the server) and ``cli``. Only the standard library is imported.

Not served (404): Xet, git smart HTTP, branch/tag creation, PR merge, settings, likes, search/listing of repos,
buckets. Tokens are never logged: request logging goes to the ``converter.testing.hub`` loggers at DEBUG level and
only carries the request line; job secrets are never shown back nor written to disk.
"""

from converter.testing.hub.cli import main
from converter.testing.hub.client import client_env, hub_env, run_client
from converter.testing.hub.faults import Fault, Seen
from converter.testing.hub.hardware import HARDWARE
from converter.testing.hub.link import Link
from converter.testing.hub.local_job import LocalJob
from converter.testing.hub.model import (
    DEFAULT_GITATTRIBUTES,
    LFS_SUFFIXES,
    MAX_REGULAR_FILE_SIZE,
    REPO_TYPES,
    SPACE_SDKS,
    Commit,
    FileEntry,
    Repo,
    git_blob_sha1,
    lfs_pointer,
)
from converter.testing.hub.server import HubServer
from converter.testing.hub.wire import HubError

__all__ = [
    "DEFAULT_GITATTRIBUTES",
    "HARDWARE",
    "LFS_SUFFIXES",
    "MAX_REGULAR_FILE_SIZE",
    "REPO_TYPES",
    "SPACE_SDKS",
    "Commit",
    "Fault",
    "FileEntry",
    "HubError",
    "HubServer",
    "Link",
    "LocalJob",
    "Repo",
    "Seen",
    "client_env",
    "git_blob_sha1",
    "hub_env",
    "lfs_pointer",
    "main",
    "run_client",
]
