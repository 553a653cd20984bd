"""`converter inspect / merge / convert / gguf / verify / push / demo / space deploy`: argument parsing and printing.

Every command returns its outcome (converter.outcome), and a failure's outcome is built from its error, so the
exit code (0 done, 2 bad input or usage, 3 verification failed, 5 not verified, 1 unexpected failure) comes from
the outcome alone. `--json` prints it as the last line of stdout; the human lines then go to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace

from converter.cli import mlx
from converter.cli.outcomes import NOTHING_TO_PROVE, not_asked, paths, verified
from converter.errors import BadInputError, ConverterError, UsageError
from converter.io import quiet
from converter.outcome import Outcome, Published


class _Parser(argparse.ArgumentParser):
    refused: str | None = None  # the last usage error (main prints it as an outcome with --json)

    def error(self, message: str):  # argparse exits 2 on usage errors; keep its one-line style
        _Parser.refused = f"{self.prog}: error: {message}"
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="converter", description="Merge LoRA adapters into base models, exactly and streaming.")
    from converter import __version__

    p.add_argument("--version", action="version", version=f"converter {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    i = sub.add_parser("inspect", help="describe a model folder or an adapter")
    i.add_argument("path", help="model folder, adapter folder or adapter file")
    i.add_argument("--allow-pickle", action="store_true", help="read .bin adapters (weights only)")
    i.add_argument("--token", help="Hugging Face token (default: HF_TOKEN, then the cached login)")
    i.add_argument("--config", help=CONFIG_HELP)

    _merge_parser(sub)
    _push_parser(sub)
    _verify_parser(sub)
    _convert_parser(sub)
    from converter.cli.gguf import add_parser as add_gguf_parser

    add_gguf_parser(sub)
    from converter.cli.batch import add_parser as add_batch_parser

    add_batch_parser(sub)
    from converter.cli.methods import add_parsers

    add_parsers(sub)  # extract / resize / combine

    d = sub.add_parser("demo", help="build a small demo base and adapter offline, merge them, and say where")
    d.add_argument("--dir", default="demo-output", help="where to put the demo (default ./demo-output)")
    _space_parser(sub)
    _add_globals(p)
    return p


def _merge_parser(sub) -> None:
    m = sub.add_parser("merge", help="merge adapters into a base model")
    _merge_options(m)
    m.add_argument("--out", help="output folder (created atomically)")
    m.add_argument("--dry-run", action="store_true", help="print the plan; write nothing")
    from converter.cli.gguf import merge_option

    merge_option(m)
    mlx.add_option(m)
    m.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    m.add_argument("--no-verify", action="store_true", help="skip comparing the merged model with base + adapters")
    m.add_argument(
        "--keep-adapter", action="store_true",
        help="a training checkpoint with a LoRA inside: write OUT/base (unmerged) and OUT/adapter (PEFT) instead",
    )  # fmt: skip
    _verify_options(m)


def _push_parser(sub) -> None:
    p_push = sub.add_parser("push", help="merge (or take --from FOLDER) and publish to the Hub in one commit")
    p_push.add_argument("--repo", required=True, help="target repo, namespace/name")
    p_push.add_argument("--from", dest="from_folder", help="push this merged folder instead of merging")
    _merge_options(p_push)
    p_push.add_argument("--private", action="store_true", help="create the repo private")
    p_push.add_argument("--create-pr", action="store_true", help="open (or update) a pull request instead")
    p_push.add_argument("--overwrite", action="store_true", help="replace the model already in the repo")
    p_push.add_argument("--no-verify", action="store_true", help="skip verification before the upload")
    p_push.add_argument("--gguf", metavar="TYPE[,TYPE...]",
                        help="also GGUF files of these types, proven before anything is committed, into the repo "
                        "REPO-GGUF")  # fmt: skip
    mlx.add_option(p_push, push=True)
    p_push.add_argument("--dry-run", action="store_true",
                        help="print the plan and the disk, memory and time it needs here and on Hugging Face Jobs "
                        "(with --on-jobs: the Job's spec); download, write and submit nothing")  # fmt: skip
    from converter.cli.on_jobs import add_jobs_options

    add_jobs_options(p_push)
    _verify_options(p_push)


def _verify_parser(sub) -> None:
    v = sub.add_parser("verify", help="check that a merged folder behaves like base + adapters (unmerged)")
    v.add_argument("folder", help="the merged model folder")
    v.add_argument("--base", help="base model (default: from the folder's converter_recipe.yaml)")
    v.add_argument("--adapter", action="append", default=[], help="adapter (repeatable; default: from the recipe)")
    v.add_argument("--weight", action="append", type=float, default=[], help="weight per --adapter")
    v.add_argument("--report", help="also write the JSON report here")
    v.add_argument("--proof", choices=["both", "tensors", "behaviour"], default="both",
                   help="both (default), or one alone: every tensor against its referee, or the behaviour")  # fmt: skip
    v.add_argument("--config", help=CONFIG_HELP)
    v.add_argument("--token", help="Hugging Face token (default: HF_TOKEN, then the cached login)")
    _verify_options(v)


def _space_parser(sub) -> None:
    s = sub.add_parser("space", help="the Gradio app as a Hugging Face Space")
    space_sub = s.add_subparsers(dest="space_command", required=True, parser_class=_Parser)
    sd = space_sub.add_parser("deploy", help="create/update a Space with app.py and this package, in one commit")
    sd.add_argument("--repo", required=True, help="the Space, namespace/name")
    sd.add_argument("--source", help="checkout holding app.py, spaces/ and converter/ (default: this package's)")
    sd.add_argument("--private", action="store_true", help="create the Space private")
    sd.add_argument("--token", help="Hugging Face token (default: HF_TOKEN, then the cached login)")


def _add_globals(parser: argparse.ArgumentParser, top: bool = True) -> None:
    """`-v` and `--json` before or after the command, on every command (a subcommand's default must not reset the
    top's)."""
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=False if top else argparse.SUPPRESS,
        help="also show what the libraries underneath print (their warnings, log lines and progress bars)",
    )  # fmt: skip
    parser.add_argument(
        "--json", action="store_true", default=False if top else argparse.SUPPRESS,
        help="print the outcome (verdict, reason, files, Hub links, proofs) as one JSON object, the last line of "
        "stdout; the other lines go to stderr",
    )  # fmt: skip
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _add_globals(sub, top=False)


def _convert_parser(sub) -> None:
    c = sub.add_parser(
        "convert", help="convert an adapter between formats (kohya, PEFT, diffusers, ComfyUI, llama.cpp's GGUF) "
        "without merging"
    )  # fmt: skip
    c.add_argument("--adapter", required=True, help="adapter file/folder, or Hub org/name[@rev][/file]")
    c.add_argument("--to", required=True, choices=["peft", "diffusers", "kohya", "comfyui", "gguf"],
                   help="output format; gguf: a LoRA adapter llama.cpp applies at run time (--lora), proven against "
                   "PEFT")  # fmt: skip
    c.add_argument("--out", help="output: a folder (peft, diffusers) or a .safetensors file (kohya, comfyui); gguf: "
                   "a .gguf file, or a folder for ADAPTER-TYPE.gguf")  # fmt: skip
    c.add_argument("--base", help="the model the adapter is for (needed to look up kohya's flattened names; for gguf "
                   "the base's architecture and tensor names: a model folder or Hub id)")  # fmt: skip
    c.add_argument("--type", help="--to gguf: F32 (default), F16, BF16 or Q8_0")
    c.add_argument("--rank", type=int, help="approximate LoHa/LoKr/full modules by an SVD of this rank")
    c.add_argument("--component", help="which model part a PEFT adapter is for (unet, transformer, text_encoder...)")
    c.add_argument("--push-pr", action="store_true", help="open a pull request adding the result to the adapter's repo")
    c.add_argument("--force", action="store_true", help="replace an existing --out")
    c.add_argument("--allow-pickle", action="store_true", help="read .bin adapters (weights only)")
    c.add_argument("--lora-alpha", type=_alpha, help=LORA_ALPHA_HELP)
    c.add_argument("--no-verify", action="store_true", help="skip reading the output back and comparing its ΔW")
    c.add_argument("--token", help="Hugging Face token (default: HF_TOKEN, then the cached login)")


CONFIG_HELP = (
    "a training checkpoint without its Hugging Face config (torchtitan, Megatron-LM): the base model's folder or "
    "its config.json (tokenizer files beside it are carried over)"
)


LORA_ALPHA_HELP = (
    "the adapter's lora_alpha where its files do not say it (PEFT weights without adapter_config.json); "
    "each module is scaled by lora_alpha / its rank"
)


def _alpha(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: give lora_alpha as a number, e.g. 16")
    return value


def _weight(text: str) -> float | dict[str, float]:
    """A number, or kohya-style strengths per component: `unet=0.8,text_encoder=0.5`."""
    try:
        if "=" not in text:
            return float(text)
        return {k.strip(): float(v) for k, v in (part.split("=", 1) for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number or component=number pairs") from None


def _verify_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", help="a text file with one prompt per line (default: a built-in set)")
    p.add_argument(
        "--verify",
        choices=["quick", "full"],
        default="quick",
        dest="verify_mode",
        help="quick (default): judge on the logits; full: also greedy continuations, shown on the card",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=16, help="greedy tokens per prompt with --verify full (default 16)"
    )
    p.add_argument(
        "--verify-memory",
        help="memory verification may use, e.g. 8GB (default: what is available); larger models are offloaded to disk",
    )
    p.add_argument(
        "--single-file-config",
        help="a single-file diffusion base: the diffusers config (folder or Hub repo) that from_single_file needs "
        "to load base and merge for verification (default: diffusers' guess, fetched from the Hub)",
    )


def _verify_settings(args: argparse.Namespace) -> dict:
    from pathlib import Path

    prompts = None
    if args.prompts:
        try:
            prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        except OSError as e:
            raise BadInputError(f"{args.prompts}: cannot read prompts ({e.strerror})", file=args.prompts) from None
        if not prompts:
            raise BadInputError(f"{args.prompts}: no prompts in the file (one per line)", file=args.prompts)
    from converter.io.units import parse_size

    memory = parse_size(args.verify_memory) if args.verify_memory else None
    settings = {"prompts": prompts, "max_new_tokens": args.max_new_tokens, "memory": memory, "mode": args.verify_mode}
    if getattr(args, "single_file_config", None):
        settings["single_file_config"] = args.single_file_config
    return settings


def _merge_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", help="a recipe YAML (command-line options override it)")
    p.add_argument(
        "--base", help="base model: folder or Hub id org/name[@revision], or a training run's checkpoint folder"
    )
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument(
        "--adapter", action="append", default=[], help="adapter folder/file or Hub id (repeatable, in order)"
    )
    p.add_argument(
        "--weight",
        action="append",
        type=_weight,
        default=[],
        help="weight per --adapter (default 1.0); per component of a diffusion base: unet=0.8,text_encoder=0.5",
    )
    p.add_argument(
        "--dtype",
        help="output dtype: float32, float16, bfloat16, or bnb-nf4 / bnb-fp4 for a bitsandbytes 4-bit checkpoint "
        "(default: keep each tensor's)",
    )
    p.add_argument(
        "--lora-alpha", action="append", type=_alpha, default=[], help=LORA_ALPHA_HELP + " (one per --adapter)"
    )
    p.add_argument(
        "--max-shard-size", help="largest output shard, e.g. 5GB (default 5GB; a push: 1/16 of the weights, 256MB-2GB)"
    )
    p.add_argument(
        "--allow-unmatched", action="store_true", help="warn (not fail) on adapter tensors that land nowhere"
    )
    p.add_argument("--allow-pickle", action="store_true", help="read .bin adapters (loaded with weights_only=True)")
    p.add_argument("--token", help="Hugging Face token (default: HF_TOKEN, then the cached login)")
    p.add_argument(
        "--qlora-base",
        choices=["original", "dequantized"],
        help="QLoRA adapters: merge into the original weights (default) or into their 4-bit "
        "quantize-dequantize, what the adapter saw in training",
    )
    p.add_argument(
        "--qlora",
        action="store_true",
        help="the adapters were trained on a 4-bit base (usually detected from their cards); verification then "
        "measures both merge bases against the 4-bit training setting",
    )
    p.add_argument("--qlora-quant", choices=["nf4", "fp4"], help="4-bit type used in training (default nf4)")
    p.add_argument("--qlora-blocksize", type=int, help="quantization block size used in training (default 64)")
    p.add_argument("--no-double-quant", action="store_true", help="training did not use double quantization")
    p.add_argument("--method", choices=["sum", "ties", "dare", "dare_ties", "magnitude_prune"],
                   help="how the adapters' deltas combine on each tensor (default sum)")  # fmt: skip
    p.add_argument("--density", type=float, help="ties/dare: the fraction of each delta kept, in (0, 1]")
    p.add_argument("--seed", type=int, help="dare: the seed of the drop masks (default 0)")
    from converter.cli.on_jobs import add_fit_options

    add_fit_options(p)


def _adapter_specs(args: argparse.Namespace) -> list:
    from converter.engine.recipe import AdapterSpec

    if args.weight and len(args.weight) != len(args.adapter):
        raise UsageError(f"{len(args.weight)} --weight for {len(args.adapter)} --adapter: give one per adapter")
    alphas = getattr(args, "lora_alpha", [])
    if alphas and len(alphas) != len(args.adapter):
        raise UsageError(f"{len(alphas)} --lora-alpha for {len(args.adapter)} --adapter: give one per adapter")
    weights = args.weight or [1.0] * len(args.adapter)
    return [
        AdapterSpec(a, w, lora_alpha=alphas[i] if alphas else None)
        for i, (a, w) in enumerate(zip(args.adapter, weights, strict=True))
    ]


def _recipe_from_args(args: argparse.Namespace):
    from converter.engine.recipe import Recipe

    if args.recipe:
        recipe = Recipe.load(args.recipe)
        if args.adapter:
            raise UsageError("give adapters either in --recipe or with --adapter, not both")
        if args.lora_alpha:
            raise UsageError("with --recipe, give lora_alpha in the recipe (per adapter), not --lora-alpha")
    else:
        if not args.base:
            raise UsageError("merge needs --base (and --adapter, unless the base is a training checkpoint) or --recipe")
        if not args.adapter and not _training_base(args.base):
            raise UsageError(
                f"merge needs at least one --adapter: {args.base} is a model (only a training checkpoint, whose "
                "weights are the result, merges without one)"
            )
        alphas = getattr(args, "lora_alpha", [])
        if not args.adapter and alphas:  # a training checkpoint alone: --lora-alpha is for the LoRA inside it
            if len(alphas) > 1:
                raise UsageError(f"{len(alphas)} --lora-alpha for the base's one LoRA: give one")
            recipe = Recipe(base=args.base, adapters=[], base_lora_alpha=alphas[0])
        else:
            recipe = Recipe(base=args.base, adapters=_adapter_specs(args))
    recipe.qlora = recipe.qlora or getattr(args, "qlora", False)
    if getattr(args, "no_double_quant", False):
        recipe.qlora_double_quant = False
    methods = ("method", "density", "seed")  # ties / dare (converter.engine.taskmerge)
    for field in ("base", "out", "dtype", "max_shard_size", "qlora_base", "qlora_quant", "qlora_blocksize", *methods):
        if getattr(args, field, None):
            setattr(recipe, field, getattr(args, field))
    recipe.allow_unmatched = recipe.allow_unmatched or args.allow_unmatched
    recipe.allow_pickle = recipe.allow_pickle or args.allow_pickle
    if args.config:
        recipe.base_config = args.config
    return recipe


def _keep_adapter(args: argparse.Namespace) -> Outcome:
    """`merge --keep-adapter`: nothing is merged, so only the options that say where and what to read apply."""
    from pathlib import Path

    from converter.training.unmerged import keep_adapter

    if args.base and not args.recipe and not _training_base(args.base):
        raise UsageError(f"--keep-adapter is for training checkpoints with a LoRA inside; {args.base} is not one")
    recipe = _recipe_from_args(args)

    options = ("dtype", "method", "qlora_base", "max_shard_size")
    given = [f"--{o.replace('_', '-')}" for o in options if getattr(args, o)]
    if recipe.adapters or given or args.dry_run or args.recipe:
        what = "--adapter" if recipe.adapters else (given or ["--dry-run" if args.dry_run else "--recipe"])[0]
        raise UsageError(f"--keep-adapter writes the checkpoint's base and LoRA as they are: {what} does not apply")
    if not args.out:
        raise UsageError("--keep-adapter needs --out (a folder: OUT/base and OUT/adapter are written there)")
    keep_adapter(recipe.base, Path(args.out), lora_alpha=recipe.base_lora_alpha, allow_pickle=recipe.allow_pickle,
                 force=args.force, log=_log, config=recipe.base_config)  # fmt: skip
    return not_asked("merge", "nothing merged (--keep-adapter writes the base and its LoRA apart)", out=args.out,
                     files=(str(Path(args.out) / "base"), str(Path(args.out) / "adapter")))  # fmt: skip


def _training_base(base: str) -> bool:
    """A training checkpoint is a complete model by itself: it needs no --adapter (a folder that is no model at all
    is taken as one too, so that opening it says which layouts were looked for)."""
    from converter.training import is_training_base

    return is_training_base(base)


_console: quiet.Console | None = None  # the running command's (converter.io.quiet.session)


def _log(msg: str) -> None:
    """converter's own lines: to stdout even while the libraries' output is held back."""
    if _console is not None:
        _console.line(msg)
    else:
        print(msg, flush=True)


def run(args: argparse.Namespace) -> Outcome:
    """Run the parsed command (COMMANDS: its handler); its outcome."""
    handler = COMMANDS.get(args.command)
    if handler is None:
        raise AssertionError(args.command)
    return handler(args)


def _one_blas_thread() -> None:
    """Before numpy loads: the merge's BLAS products are small; BLAS threads would spin next to ours."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _run_inspect(args: argparse.Namespace) -> Outcome:
    """The description as lines, or with --json in the outcome's `details` only."""
    from converter.jobs.describe import inspect_path, render

    info = inspect_path(args.path, allow_pickle=args.allow_pickle, token=args.token, config=args.config)
    if not args.json:
        _log(render(info))
    return not_asked("inspect", NOTHING_TO_PROVE, details=info)


def _run_merge(args: argparse.Namespace) -> Outcome:
    """Merge, then verify (unless --no-verify) and export GGUF files when asked; the checks that can fail early
    (where it fits, verification's extras, the GGUF types) run before the merge. --dry-run: the plan and the fit."""
    _one_blas_thread()
    from converter.engine.merging import merge

    if args.keep_adapter:
        return _keep_adapter(args)
    recipe = _recipe_from_args(args)
    from converter.cli import on_jobs

    on_jobs.mount(args, recipe)
    if args.dry_run:
        details = on_jobs.dry_run(args, recipe, None if args.no_verify else _verify_settings(args), "merge", _log)
        return not_asked("merge", "a dry run: nothing was written", details={"fit": details})
    settings = None if args.no_verify else _verify_settings(args)
    on_jobs.check_merge_fits(args, recipe, settings)
    from converter.gguf.export import check_merge_gguf

    gguf_types = check_merge_gguf(args.gguf, recipe.base, args.token)
    mlx_types = mlx.check(args, recipe.base)
    warmup = None
    if settings is not None:  # import transformers + PEFT beside the merge (verification/warmup.py)
        from converter.jobs.pipeline import check_extras
        from converter.verification.warmup import start as warmup

        check_extras(recipe, args.token)
    tee = None
    if gguf_types and recipe.out:
        from converter.cli.gguf import merge_tee

        tee = merge_tee(recipe.out, gguf_types, log=_log, base=recipe.base)
    report = exported = None
    try:
        result = merge(recipe, force=args.force, token=args.token, log=_log, tee=tee, on_planned=warmup)
        written = tee.finish() if tee else None
        if settings is not None:
            from converter.jobs.pipeline import verify_folder

            report = verify_folder(result.out, recipe, token=args.token, log=_log, **settings)
        if gguf_types:
            from converter.cli.gguf import export_merged

            exported = export_merged(result.out, gguf_types, log=_log, written=written,
                                     merged_logits=report.merged_logits if report is not None else None)  # fmt: skip
    finally:
        if tee is not None:
            tee.discard()  # what export did not take (all of it, if anything failed)
    out = {"out": str(result.out), "files": paths(result.out, [*result.files, *_report_file(report)])}
    outcome = verified("merge", report, **out) if report is not None else not_asked("merge", **out)
    if exported is not None:
        outcome = outcome.with_proofs(exported.as_proofs())
        outcome = replace(outcome, files=outcome.files + tuple(str(f) for f in exported.files))
    return mlx.export_merged(result.out, mlx_types, outcome, log=_log) if mlx_types else outcome


def _report_file(report) -> list[str]:
    """verification.json, written next to the model by a verification that ran."""
    from converter.io.records import REPORT_FILE

    return [] if report is None else [REPORT_FILE]


def _run_verify(args: argparse.Namespace) -> Outcome:
    """Verify a merged folder against --base/--adapter, or against the recipe recorded in it."""
    from converter.engine.recipe import recorded_recipe
    from converter.jobs.pipeline import verify_folder

    if args.adapter:
        if not args.base:
            raise UsageError("give --base with --adapter (or neither: the folder's recipe says both)")
        from converter.engine.recipe import Recipe

        recipe = Recipe(base=args.base, adapters=_adapter_specs(args))
    else:
        recipe = recorded_recipe(args.folder)
        if args.base:
            recipe.base = args.base
    if args.config:
        recipe.base_config = args.config
    proofs = ("tensors", "behaviour") if args.proof == "both" else (args.proof,)
    report = verify_folder(args.folder, recipe, token=args.token, log=_log, report_path=args.report, proofs=proofs,
                           **_verify_settings(args))  # fmt: skip
    return verified("verify", report, out=str(args.folder))


def _run_push(args: argparse.Namespace) -> Outcome:
    """Merge (or take --from FOLDER) and publish, with its --gguf / --mlx repos (push() proves them before the
    commit and pushes them after it). The verification's report is read from the folder as it is published
    (push's `finished`), where the push verified it."""
    _one_blas_thread()
    from converter.jobs.pipeline import VERIFY, push

    recipe = None if args.from_folder else _recipe_from_args(args)
    settings = None if args.no_verify else _verify_settings(args)
    from converter.cli.options import options_from
    from converter.jobs.options import PushOptions

    options = options_from(PushOptions, args, verify=settings)
    from converter.cli import on_jobs

    if args.on_jobs:
        if recipe is None:
            raise UsageError("--on-jobs merges Hub sources in the Job; --from is for a folder on this machine")
        return on_jobs.run_push(args, recipe, options, _log)
    if recipe is not None:
        on_jobs.mount(args, recipe)
    if args.dry_run:
        if recipe is None:
            raise UsageError("--dry-run plans a merge; a --from folder is pushed as it is")
        details = on_jobs.dry_run(args, recipe, settings, "push", _log)
        return not_asked("push", "a dry run: nothing was written", details={"fit": details})
    stages: list[str] = []
    reports: list = []

    def finished(_folder, report) -> None:
        if VERIFY in stages:
            reports.append(report)

    result = push(args.repo, options, recipe=recipe, folder=args.from_folder, token=args.token, log=_log,
                  stage=stages.append, finished=finished, max_disk=on_jobs.max_disk(args))  # fmt: skip
    _log(result.summary())
    done = {"published": (result.published(), *(c.published() for c in result.companions))}
    if reports and reports[0] is not None:
        outcome = verified("push", reports[0], **done)
    elif settings is None:
        outcome = not_asked("push", **done)
    else:  # a --from folder without the recipe it was merged from: nothing to verify it against
        outcome = not_asked("push", "the folder has no recipe to verify it against", **done)
    return outcome.with_proofs(result.proofs)


def _run_convert(args: argparse.Namespace) -> Outcome:
    from converter.cli.convert import run_cli

    return run_cli(args, log=_log)


def _run_gguf(args: argparse.Namespace) -> Outcome:
    from converter.cli.gguf import run as run_gguf

    return run_gguf(args, log=_log)


def _run_batch(args: argparse.Namespace) -> Outcome:
    from converter.cli.batch import run_cli as run_batch_cli

    return run_batch_cli(args, log=_log)


def _run_method(args: argparse.Namespace) -> Outcome:
    """extract / resize / combine (converter.cli.methods)."""
    from converter.cli.methods import run as run_method

    return run_method(args, log=_log)


def _run_demo(args: argparse.Namespace) -> Outcome:
    from converter.jobs.demo import run_demo

    result, report = run_demo(args.dir, log=_log)
    files = paths(result.out, [*result.files, *_report_file(report)])
    return verified("demo", report, out=str(result.out), files=files)


def _run_space(args: argparse.Namespace) -> Outcome:
    """`space deploy`, the one space command."""
    from converter.app.deploy import deploy

    url = deploy(args.repo, source=args.source, token=args.token, private=args.private, log=_log)
    return not_asked("space", NOTHING_TO_PROVE, published=(Published(args.repo, url),))


# Command name -> its handler, which returns the outcome (failures raise: see main).
COMMANDS: dict[str, Callable[[argparse.Namespace], Outcome]] = {
    "inspect": _run_inspect,
    "merge": _run_merge,
    "verify": _run_verify,
    "push": _run_push,
    "convert": _run_convert,
    "gguf": _run_gguf,
    "batch": _run_batch,
    "extract": _run_method,
    "resize": _run_method,
    "combine": _run_method,
    "demo": _run_demo,
    "space": _run_space,
}


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code, from its outcome (with --json also printed, the last line of stdout)."""
    return execute(argv).exit_code


def execute(argv: list[str] | None = None) -> Outcome:
    """Run one command as `converter` does (its lines printed, --json's outcome too); its outcome, which callers
    in this process read instead of the printed text."""
    global _console
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code == 2 and _json_asked(argv):  # a usage error argparse found: refused, as an outcome too
            print(Outcome.failure(_verb(argv), UsageError(_Parser.refused or "usage error")).to_json(), flush=True)
        raise
    with quiet.session(verbose=args.verbose) as console:
        stdout = console.out
        if args.json:
            console.out = console.err  # stdout holds the outcome alone
        _console = console
        try:
            outcome = run(args)
        except ConverterError as e:
            console.error(f"error: {e}")
            outcome = Outcome.failure(args.command, e)
        except KeyboardInterrupt as e:
            console.error("interrupted; nothing was written")
            outcome = Outcome.failure(args.command, e)
        except Exception as e:  # noqa: BLE001 - a bug: show everything so it can be reported
            held = console.held_back().strip()
            if held:
                console.error(f"what the libraries printed before the failure (all of it with -v):\n{held}")
            console.error(traceback.format_exc().rstrip())
            console.error("error: unexpected failure (a bug in converter; please report it with the trace above)")
            outcome = Outcome.failure(args.command, e)
        finally:
            _console = None
        if args.json:
            print(outcome.to_json(), file=stdout, flush=True)
        return outcome


def _json_asked(argv: list[str]) -> bool:
    """`--json` among the options (before a `--`), for a command line argparse refused."""
    return "--json" in (argv[: argv.index("--")] if "--" in argv else argv)


def _verb(argv: list[str]) -> str:
    """The command named on a command line argparse refused ("" when none is)."""
    return next((a for a in argv if a in COMMANDS), "")
