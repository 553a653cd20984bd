"""The whole job, as every front end runs it: merge → card → upload.

A push that merges runs as a pipeline (converter.jobs.streaming): base shards download while the merge reads them,
output shards upload while it writes, and one commit at the end publishes them. It falls back to merging first
and publishing after only where the target repo already holds a model and neither --create-pr nor --overwrite
was given (then the result may be identical, a no-op, or must be refused before anything is uploaded).
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

from converter.engine.merging import TensorTee, merge
from converter.engine.recipe import Recipe, recorded_recipe
from converter.engine.writer import Shard
from converter.errors import OutputError, UsageError
from converter.hub import client as hub
from converter.hub.card import public_records, write_card
from converter.hub.publish import (
    Publication,
    PushResult,
    additions,
    check_repo_id,
    inspect_target,
    local_files,
    push_folder,
)
from converter.hub.sources import Fetched, fetch, is_diffusion_base, mounted, parse_source
from converter.io.optional import require
from converter.io.records import PROVENANCE_FILE, RECIPE_FILE
from converter.io.scratch import make_temp
from converter.io.units import human_bytes, parse_size
from converter.jobs.companions import Companions
from converter.jobs.fit import Estimate, check_here
from converter.jobs.options import PushOptions
from converter.jobs.shape import BaseHeaders, pipelined_shard_size
from converter.jobs.streaming import SHARDS_ON_DISK, WINDOW_SHARDS, ScratchMeter, ShardUploader, StreamedBase
from converter.training import is_training_checkpoint
from converter.verification import VerificationReport, card_section, markdown, require_pass, verify
from converter.verification.warmup import wait

TRANSFER, VERIFY, COMMIT = STAGES = ("download, merge, upload", "verify", "commit")  # `push(stage=...)`, in order

__all__ = ["STAGES", "push", "verify_folder"]  # the Python API of the whole job (docs/python-api.md)


def push(
    repo_id: str,
    options: PushOptions | None = None,
    *,
    recipe: Recipe | None = None,
    folder: str | Path | None = None,
    token: str | None = None,
    workdir: str | Path | None = None,
    log: Callable[[str], None] = print,
    check_shard: Callable[[Shard], None] | None = None,
    stage: Callable[[str], None] = lambda name: None,
    finished: Callable[[Path, VerificationReport | None], None] | None = None,
    keep_output: bool = False,
    tee: TensorTee | None = None,
    max_disk: int | None = None,
) -> PushResult:
    """Publish `folder`, or merge `recipe` and publish the result (pipelined: see the module's docstring), as
    `options` say (default: public, verified with the default settings). With `options.gguf` / `options.mlx`, the
    GGUF files and MLX folders are written and proven from the merged folder before the model's commit and pushed
    after it to their own repos (converter.jobs.companions); the result's `companions` and `proofs` hold them.

    With `options.verify` the folder is verified first (against the recipe it was merged from) and nothing is
    committed when it fails. `check_shard` runs on every output shard
    before its upload starts (a per-shard proof); raising stops the job, and nothing is committed. `stage` is told
    each of STAGES as the job enters it; `finished(folder, report)` sees the folder as it will be published (card
    and report written; `report` the verification's, None unverified) just before the commit, while it still
    exists (a merging push's folder is temporary);
    `keep_output` keeps every shard in it until then even without verification (`finished` reads them all);
    `tee` sees a merge's tensors as they are written (converter.engine.merging.TensorTee). A merge that cannot fit
    on this machine (converter.jobs.fit: its disk, at most `max_disk`, and memory, from the headers) is refused
    before anything is downloaded (DoesNotFit, naming the Hugging Face Jobs flavor that fits).
    """
    options = options or PushOptions()
    check_repo_id(repo_id)
    if (recipe is None) == (folder is None):
        raise UsageError("push needs either --from FOLDER or sources to merge (--base/--adapter or --recipe)")
    if not (options.gguf or options.mlx):
        return _push_model(repo_id, options, recipe, folder, token, workdir, log, check_shard, stage, finished,
                           keep_output, tee, max_disk)  # fmt: skip
    if tee is not None:
        raise UsageError("push: a tee of your own and options.gguf / options.mlx cannot both watch the merge")
    companions = Companions(repo_id, options, recipe.base if recipe else str(folder), token, log, workdir)
    try:
        if folder is not None:  # proven before anything is pushed
            companions.export(folder)

        def done(out: Path, report: VerificationReport | None) -> None:
            if finished is not None:
                finished(out, report)
            if recipe is not None:  # proven inside the push, before its commit
                companions.export(out, report)

        result = _push_model(repo_id, options, recipe, folder, token, workdir, log, check_shard, stage, done,
                             keep_output=True, tee=companions.tee() if recipe is not None else None,
                             max_disk=max_disk)  # fmt: skip
        return dataclasses.replace(result, companions=companions.push(token=token, private=options.private),
                                   proofs=companions.proofs())  # fmt: skip
    finally:
        companions.discard()


def _push_model(repo_id: str, options: PushOptions, recipe: Recipe | None, folder: str | Path | None,
                token: str | None, workdir: str | Path | None, log: Callable[[str], None],
                check_shard: Callable[[Shard], None] | None, stage: Callable[[str], None],
                finished: Callable[[Path, VerificationReport | None], None] | None, keep_output: bool,
                tee: TensorTee | None, max_disk: int | None) -> PushResult:  # fmt: skip
    """The model's own push (push() without its companions)."""
    verify, private, create_pr, overwrite = options.verify, options.private, options.create_pr, options.overwrite
    who = hub.whoami_info(token)  # a missing or refused token fails now, not after the merge
    if recipe is not None and verify is not None:
        check_extras(recipe, token)
    if recipe is not None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        target = inspect_target(api, repo_id, token, create_pr, who)
        if create_pr or overwrite or not target.has_model:
            publication = Publication(api, target, private=private, create_pr=create_pr, overwrite=overwrite, log=log)
            return _push_streamed(publication, recipe, token, workdir, verify, check_shard, stage, finished, log,
                                  keep_output, tee, max_disk)  # fmt: skip
        whole = "the repo holds a model already: merged whole first, compared before any upload"
        check_here(recipe, verify, token, workdir, whole=whole, max_disk=max_disk)
    tmp = None
    try:
        if recipe is not None:
            tmp = make_temp("push", workdir, log)
            recipe.out = str(tmp / repo_id.split("/")[1])
            stage(TRANSFER)
            folder = merge(recipe, token=token, log=log, tee=tee).out
        folder = Path(folder)
        report = None
        if verify is not None and (recipe is not None or (folder / RECIPE_FILE).is_file()):
            stage(VERIFY)
            report = verify_folder(folder, recipe or recorded_recipe(folder), token=token, log=log, publishing=True,
                                   **verify)  # fmt: skip
        replace = {}
        if (folder / PROVENANCE_FILE).is_file():
            _write_card(folder, repo_id)
            replace = public_records(folder)
        if finished is not None:
            finished(folder, report)
        stage(COMMIT)
        return push_folder(folder, repo_id, token=token, private=private, create_pr=create_pr, overwrite=overwrite,
                           replace=replace, log=log, who=who)  # fmt: skip
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_card(folder: Path, load_name: str) -> None:
    """The folder's card, its verification section rendered from the folder's report (if it has one)."""
    write_card(folder, load_name=load_name, verification=card_section(VerificationReport.load(folder)))


def verify_folder(
    folder: str | Path,
    recipe: Recipe,
    *,
    token: str | None = None,
    report_path: str | Path | None = None,
    log: Callable[[str], None] = print,
    shard_proof=None,
    streamed=None,
    publishing: bool = False,
    **settings,
):
    """Verify, record the report next to the model, refresh the card; VerificationFailed on a fail, NotVerified
    when no proof could judge it (the folder is kept, its card says so; `publishing`: nothing is pushed).
    Returns the VerificationReport. `shard_proof`: the tensor proof already run shard by shard (a pipelined
    push; see verify.shards); `streamed`: the behaviour compared while it streamed (verification.streamed)."""
    folder = Path(folder)

    wait()  # the warm-up import beside the merge (cli) finishes before anything here imports transformers

    if recipe.base and is_training_checkpoint(Path(recipe.base)):
        from converter.verification.training_merge import verify_training

        report = verify_training(folder, recipe, verify, token=token, log=log, **settings)
    else:
        report = verify(folder, recipe, token=token, log=log, shard_proof=shard_proof, streamed=streamed, **settings)
    if report_path:
        Path(report_path).write_text(report.to_json())
    if (folder / PROVENANCE_FILE).is_file():
        _write_card(folder, f"./{folder.name}")
    log(markdown(report))
    then = ("; nothing was pushed (--no-verify pushes it unproven)" if publishing else
            f"; {folder} is kept, its card says not verified (--no-verify skips verification)")  # fmt: skip
    require_pass(report, then)
    return report


def _push_streamed(
    publication: Publication,
    recipe: Recipe,
    token: str | None,
    workdir: str | Path | None,
    verify: dict | None,
    check_shard: Callable[[Shard], None] | None,
    stage: Callable[[str], None],
    finished: Callable[[Path, VerificationReport | None], None] | None,
    log: Callable[[str], None],
    keep_output: bool = False,
    tee: TensorTee | None = None,
    max_disk: int | None = None,
) -> PushResult:
    """Download, merge and upload at once; one commit at the end, after verification when it is on (each shard
    is then proven tensor by tensor before its upload, verification.shards, and the behaviour compared as both
    models stream, verification.streamed)."""
    repo_id = publication.target.repo_id
    tmp = make_temp("push", workdir, log)
    meter = ScratchMeter([tmp])
    base_stream = uploader = shard_proof = behaviour = None
    try:
        recipe = copy.deepcopy(recipe)
        recipe.out = str(tmp / "out" / repo_id.split("/")[1])
        base_stream = _stream_base(recipe.base, token, tmp, meter)
        base, weights = _base_and_weights(recipe.base, base_stream, token)
        fitted = _fits(recipe, verify, token, workdir, base, base_stream, max_disk)
        recipe.max_shard_size = recipe.max_shard_size or (str(fitted.shard) if fitted.shard else None)
        recipe.max_shard_size = pipelined_shard_size(recipe.max_shard_size, weights)
        if base_stream is not None:
            base_stream.window = WINDOW_SHARDS * parse_size(recipe.max_shard_size)
        keep = keep_output
        if verify is not None and "tensors" in verify.get("proofs", ("tensors",)):
            from converter.verification.shards import ShardProof

            shard_proof = ShardProof(recipe, token=token, log=log, base=Path(base.local))
            check_shard = _checks(shard_proof.check, check_shard)
        if verify is not None:
            behaviour, whole = _streamed_proofs(recipe, verify, base, base_stream, shard_proof, token, log)
            keep = keep or whole  # verification reads the finished folder
            if whole:
                _whole_fits(tmp, base_stream, weights)
        uploader = _shard_uploader(publication, tmp, meter, check_shard, base_stream, keep, behaviour, log)
        stage(TRANSFER)
        folder = _merge_overlapped(recipe, token, base, base_stream, shard_proof, uploader, log,
                                   _tees(tee, behaviour))  # fmt: skip
        report = None
        if verify is not None:
            stage(VERIFY)
            local = {"base": Path(base.local)} if base_stream is not None else {}  # (not fetched again)
            report = verify_folder(folder, recipe, token=token, log=log, shard_proof=shard_proof, streamed=behaviour,
                                   publishing=True, **verify, **local)  # fmt: skip
        operations, paths = _commit_contents(folder, repo_id, uploader)
        meter.sample()
        log(
            f"scratch disk peak: {meter.peak / 2**20:.1f} MiB (weights {weights / 2**20:.1f} MiB, output shards of "
            f"{parse_size(recipe.max_shard_size) / 2**20:.1f} MiB)"
        )
        if finished is not None:
            finished(folder, report)
        stage(COMMIT)
        return publication.commit(operations, paths)
    except BaseException:
        if uploader is not None:
            uploader.abort()
        publication.abandon()
        raise
    finally:
        if behaviour is not None:
            behaviour.abort()
        if base_stream is not None:
            base_stream.close()
        if shard_proof is not None:
            shard_proof.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _stream_base(spec: str, token: str | None, tmp: Path, meter: ScratchMeter) -> StreamedBase | None:
    """A Hub base's shards not already cached stream in while the merge reads them, for this job only. None: a
    local base."""
    source = parse_source(spec)
    if not source.repo_id or mounted(source) is not None:  # local, or a Jobs volume: read in place
        return None
    return StreamedBase.open(spec, token, tmp / "base", meter)


def _fits(recipe: Recipe, verify: dict | None, token: str | None, workdir: str | Path | None, base: Fetched,
          base_stream: StreamedBase | None, max_disk: int | None) -> Estimate:  # fmt: skip
    """Refused (DoesNotFit) before any weight is downloaded when this machine cannot hold the job, streamed or
    whole (converter.jobs.fit), from the headers the stream has read already; the estimate it fits by (its output
    shard size: smaller on a small disk)."""
    side = sum(f["size"] or 0 for f in base.files if not f["name"].endswith(".safetensors"))
    headers = BaseHeaders(Path(base.local), side if base_stream is not None else 0, base_stream is not None)
    return check_here(recipe, verify, token, workdir, max_disk=max_disk, headers=headers)


def _streamed_proofs(recipe: Recipe, verify: dict, base: Fetched, base_stream: StreamedBase | None, shard_proof,
                     token: str | None, log: Callable[[str], None]):  # fmt: skip
    """The behavioural comparison that runs while both models stream (its reference built now, before the merge;
    None when not asked for), and whether verification must read the finished folder instead, which keeps the
    whole model on disk: where either proof cannot run as the job streams."""
    proofs = verify.get("proofs", ("tensors", "behaviour"))
    why = None
    if shard_proof is not None and not shard_proof.open():
        why = f"the tensor proof reads the finished output ({shard_proof.declined})"
    elif "behaviour" in proofs:
        from converter.verification.streamed import prepare_streamed

        bare = shard_proof is None or not shard_proof.proof.referee.info.independent  # what changed is unproven
        check, why = prepare_streamed(recipe, verify, Path(base.local), base_stream, token, bare, log)
        if check is not None:
            return check, False
    if why is not None:
        log(f"verification reads the whole model once it is merged: {why}")
    return None, why is not None


def _whole_fits(tmp: Path, base_stream: StreamedBase | None, weights: int) -> None:
    """Verification that reads the finished folder keeps the whole output, and the base it downloads, on disk
    until the end: refused before anything is fetched when the disk cannot hold them."""
    need = weights + (sum(d.size for d in base_stream.downloads) if base_stream is not None else 0)
    free = shutil.disk_usage(tmp).free
    if need > free:
        raise OutputError(
            f"{tmp.parent}: not enough disk space: verifying this merge reads the base and the output whole "
            f"({human_bytes(need)}), {human_bytes(free)} free; point TMPDIR at a larger disk, or run it on Hugging "
            "Face Jobs (--on-jobs)",
            path=tmp.parent,
        )
    if base_stream is not None:
        base_stream.keep()


def _tees(*tees):
    """One TensorTee handing each call to every one of `tees` that is not None (or None when none is)."""
    present = [t for t in tees if t is not None]
    if len(present) < 2:
        return present[0] if present else None

    class Tees:
        def start(self, folder, specs):
            for t in present:
                t.start(folder, specs)

        def put(self, spec, chunks):
            for t in present:
                t.put(spec, chunks)

    return Tees()


def _base_and_weights(spec: str, base_stream: StreamedBase | None, token: str | None) -> tuple[Fetched, int]:
    """The base as the merge opens it, and its weights' size in bytes (which sizes the output shards)."""
    if base_stream is not None:
        base = base_stream.fetched
        return base, sum(f["size"] or 0 for f in base.files if f["name"].endswith(".safetensors"))
    base = fetch(spec, "model", token)
    return base, sum(p.stat().st_size for p in Path(base.local).rglob("*.safetensors"))


def _shard_uploader(
    publication: Publication,
    tmp: Path,
    meter: ScratchMeter,
    check_shard: Callable[[Shard], None] | None,
    base_stream: StreamedBase | None,
    keep: bool,
    reader,
    log: Callable[[str], None],
) -> ShardUploader:
    """Uploads each output shard once it is written and checked (`keep`: its file stays in the output folder;
    `reader`: also read by the streamed behaviour); a streamed base hears of each finished shard."""
    return ShardUploader(
        publication.api,
        publication.target.repo_id,
        tmp / "upload",
        ensure_repo=publication.ensure_repo,
        revision=publication.revision,
        create_pr=publication.new_pr,
        keep=keep,
        check=check_shard,
        finished=base_stream.shard_done if base_stream else None,
        written=base_stream.shard_written if base_stream else None,
        failed=base_stream.fail if base_stream else None,
        reader=reader.out_gate if reader is not None else None,
        meter=meter,
        log=log,
    )


def _merge_overlapped(
    recipe: Recipe,
    token: str | None,
    base: Fetched,
    base_stream: StreamedBase | None,
    shard_proof,
    uploader: ShardUploader,
    log: Callable[[str], None],
    tee: TensorTee | None = None,
) -> Path:
    """The merge with both ends overlapped: the base's bytes arrive as it reads, its shards upload as it writes.
    Returns the merged folder once every shard is proven (the last uploads may still be running)."""
    if base_stream is not None:
        base_stream.start()
    warmup = None
    if shard_proof is not None:  # transformers + PEFT for the first shard's referee, imported beside the merge
        from converter.verification.warmup import start as warmup
    disk = None if uploader.keep else SHARDS_ON_DISK * parse_size(recipe.max_shard_size)
    folder = Path(merge(recipe, token=token, log=log, base=base, on_shard=uploader.submit, tee=tee,
                        on_planned=warmup, disk=disk).out)  # fmt: skip
    uploader.checked()  # every shard proven; the last uploads go on during the rest of the verification
    if base_stream is not None and not base_stream.keeping and not base_stream.holding:
        base_stream.close()  # (a reader still holding files lets them go as it reads; the job closes it at its end)
    return folder


def _commit_contents(folder: Path, repo_id: str, uploader: ShardUploader) -> tuple[list, list[str]]:
    """The one commit's operations (the uploaded shards, then the card and every other file, records made
    public) and every path the published model has."""
    uploaded = uploader.close()
    _write_card(folder, repo_id)
    sent = {op.path_in_repo for op in uploaded}
    names = local_files(folder)
    operations = uploaded + additions(folder, [n for n in names if n not in sent], public_records(folder))
    return operations, sorted(sent | set(names))


def check_extras(recipe: Recipe, token: str | None) -> None:
    """Before anything is merged or written: verifying a diffusion merge needs diffusers (converter[diffusion])."""
    import importlib.util

    if importlib.util.find_spec("diffusers") is None and is_diffusion_base(recipe.base, token):
        require("diffusers", "verifying a diffusion merge")


def _checks(*checks: Callable[[Shard], None] | None) -> Callable[[Shard], None]:
    """One per-shard check that runs each of `checks` in turn."""

    def check(shard: Shard) -> None:
        for c in checks:
            if c is not None:
                c(shard)

    return check
