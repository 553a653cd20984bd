"""Running the real client against the server: the environment that points ``huggingface_hub`` at it, and a helper
that runs client code in a subprocess (the client reads its endpoint once, when it is imported).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from converter.testing.hub.server import HubServer


def hub_env(server: HubServer, token: str | None = None, home: Path | str | None = None) -> dict[str, str]:
    """Env vars that point ``huggingface_hub`` at ``server``; set them before it is imported (it reads them then).

    ``home`` (HF_HOME: cache, token file) defaults to ``<root>/_client_home``, shared by all clients of the server
    so a second download can hit the cache. Offline switches are forced off (the repo's conftest turns them on).
    """
    env = {
        "HF_ENDPOINT": server.url,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "HF_HOME": str(home if home is not None else server.root / "_client_home"),
    }
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def client_env(
    server: HubServer,
    token: str | None = None,
    home: Path | str | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A full subprocess environment: ``base`` (default os.environ) without any HF_* / HUGGING* variable (a
    developer's real token or cache must not leak in), plus ``hub_env``."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith(("HF_", "HUGGING_FACE_", "HUGGINGFACE_")) and k != "TRANSFORMERS_OFFLINE"
    }
    return env | hub_env(server, token, home)


def run_client(
    server: HubServer,
    code: str,
    *,
    token: str | None = None,
    home: Path | str | None = None,
    timeout: float = 120.0,
    check: bool = True,
    cwd: Path | str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with ``python -c`` against ``server``; with ``check``, a non-zero exit raises AssertionError
    carrying the (token-redacted) output."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=client_env(server, token, home),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    if check and proc.returncode != 0:
        out = server.redact(f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        raise AssertionError(f"client exited with {proc.returncode}\n{out}")
    return proc
