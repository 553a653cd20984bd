"""`converter gguf SOURCE --type TYPE[,TYPE...] --out DIR`: argument parsing and printing only."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from converter.cli.outcomes import proven
from converter.gguf.types import ALL_TYPES
from converter.outcome import Outcome

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


def run(args: argparse.Namespace, log: Callable[[str], None]) -> Outcome:
    from converter.gguf.export import PROOF_FILE, export
    from converter.gguf.types import parse_types

    types = parse_types(args.type)
    result = export(args.source, types, args.out, name=args.name, force=args.force, token=args.token, log=log)
    for path in result.files:
        log(f"wrote {path}")
    log(f"proof: {result.out / PROOF_FILE}")
    files = (*(str(f) for f in result.files), str(result.out / PROOF_FILE))
    return proven("gguf", result.as_proofs(), out=str(result.out), files=files)


def merge_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gguf", metavar="TYPE[,TYPE...]",
        help="also write the merged model as GGUF files of these types, proven, into the folder OUT-GGUF; " + TYPE_HELP,
    )  # fmt: skip


def merge_tee(out: str, types: list[str], log: Callable[[str], None], base: str | None = None):
    """`merge --gguf`: the types we write ourselves are written while the merge streams (converter.gguf.stream);
    None for a diffusion model's single file (its GGUF files are written from the merged file afterwards)."""
    from converter.gguf.export import file_stem, names_single_file

    if base and names_single_file(base):
        return None
    from converter.gguf.stream import GGUFTee

    folder = Path(out)
    return GGUFTee(types, gguf_folder(folder), file_stem(folder.name), log)


def gguf_folder(merged) -> Path:
    return merged.with_name(f"{merged.name}-GGUF")


def export_merged(folder, types: list[str], log: Callable[[str], None], written: dict | None = None,
                  merged_logits=None):  # fmt: skip
    """After a merge: its output folder as GGUF files in a sibling folder OUT-GGUF, proven (`written`: the files
    the merge streamed, see merge_tee; the rest are made now; `merged_logits`: the merged model's logits from its
    verification, reused by the behaviour proof). Returns the GGUFResult."""
    from converter.gguf.export import PROOF_FILE, export

    folder = Path(folder)
    out = gguf_folder(folder)
    result = export(folder, types, out, name=folder.name, force=True, log=log, written=written,
                    merged_logits=merged_logits)  # fmt: skip
    log(f"GGUF: {', '.join(p.name for p in result.files)} in {out} (proof: {PROOF_FILE})")
    return result
