"""``python -m converter.testing.hub``: the local Hub as a process of its own (benchmarks run it so)."""

from __future__ import annotations

import argparse
import threading

from converter.testing.hub.server import HubServer


def main(argv: list[str] | None = None) -> None:
    """`python -m converter.testing.hub --root DIR [--user NAME:TOKEN] [--down MB/s] [--up MB/s] [--jobs]`: serve
    until killed, printing the endpoint URL on the first line (benchmarks run it as a process of its own)."""
    p = argparse.ArgumentParser(prog="python -m converter.testing.hub", description=main.__doc__)
    p.add_argument("--root", required=True, help="folder holding the repos (kept across restarts)")
    p.add_argument("--user", action="append", default=[], help="NAME:TOKEN, a user with a write token")
    p.add_argument("--down", type=float, help="server-to-client bandwidth, MB/s (10^6 bytes)")
    p.add_argument("--up", type=float, help="client-to-server bandwidth, MB/s")
    p.add_argument("--jobs", action="store_true", help="serve the Jobs API (runs the commands it is sent)")
    args = p.parse_args(argv)
    rate = lambda mb: mb * 1e6 if mb else None  # noqa: E731
    server = HubServer(args.root, down_rate=rate(args.down), up_rate=rate(args.up), jobs=args.jobs).start()
    for user in args.user:
        name, token = user.split(":", 1)
        server.add_user(name, token)
    print(server.url, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
