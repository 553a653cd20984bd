"""`converter gguf SOURCE --type TYPE[,TYPE...] --out DIR`: argument parsing and printing only."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from converter.gguf.types import ALL_TYPES

TYPE_HELP = (
    f"GGUF types, comma-separated: {', '.join(ALL_TYPES[:4])} (written in Python) or llama.cpp's quantizations "
    f"({', '.join(ALL_TYPES[4:])}; need converter[gguf])"
)


def add_parser(sub) -> None:
    g = sub.add_parser("gguf", help="write a model folder or Hub model as GGUF files for llama.cpp, proven")
    g.add_argument("source", help="a model folder (a merge's output, any Hugging Face model folder) or a Hub id")
    g.add_argument("--type", required=True, help=TYPE_HELP)
    g.add_argument("--out", required=True, help="folder for the .gguf files (created if missing)")
    g.add_argument("--name", help="file name stem (default: the source folder's name)")
    g.add_argument("--force", action="store_true", help="replace .gguf files of the same names in --out")
    g.add_argument("--token", help="Hugging Face token (default: HF_TOKEN, then the cached login)")


def run(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    from converter.gguf.export import PROOF_FILE, export
    from converter.gguf.types import parse_types

    types = parse_types(args.type)
    result = export(args.source, types, args.out, name=args.name, force=args.force, token=args.token, log=log)
    for path in result.files:
        log(f"wrote {path}")
    log(f"proof: {result.out / PROOF_FILE}")
    return 0
