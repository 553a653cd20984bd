"""The quick behavioural comparison of a causal LM with both models hollow: PEFT's unmerged reference and the
merged model each run their one forward unit by unit (converter.engine.precision), every weight read into float32
from its file when its unit runs, so neither model is ever in memory whole. A push runs it while the models
stream, so neither is on disk whole either; verification of a finished folder runs it the same way (the same
numbers, so a push and a re-push agree on the report).

Both models are built hollow (the module tree on no memory, converter.verification.peft_referee.hollow), every
weight a file's tensor. The reference's come from the base's files, which a push's download fills front to back
(a read waits for its bytes); the merged model's from the output shards, which the merge writes (a read waits for
the shard). Each side's gate counts the reads the forward will make of each base tensor and output shard and lets
it go after the last one, so the push gives its bytes back once everything else is done with them too. The push
holds the merge back while a few output shards are on disk, unless the merged model's forward waits for one not
written yet (`starved`: a layout whose order differs from the forward's; then the disk holds more).

It runs where the comparison is one forward over weights that are all plain file tensors: the quick mode, a
causal LM, PEFT folders, no 4-bit model, no QLoRA study, and a bare base (when the tensor proof has not already
shown what changed) only as a row of PEFT's mixed-adapter batch. Elsewhere Unstreamable says why, before anything
is merged, and the comparison loads the models as converter.verification.llm does.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from converter.engine.bnb4 import parse_output
from converter.engine.checkpoint import Checkpoint
from converter.engine.model_inputs import ModelLogits
from converter.engine.precision import FileTensor, SharedCompute, float32_compute
from converter.engine.recipe import Recipe
from converter.engine.writer import OutSpec, Shard
from converter.io.safetensors_file import SafetensorsFile
from converter.verification.fourbit import is_qlora
from converter.verification.llm import LLMCheck, Settings
from converter.verification.metrics import Run, mixed_batch_adapter, run_model, run_variants
from converter.verification.report import Clock, LLMBehaviour, Skip
from converter.verification.task_check import is_causal_lm

WEIGHTS = (
    "weights read block by block from their files into float32 buffers as they arrive, both models hollow "
    "(never a whole model in memory or, in a push, on disk)"
)
EXECUTION = f"{WEIGHTS}; the reference alone (the tensor proof shows what changed) and the merged model, side by side"
WITH_BARE_BASE = (f"{WEIGHTS}; the reference and the bare base in one PEFT mixed-adapter batch, and the merged model, "
                  "side by side")  # fmt: skip


class Unstreamable(Exception):
    """Why the comparison cannot run while the job streams (it then runs on the finished folder)."""


class Aborted(Exception):
    """The job stopped while a forward waited for weights."""


class BaseGate:
    """The reference's reads of the base's files: each waits for its bytes (`arrival`), and a tensor's bytes are
    let go (`let_go(path, start, end)`) after the forward's last read of them, or at once when the forward reads
    nothing of them; `finished` is told when the forward is over."""

    def __init__(self, tensors: dict[Path, list[tuple[int, int]]], arrival: Callable[[Path, int], None] | None,
                 let_go: Callable[[Path, int, int], None], finished: Callable[[], None] | None = None):  # fmt: skip
        self.tensors, self.arrival, self.let_go, self.finished = tensors, arrival, let_go, finished
        self.left: Counter = Counter()
        self._lock = threading.Lock()

    def expect(self, reads: list) -> None:
        with self._lock:
            self.left = Counter((src.path, src.start, src.end) for src in reads)
        for path, spans in self.tensors.items():
            for start, end in spans:
                if not self.left[path, start, end]:
                    self.let_go(path, start, end)

    def ready(self, src: FileTensor) -> FileTensor:
        if self.arrival is not None:
            self.arrival(src.path, src.end)
        return src

    def done(self, src: FileTensor) -> None:
        key = (src.path, src.start, src.end)
        with self._lock:
            self.left[key] -= 1
            last = self.left[key] == 0
        if last:
            self.let_go(*key)

    def open(self) -> None:
        """Stop holding: every tensor still counted is let go (the forward is over, failed or the job stopped)."""
        with self._lock:
            held, self.left = [key for key, n in self.left.items() if n > 0], Counter()
        for key in held:
            self.let_go(*key)
        if self.finished is not None:
            self.finished()


class OutputGate:
    """The merged model's reads of the output shards (converter.jobs.streaming.ShardReader): a read by tensor
    name waits for the shard holding it; a shard is let go after the forward's last read of it."""

    def __init__(self) -> None:
        self.located: dict[str, FileTensor] = {}
        self.shards: dict[Path, Callable[[], None]] = {}  # shards held: their let_go
        self.left: Counter | None = None  # reads still to come per tensor name, once expected
        self.waiting = False  # the forward waits for a tensor not written yet
        self.opened = False
        self._cond = threading.Condition()

    def arrived(self, shard: Shard, let_go: Callable[[], None]) -> None:
        tensors = SafetensorsFile(shard.path).tensors
        with self._cond:
            if self.opened:
                let_go()
                return
            for name, info in tensors.items():
                self.located[name] = FileTensor(shard.path, info.start, info.end, info.dtype)
            self.shards[shard.path] = let_go
            self._let_go_unread()
            self._cond.notify_all()

    @property
    def starved(self) -> bool:
        return self.waiting or self.opened

    def expect(self, reads: list) -> None:
        with self._cond:
            self.left = Counter(reads)
            self._let_go_unread()

    def ready(self, name: str) -> FileTensor:
        with self._cond:
            while name not in self.located and not self.opened:
                self.waiting = True
                self._cond.notify_all()
                self._cond.wait()
            self.waiting = False
            if name not in self.located:
                raise Aborted(f"the merged tensor {name} never came")
            return self.located[name]

    def done(self, name: str) -> None:
        with self._cond:
            self.left[name] -= 1
            self._let_go_unread()

    def _let_go_unread(self) -> None:
        """Shards none of whose tensors the forward will still read (under the lock)."""
        if self.left is None:
            return
        pending = {self.located[n].path for n, count in self.left.items() if count > 0 and n in self.located}
        for path in [p for p in self.shards if p not in pending]:
            self.shards.pop(path)()
        self._cond.notify_all()

    def open(self) -> None:
        """Stop holding: every shard is let go now and on arrival, and a waiting read gives up."""
        with self._cond:
            self.opened = True
            for let_go in self.shards.values():
                let_go()
            self.shards.clear()
            self._cond.notify_all()


def prepare_streamed(recipe: Recipe, verify: dict, base: Path, stream, token: str | None, bare_base: bool,
                     log: Callable[[str], None]) -> tuple[StreamedLLMCheck | None, str | None]:  # fmt: skip
    """The comparison of a push that streams `base` (`stream`: its download, converter.jobs.streaming.StreamedBase,
    or None for a local base), its reference built; or (None, why it cannot stream). Every base file is held from
    now on until the reference has read it. `verify`: the push's verification settings; `bare_base`: whether the
    bare base runs too (the tensor proof will not show what changed)."""
    from converter.verification import sources
    from converter.verification.prove import is_peft_folder

    settings = Settings(verify.get("prompts"), verify.get("mode", "quick"), verify.get("max_new_tokens", 16),
                        verify.get("memory"), token, bare_base=bare_base)  # fmt: skip
    if why := _recipe_refuses(recipe, settings):
        return None, why
    if not (base / "config.json").is_file() or (base / "model_index.json").is_file():
        return None, "only a transformers model's comparison streams"
    _, adapters = sources(recipe, token, base=base)
    if not_peft := [a.name for a in adapters if not is_peft_folder(a)]:
        return None, f"{', '.join(not_peft)} is not a PEFT adapter folder"
    arrival = functools.partial(stream.wait, other=True) if stream else None
    spans = {f.path: [(t.start, t.end) for t in f.tensors.values()] for f in Checkpoint(base).files}
    gate = BaseGate(spans, arrival, stream.let_go if stream else _keep, stream.done_holding if stream else None)
    try:
        check = _prepared(recipe, base, [a if a.is_dir() else a.parent for a in adapters], settings, gate, log)
    except Unstreamable as e:
        return None, str(e)
    check.prefetch = False  # the merge and the tensor proof compute beside it: reading ahead gains no time there
    if stream is not None:
        stream.hold()
    return check, None


def compare_finished(
    merged: Path, recipe: Recipe, base: Path, adapters: list[Path], settings: Settings,
    log: Callable[[str], None], clock: Clock,
) -> tuple[LLMBehaviour, tuple[list[str], list[str]], ModelLogits | None]:  # fmt: skip
    """The same comparison of a merged folder on disk (every shard already there), and the merged model's logits;
    Unstreamable where it cannot run this way, Skip where a forward failed."""
    from converter.engine.writer import OutSpec

    if why := _recipe_refuses(recipe, settings):
        raise Unstreamable(why)
    if "quantization_config" in json.loads((merged / "config.json").read_text()):
        raise Unstreamable("quantized models are compared loaded whole")
    check = _prepared(recipe, base, adapters, settings, BaseGate({}, None, _keep), log)
    check.clock = clock
    merged_files = Checkpoint(merged)
    check.start(merged, [OutSpec(n, merged_files.info(n).dtype, tuple(merged_files.info(n).shape))
                         for n in merged_files.names()])  # fmt: skip
    for f in merged_files.files:
        check.out_gate.arrived(Shard(f.path, f.path.name, "", 0, b"", tuple(f.tensors)), _keep)
    return *check.finish(), check.merged_logits


def _keep(*_) -> None:
    """A file of the user's: nothing to let go."""


def _prepared(recipe: Recipe, base: Path, adapters: list[Path], settings: Settings, gate: BaseGate,
              log: Callable[[str], None]) -> StreamedLLMCheck:  # fmt: skip
    from converter.verification.warmup import import_peft

    why, prefetch = _memory(base, adapters, settings)
    if why is not None:
        raise Unstreamable(why)
    import_peft()
    check = StreamedLLMCheck(recipe, base, adapters, settings, gate, log)
    check.prefetch = prefetch
    check.prepare()
    return check


def _recipe_refuses(recipe: Recipe, settings: Settings) -> str | None:
    """Why this merge's behaviour cannot be compared while it streams, from the recipe alone; None: it may be."""
    if settings.mode != "quick":
        return "the full check generates continuations, which read every weight once per token"
    if recipe.method not in (None, "sum"):
        return f"a --method {recipe.method} merge has no unmerged PEFT forward"
    if recipe.qlora_base == "dequantized" or parse_output(recipe.dtype) is not None:
        return "4-bit models are compared loaded whole"
    if not recipe.adapters:
        return "no adapters"
    return None


def _memory(base: Path, adapters: list[Path], settings: Settings) -> tuple[str | None, bool]:
    """(Why the two forwards do not fit the memory, or None; whether there is room to read each next block ahead
    as well, which is faster but holds a block more, with 1 GiB to spare for the rest of the job (a push's merge
    and tensor proof grow after this is decided): loading.streamed_working_set)."""
    from converter.io.memory import available_memory
    from converter.io.units import human_bytes
    from converter.verification.loading import block_bytes, streamed_working_set

    need, budget = streamed_working_set(base, adapters), settings.memory or available_memory()
    if need > budget:
        return f"its two forwards need about {human_bytes(need)} of memory, {human_bytes(budget)} is available", False
    return None, need + 2 * block_bytes(base) + 2**30 <= budget


class StreamedLLMCheck(LLMCheck):
    """LLMCheck's quick comparison with both models streamed: `prepare` before the merge, `start` (a TensorTee:
    the merge calls it once config.json and the tokenizer are written), `finish` after the merge."""

    def __init__(self, recipe: Recipe, base: Path, adapters: list[Path], settings: Settings, base_gate: BaseGate,
                 log: Callable[[str], None]):  # fmt: skip
        super().__init__(Path(), recipe, base, adapters, settings, Path(), log, Clock())
        self.base_gate, self.out_gate = base_gate, OutputGate()
        self.shared = SharedCompute()  # the two forwards take turns: one block of the two in float32 at a time
        self.prefetch = False  # each next block read ahead too, where memory has room for it
        self.bare_base, self.study, self.one_batch = settings.bare_base, False, settings.bare_base
        self.own, self.offload, self.stored_4bit, self.four_bit = True, None, None, None
        self.compute, self.reference = "float32", "the base + adapters applied unmerged through PEFT"
        self.runs: dict[str, Run | BaseException] = {}
        self.merged_logits: ModelLogits | None = None  # the merged model's, once finished (a GGUF proof reuses them)
        self._threads: list[threading.Thread] = []

    def prepare(self) -> None:
        """The reference built before anything is merged: Unstreamable (why) where the comparison cannot stream."""
        import torch

        if is_qlora(self.recipe, self.adapters):
            raise Unstreamable("QLoRA adapters are also measured against their 4-bit training setting")
        from converter.verification.referee import RefereeUnavailable

        self.dtype = torch.float32
        try:
            self.ref_model, self.ref_sources = _reference(self.base, self.adapters, self.recipe)
        except RefereeUnavailable as e:  # the loaded models' comparison says it in its own words
            raise Unstreamable(str(e)) from None
        self.class_name = type(self.ref_model.base_model.model).__name__
        if not is_causal_lm(self.class_name):
            raise Unstreamable(f"{self.class_name} is not a causal LM")
        if self.bare_base and mixed_batch_adapter(self.ref_model) is None:
            raise Unstreamable("the bare base runs in a forward of its own beside these adapters")

    # -- TensorTee -------------------------------------------------------------------------------------------------

    def start(self, folder: Path, specs: list[OutSpec]) -> None:
        """The output's config.json and tokenizer are written: the inputs, then both forwards on threads of their
        own (the merged model is built on its thread, from the output's config)."""
        counts = Counter()
        for spec in specs:
            counts[spec.dtype] += spec.nbytes
        self.output_dtype = counts.most_common(1)[0][0]
        self.merged = folder
        self._inputs()
        config = (folder / "config.json").read_bytes()
        self._spawn("reference", self._reference_forward)
        self._spawn("merged", lambda: self._merged_forward(config, {s.name for s in specs}))

    def put(self, spec: OutSpec, chunks: list) -> None:
        pass

    def _spawn(self, name: str, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self.runs[name] = e
                self.abort()

        thread = threading.Thread(target=run, name=f"verify-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _reference_forward(self) -> None:
        """The reference's one forward; with the bare base, both as rows of PEFT's mixed-adapter batch."""
        model = self.ref_model
        with float32_compute(model, self.ref_sources, self.base_gate, prefetch=self.prefetch, shared=self.shared):
            if self.bare_base:
                variants = [mixed_batch_adapter(model), "__base__"]
                self.runs["reference"], self.runs["bare base"] = run_variants(model, self.inputs, self.ppl_ids,
                                                                              variants)  # fmt: skip
            else:
                self.runs["reference"] = run_model(model, self.inputs, None, self.ppl_ids, 0)

    def _merged_forward(self, config: bytes, written: set[str]) -> None:
        model, sources = _merged(config, self.class_name, written)
        with float32_compute(model, sources, self.out_gate, prefetch=self.prefetch, shared=self.shared):
            self.runs["merged"] = run_model(model, self.inputs, None, self.ppl_ids, 0)

    def abort(self) -> None:
        """Stop: nothing is held any more, and a forward waiting for weights gives up."""
        self.base_gate.open()
        self.out_gate.open()

    # -- after the merge -----------------------------------------------------------------------------------------

    def finish(self) -> tuple[LLMBehaviour, tuple[list[str], list[str]]]:
        """Both forwards' logits compared and judged as LLMCheck judges them; Skip where a forward could not run."""
        from converter.verification.judge import judge_llm
        from converter.verification.metrics import compare
        from converter.verification.report import LogitComparison

        for thread in self._threads:
            thread.join()
        self.shared.close()
        self.abort()  # whatever is still held (reads that never happened) goes
        self.clock.lap(f"run reference{' and bare base' if self.bare_base else ''} and merged, side by side")
        failed = {k: v for k, v in self.runs.items() if isinstance(v, BaseException)}
        if failed or not {"reference", "merged"} <= set(self.runs):
            raise Skip(_why(failed) if failed else "the forwards did not run")
        ref, out, bare = self.runs["reference"], self.runs["merged"], self.runs.get("bare base")
        tol = self._tolerance(None)
        merged_vs_ref = LogitComparison(**compare(ref, out), perplexity_reference=ref.perplexity)
        base_vs_ref = LogitComparison(**compare(ref, bare), perplexity_reference=ref.perplexity) if bare else None
        findings = judge_llm(merged_vs_ref, base_vs_ref, tol)
        behaviour = self._behaviour(tol, merged_vs_ref, base_vs_ref, None, (bare, ref, out), None)
        behaviour.execution = WITH_BARE_BASE if bare else EXECUTION
        self.merged_logits = ModelLogits.of(self.inputs, out.logits)
        return behaviour, findings


def _why(failed: dict[str, BaseException]) -> str:
    from converter.verification.referee import could_not

    name, error = next(iter(failed.items()))
    return could_not(f"the {name} model's streamed forward failed", error)


def _reference(base: Path, adapters: list[Path], recipe: Recipe):
    """PEFT's unmerged model on the hollow base, and the base's file tensor for each of its hollow weights."""
    from converter.verification.loading import set_recipe_scales
    from converter.verification.peft_referee import hollow_peft_model

    where = Checkpoint(base).where
    sources: dict[int, FileTensor] = {}

    def map_weights(model, written: set[str], saved: dict) -> None:
        for t, names in _weights(model).items():
            if names[0] in written:
                continue
            src = next((s for n in names if (s := _file_tensor(where, saved.get(n, n), t)) is not None), None)
            if src is None and isinstance(t, _parameter()):
                raise Unstreamable(f"the base's {names[0]} is not a tensor of its files as the model holds it")
            if src is not None:
                sources[id(t)] = src

    model = hollow_peft_model(base, adapters, [f"adapter{i}" for i in range(len(adapters))], None, map_weights)
    set_recipe_scales(model, recipe)
    return model.eval(), sources


def _merged(config: bytes, class_name: str, written: set[str]):
    """The merged model, hollow, of the reference's class and the output's config; each weight's output tensor
    name (placed by the OutputGate as its shard arrives)."""
    import json

    from converter.engine.model_class import config_object, hollow_model
    from converter.verification.peft_referee import hollow, saved_names

    model = hollow_model(config_object(json.loads(config)), class_name)
    saved = saved_names(model)
    hollow(model)
    sources: dict[int, str] = {}
    for t, names in _weights(model).items():
        key = next((k for n in names if (k := saved.get(n, n)) in written), None)
        if key is None and isinstance(t, _parameter()):
            raise Unstreamable(f"the merged model's {names[0]} is no tensor of the output")
        if key is not None:
            sources[id(t)] = key
    return model.eval(), sources


def _parameter():
    import torch

    return torch.nn.Parameter


def _weights(model) -> dict:
    """Every parameter and persistent buffer, with all its names (a tied weight has several; the first is the
    one registered first). A buffer is read from the files where they have it, else kept as the model made it
    (as transformers' own loading does)."""
    out: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(p, []).append(name)
    for path, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out.setdefault(b, []).append(f"{path}.{name}" if path else name)
    return out


def _file_tensor(where: dict, key: str | None, t) -> FileTensor | None:
    """The checkpoint's tensor `key`, where it is stored as `t` is shaped and in a float dtype."""
    f = where.get(key) if key else None
    info = f.tensors[key] if f is not None else None
    if info is None or tuple(info.shape) != tuple(t.shape) or info.dtype not in ("F32", "BF16", "F16"):
        return None
    return FileTensor(f.path, info.start, info.end, info.dtype)
