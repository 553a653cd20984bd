"""`converter extract / resize / combine`: argument parsing only; the work is in the sibling modules."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from converter.cli.options import options_from
from converter.cli.outcomes import not_asked, paths
from converter.methods.options import METHODS, RANK_RULES, CombineOptions, ExtractOptions, ResizeOptions
from converter.outcome import Outcome

COMMANDS = ("extract", "resize", "combine")
_TOKEN = "Hugging Face token (default: HF_TOKEN, then the cached login)"


def add_parsers(sub) -> None:
    """Register the three subcommands on the main parser's subparsers."""
    e = sub.add_parser("extract", help="extract a LoRA from a fine-tuned model: SVD of (tuned - base), per module")
    e.add_argument("--base", required=True, help="the model before fine-tuning: folder or Hub id")
    e.add_argument("--tuned", required=True, help="the fine-tuned model (same architecture): folder or Hub id")
    e.add_argument("--rank", type=int, required=True, help="the rank (with a dynamic --rank-rule: the largest)")
    _rank_rule(e)
    e.add_argument("--include", action="append", default=[], help="only tensors whose name matches (regex)")
    e.add_argument("--exclude", action="append", default=[], help="skip tensors whose name matches (regex)")
    e.add_argument("--no-modules-to-save", action="store_false", dest="modules_to_save",
                   help="refuse (not save whole) embeddings, norms and biases that differ")  # fmt: skip
    _output(e)

    r = sub.add_parser("resize", help="resize a LoRA: SVD of each module's ΔW to a fixed or dynamic rank")
    r.add_argument("--adapter", required=True, help="adapter file/folder, or Hub org/name[@rev][/file]")
    r.add_argument("--rank", type=int, required=True, help="the new rank (with a dynamic --rank-rule: the largest)")
    _rank_rule(r)
    r.add_argument("--base", help="the model the adapter is for (needed to look up kohya's flattened names)")
    r.add_argument("--component", help="which model part a PEFT adapter is for (unet, transformer, text_encoder...)")
    _output(r)

    c = sub.add_parser("combine", help="combine several LoRAs into one adapter (PEFT's add_weighted_adapter methods)")
    c.add_argument("--adapter", action="append", default=[], required=True, help="adapter (repeatable, in order)")
    c.add_argument("--weight", action="append", type=float, default=[], dest="weights",
                   help="weight per --adapter (default 1.0)")  # fmt: skip
    c.add_argument("--method", default="cat", choices=METHODS, help="how to combine (default cat: the exact sum)")
    c.add_argument("--density", type=float, help="fraction of values kept (ties, dare_*, magnitude_prune)")
    c.add_argument("--rank", type=int, help="svd methods: the output rank (default: the largest input rank)")
    c.add_argument("--seed", type=int, default=0, help="dare_*: the seed of the drop masks (default 0)")
    c.add_argument("--majority-sign", default="total", choices=["total", "frequency"], dest="sign_method",
                   help="ties: sign election")  # fmt: skip
    c.add_argument("--svd-clamp", type=float, help="svd methods: clamp the factors at this quantile of their values")
    c.add_argument("--base", help="the model the adapters are for (needed to look up kohya's flattened names)")
    c.add_argument("--component", help="which model part PEFT adapters are for (unet, transformer, text_encoder...)")
    _output(c)


def _rank_rule(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rank-rule", default="fixed", choices=RANK_RULES, dest="rule",
                   help="fixed, or a dynamic rule per module (kohya's sv_ratio / sv_fro / sv_cumulative, "
                   "mergekit's sv_epsilon), capped by --rank")  # fmt: skip
    p.add_argument("--rank-param", type=float, dest="param",
                   help="the dynamic rule's parameter (ratio, fraction or threshold)")  # fmt: skip


def _output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output: a folder (peft, diffusers) or a .safetensors file (kohya)")
    p.add_argument("--to", default="peft", choices=["peft", "diffusers", "kohya"], help="output format (default peft)")
    p.add_argument("--report", help="also write the per-module JSON report here")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--allow-pickle", action="store_true", help="read .bin files (weights only)")
    p.add_argument("--token", help=_TOKEN)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> Outcome:
    """Run one of COMMANDS from parsed arguments; errors are ConverterErrors (exit code 2). None of them has a proof
    of its own: each module's error is in its report (--report)."""
    if args.command == "extract":
        from converter.methods.extraction import extract

        result = extract(args.base, args.tuned, args.out, options_from(ExtractOptions, args), token=args.token, log=log)
    elif args.command == "resize":
        from converter.methods.resizing import resize

        result = resize(args.adapter, args.out, options_from(ResizeOptions, args), token=args.token, log=log)
    else:
        from converter.methods.combination import combine

        result = combine(args.adapter, args.out, options_from(CombineOptions, args), token=args.token, log=log)
    if args.report:
        _write_report(args.report, result)
    files = paths(result.out, result.files) + ((args.report,) if args.report else ())
    return not_asked(args.command, "no proof of its own: each module's error is in its report (--report)",
                     out=str(result.out), files=files, modules=result.modules)  # fmt: skip


def _write_report(path: str, result) -> None:
    import json
    from pathlib import Path

    from converter.errors import OutputError

    report = getattr(result, "report", None) or {"svd_relative_errors": getattr(result, "svd_errors", {})}
    try:
        Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    except OSError as e:
        raise OutputError(f"{path}: cannot write the report ({e.strerror})", path=path) from None
