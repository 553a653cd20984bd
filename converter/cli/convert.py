"""`converter convert`'s command line: to --out, or (--push-pr) a pull request."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from converter.conversion.core import convert
from converter.conversion.pr import push_pr
from converter.errors import UsageError


def run_cli(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    """`converter convert`: to --out, or (--push-pr) into a temp folder and a PR on the adapter's repo."""
    options = dict(base=args.base, rank=args.rank, component=args.component, token=args.token,
                   allow_pickle=args.allow_pickle, log=log, lora_alpha=args.lora_alpha,
                   verify=not args.no_verify)  # fmt: skip
    if args.rank is not None and args.rank < 1:
        raise UsageError(f"--rank {args.rank}: give a positive rank")
    if args.to == "gguf":
        return _to_gguf(args, log)
    if args.type:
        raise UsageError("--type is for --to gguf (the GGUF type of the adapter file)")
    if args.push_pr and args.out:
        raise UsageError("give --out or --push-pr, not both (--push-pr writes into a temporary folder)")
    if not args.push_pr:
        if not args.out:
            raise UsageError("give --out (a folder, or a .safetensors file for --to kohya/comfyui), or --push-pr")
        convert(args.adapter, args.to, args.out, force=args.force, **options)
        return 0
    result = push_pr(args.adapter, args.to, **options)
    if result is None:
        return 0
    log(f"pull request: {result}")
    return 0


def _to_gguf(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """`--to gguf`: a proven GGUF LoRA adapter for llama.cpp (converter.jobs.convert, as the Python API runs it)."""
    from converter.jobs.convert import to_gguf

    if args.push_pr or not args.out:
        raise UsageError("--to gguf writes to --out (a .gguf file or a folder); --push-pr is not offered for it")
    result = to_gguf(args.adapter, args.out, base=args.base, type_name=args.type, rank=args.rank,
                     component=args.component, force=args.force, token=args.token, allow_pickle=args.allow_pickle,
                     lora_alpha=args.lora_alpha, verify=not args.no_verify, log=log)  # fmt: skip
    log(f"wrote {result.out}")
    return 0
