"""`converter convert`'s command line: to --out, or (--push-pr) a pull request; its outcome from the typed results."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from converter.cli.options import options_from
from converter.cli.outcomes import not_asked, paths, proven
from converter.conversion.core import ConvertResult, convert
from converter.conversion.options import ConvertOptions
from converter.conversion.pr import push_pr
from converter.errors import UsageError
from converter.outcome import Outcome, Published


def run_cli(args: argparse.Namespace, log: Callable[[str], None] = print) -> Outcome:
    """`converter convert`: to --out, or (--push-pr) into a temp folder and a PR on the adapter's repo."""
    options = options_from(ConvertOptions, args, verify=not args.no_verify)
    if args.to == "gguf":
        return _to_gguf(args, options, log)
    if args.push_pr and args.out:
        raise UsageError("give --out or --push-pr, not both (--push-pr writes into a temporary folder)")
    if not args.push_pr:
        if not args.out:
            raise UsageError("give --out (a folder, or a .safetensors file for --to kohya/comfyui), or --push-pr")
        return _converted(convert(args.adapter, args.out, options, token=args.token, log=log))
    pr = push_pr(args.adapter, options, token=args.token, log=log)
    if pr.url is None:
        return not_asked("convert", f"{pr.repo_id} already has a {args.to} version ({pr.existing})",
                         details={"existing": pr.existing})  # fmt: skip
    log(f"pull request: {pr.url}")
    published = Published(pr.repo_id, pr.repo_url, pr.commit, pr.url, changed=True, pr_updated=pr.updated)
    return _converted(pr.conversion, published=(published,), out=None, files=())  # converted in a scratch folder


def _converted(result: ConvertResult, **fields) -> Outcome:
    """A conversion's outcome: proven by its read-back, unless --no-verify; a read-back that could compare no module
    (all fused or split on the way) proves nothing, and says so (exit 0, as before the outcome existed)."""
    done = {"out": str(result.out), "files": paths(result.out, result.files), "modules": result.modules, **fields}
    proof = result.read_back
    if proof is None:
        return not_asked("convert", **done)
    if not proof.compared:
        return not_asked("convert", proof.summary(), proofs=proof.as_proofs(), **done)
    return proven("convert", proof.as_proofs(), **done)


def _to_gguf(args: argparse.Namespace, options: ConvertOptions, log: Callable[[str], None]) -> Outcome:
    """`--to gguf`: a proven GGUF LoRA adapter for llama.cpp (converter.jobs.convert, as the Python API runs it)."""
    from converter.jobs.convert import to_gguf

    if args.push_pr or not args.out:
        raise UsageError("--to gguf writes to --out (a .gguf file or a folder); --push-pr is not offered for it")
    result = to_gguf(args.adapter, args.out, options, token=args.token, log=log)
    log(f"wrote {result.out}")
    done = {"out": str(result.out), "files": (str(result.out),), "modules": result.modules}
    if not result.proof:
        return not_asked("convert", **done)
    return proven("convert", result.as_proofs(), **done)
