"""The tested set of dependencies, written down: constraints.txt and the Space's requirements.txt.

pyproject.toml declares compatible ranges; `make` installs inside them with `-c constraints.txt`, the exact versions
the test suite ran with. After changing a range or upgrading a package in the venv, run (in the venv of `make`):

    .venv/bin/python scripts/lock.py          # rewrite constraints.txt and spaces/requirements.txt
    .venv/bin/python scripts/lock.py --check  # is what is written still the installed, tested set?

constraints.txt: every package installed in the venv (converter itself and pip aside), pinned; torch
without its local build label, so pip takes the CPU wheel it is offered first (the Makefile installs it first).
spaces/requirements.txt: what the Space installs besides Gradio (which its README's sdk_version brings):
converter[app]'s dependencies and theirs, pinned to the same versions, so the Space runs the tested set.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
SPACE_REQUIREMENTS = ROOT / "spaces" / "requirements.txt"
NOT_PINNED = {"converter", "pip"}  # setuptools stays: torch requires a recent one
SPACE_SDK = "gradio"  # installed by the Space itself, at spaces/README.md's sdk_version
CONSTRAINTS_HEAD = """\
# The exact set the test suite runs with (`make` installs with -c constraints.txt; CI runs `make test`; the Space's
# requirements.txt pins the same versions). pyproject.toml declares the compatible ranges; its lower bounds are
# these versions. Written by scripts/lock.py from the venv of `make`: do not edit by hand.
"""
SPACE_HEAD = """\
# The Space's environment: converter[app]'s dependencies, pinned to the tested set (constraints.txt). Gradio itself
# comes from sdk_version in README.md (with its oauth extra, because hf_oauth is true).
# Written by scripts/lock.py: do not edit by hand.
"""


def installed() -> dict[str, str]:
    """Canonical name -> version of every distribution in this environment, local labels dropped."""
    found = {}
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name not in NOT_PINNED:
            found[name] = dist.version.split("+")[0]
    return found


def declared(extras: tuple[str, ...]) -> list[Requirement]:
    """converter's own requirements with these extras (read from pyproject.toml, not from an install)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    wanted, seen, reqs = list(extras), set(), [Requirement(r) for r in project["dependencies"]]
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in optional[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "converter":
                wanted += sorted(req.extras)
            else:
                reqs.append(req)
    return reqs


def closure(roots: list[Requirement]) -> set[str]:
    """The canonical names of `roots` and everything they need, as installed here (markers evaluated)."""
    names: set[str] = set()
    todo = [(req, "") for req in roots]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in done:
            continue
        done.add(key)
        names.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is required but not installed here: run `make setup` first") from None
        for text in requires:
            sub = Requirement(text)
            for wanted in ("", *sorted(req.extras)):
                todo.append((sub, wanted))
    return names


def constraints_text(versions: dict[str, str]) -> str:
    return CONSTRAINTS_HEAD + "".join(f"{name}=={versions[name]}\n" for name in sorted(versions))


def space_text(versions: dict[str, str]) -> str:
    names = sorted(closure(declared(("app",))) - {SPACE_SDK})
    return SPACE_HEAD + "".join(f"{name}=={versions[name]}\n" for name in names)


def pinned(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = version
    return out


def problems() -> list[str]:
    """What is out of date: the installed set against constraints.txt, requirements.txt against both."""
    have, pins = installed(), pinned(CONSTRAINTS.read_text())
    found = [f"{n}: {have.get(n, 'not installed')} installed, {v} in constraints.txt"
             for n, v in sorted(pins.items()) if have.get(n) != v]  # fmt: skip
    needed = closure(declared(("all", "dev")))
    found += [f"{n}: needed but not in constraints.txt" for n in sorted(needed - set(pins))]
    for req in declared(("all", "dev")):
        name, lowest = canonicalize_name(req.name), _lower_bound(req)
        if lowest is not None and pins.get(name) != lowest:
            found.append(f"{req}: its lower bound is not the tested version {pins.get(name)}")
    if not found and SPACE_REQUIREMENTS.read_text() != space_text(pins):
        found.append(f"{SPACE_REQUIREMENTS.relative_to(ROOT)} is not converter[app]'s pinned closure")
    return found


def _lower_bound(req: Requirement) -> str | None:
    return next((s.version for s in req.specifier if s.operator == ">="), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report what is out of date; write nothing")
    args = parser.parse_args()
    if args.check:
        found = problems()
        for line in found:
            print(line, file=sys.stderr)
        return 1 if found else 0
    versions = installed()
    CONSTRAINTS.write_text(constraints_text(versions))
    SPACE_REQUIREMENTS.write_text(space_text(versions))
    print(f"wrote {CONSTRAINTS.name} ({len(versions)} pins) and {SPACE_REQUIREMENTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
