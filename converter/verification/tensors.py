"""The tensor proof: every tensor of a merged output, read from its files, against the base and a referee.

- A tensor the referee does not change must be the base's, byte for byte (or the base's exact cast to the
  output dtype under --dtype), compared by content.
- A tensor the referee changes must equal its expectation (base + ΔW, a replacement ...) to within the bound of
  one rounding to the output dtype, elementwise:

      |merged - expected| <= u·|expected| + u·|expected - base| + allowance + s

  u: the output dtype's unit roundoff (one rounding of the result); u·|ΔW|: a merge may round ΔW to the output
  dtype before adding it (PEFT's own merge of 16-bit adapter weights does); allowance: what float32 arithmetic
  may add, derived by the referee from what is computed (γ_n over the sum of the absolute values of the terms,
  |scale|·|B|@|A| for LoRA: referee.gamma); s: half the spacing of the dtype's subnormal numbers (rounding near
  zero is absolute, not relative). Each tensor's worst |merged - expected| / bound is its ratio:
  a right merge stays at or below 1, whatever it computed in, and a wrong module is off by many times its bound.
- Every tensor of the base must be there, and nothing else (a tied head the referee unties is expected; a head
  the base lacks that the referee adds whole is expected, in the base's weights' dtype; a base tensor the referee
  drops, such as a causal LM's head under the classifier made from it, must be gone).

Streaming: tensors are read from the files in row blocks of at most BLOCK_ELEMENTS elements (plain reads, not
memory maps, whose pages would count against the process), so memory does not grow with the model.
"""

from __future__ import annotations

import math
import os
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from converter.io.same_bytes import same_bytes
from converter.verification.referee import Expectation, Referee, RefereeInfo, RefereeUnavailable, could_not

UNIT_ROUNDOFF = {"F64": 2.0**-53, "F32": 2.0**-24, "F16": 2.0**-11, "BF16": 2.0**-8}
# Half the spacing of the smallest (subnormal) numbers: rounding near zero is off by this much, not by u·|x|.
SUBNORMAL_HALF_SPACING = {"F64": 2.0**-1075, "F32": 2.0**-150, "F16": 2.0**-25, "BF16": 2.0**-134}
# Rows per block: at most this many elements (4 MiB per float32 array). Small enough that a worker's few arrays
# per block (values, PEFT's ΔW, the rounded result, the bits read) stay in the CPU's last-level cache: on the 0.85 B
# benchmark model 4x this size took ~1.3x the proof's CPU time (memory traffic and page faults).
BLOCK_ELEMENTS = 2**20
FLOATING = ("F64", "F32", "F16", "BF16")
MAX_NAMED = 10  # failures kept one by one; the rest are counted


@dataclass(frozen=True)
class Location:
    """Where a tensor's bytes are: file, absolute byte range, safetensors dtype, shape."""

    path: Path
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class TensorCheck:
    """The proof's finding on one output tensor. `ratio`: worst |merged - expected| / bound over the elements
    that are not exactly the expectation rounded to the output dtype (0: none; > 1: wrong); `inexact`: how many
    such elements; `changed`: how many elements the adapters change at the output's precision (0: a merge that
    changed nothing would pass here); `relative` (failures only): ‖merged - expected‖ / ‖expected - base‖,
    the error as a share of what the adapters change (1: as if not merged, 2: the change negated)."""

    name: str
    kind: str  # "untouched" or the referee's kind of change ("LoRA", "DoRA", "replacement" ...)
    module: str | None = None
    ratio: float = 0.0
    numel: int = 0
    inexact: int = 0
    changed: int | None = None
    relative: float | None = None
    alignment: float | None = None  # (failures) cosine of (merged - expected) with (expected - base)
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


@dataclass
class TensorGroup:
    """The proof's counts over one component of the output ("unet", "text_encoder"; "model" for a plain one)."""

    tensors: int = 0
    changed: int = 0
    failed: int = 0
    worst_ratio: float = 0.0


@dataclass
class TensorProofResult:
    """The verdict of the tensor proof over a whole output (typed; the report stores it as is)."""

    referee: RefereeInfo
    tensors: int = 0
    untouched: int = 0
    changed: int = 0
    worst: TensorCheck | None = None  # the changed tensor with the highest ratio
    weakest_effect: TensorCheck | None = None  # the changed tensor with the fewest elements the adapters change
    elements: int = 0  # elements of the changed tensors
    inexact: int = 0  # of which not exactly the expectation rounded (each within its bound on a pass)
    failures: list[TensorCheck] = field(default_factory=list)
    failed: int = 0
    groups: dict[str, TensorGroup] = field(default_factory=dict)  # per component ("unet" ...): counts, worst ratio
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)  # expected although the base lacks them (a classifier's head)
    dropped: list[str] = field(default_factory=list)  # base tensors the referee leaves out (a causal LM's head)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failed and not self.missing and not self.extra


class TensorProof:
    """Prove a merged output tensor by tensor, streaming, one file (or one tensor) at a time.

    Usage (the whole folder at once, or shard by shard as a pipelined upload finishes them):

        proof = TensorProof(base_locations, referee, out_dtype="BF16")   # out_dtype None: each tensor's own
        for shard in finished_shards:
            checks = proof.check_file(shard)            # -> list[TensorCheck]; a bad one has .problem set
            if not all(c.ok for c in checks): ...       # stop early: this shard is wrong
        result = proof.result()                         # TensorProofResult: also missing and extra tensors

    `check_file(path, prefix)` reads every tensor of one safetensors file (`prefix`: the namespace of a
    diffusers component, "unet/"); `check_tensor(name, location)` one tensor. Each output tensor is read once,
    its base tensor once, block by block. `result()` is the final verdict: failures, tensors of the base that
    never came (dropped), names that are not the base's (extra), the worst ratio and the weakest effect.
    """

    def __init__(self, base: dict[str, Location], referee: Referee, out_dtype: str | None = None, workers: int = 0):
        self.base = base
        self.referee = referee
        self.rules: dict[str, Expectation] = referee.expectations()
        self.out_dtype = out_dtype
        self.dropped = set(getattr(referee, "dropped", ()))
        self.expected = (set(base) - self.dropped) | set(self.rules)
        self.weights_dtype = _weights_dtype(base)  # an added head's, when no out_dtype says
        self.seen: set[str] = set()
        self.extra: list[str] = []
        self.checks: list[TensorCheck] = []
        self.seconds = 0.0
        self.workers = workers or min(2, len(os.sched_getaffinity(0)))
        self._files: dict[Path, int] = {}
        self._failed: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._scratch = threading.local()  # each worker's reused block buffers (see _take)
        self._pool = None  # the workers, kept from file to file (see check_file)

    def check_file(self, path: Path, prefix: str = "") -> list[TensorCheck]:
        """Every tensor of one safetensors file, `workers` tensors at a time (each a different module, so the
        referee's per-module state is never shared; torch and the reads release the GIL). The same worker threads
        prove every file, each with its own block buffers: new threads per file (a push proves dozens of shards)
        left each one's buffers in an allocator arena of its own, and the process grew shard by shard (measured:
        240 MiB over a 3 GB model's 13 shards)."""
        from concurrent.futures import ThreadPoolExecutor

        from converter.io.safetensors_file import SafetensorsFile

        f = SafetensorsFile(Path(path))
        order = sorted(f.tensors.values(), key=lambda t: t.start)
        started = time.perf_counter()

        def one(t):
            return self._tensor(prefix + t.name, Location(f.path, t.start, t.end, t.dtype, t.shape))

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="converter-proof")
        checks = [c for c in self._pool.map(one, order) if c is not None]
        self._close_files()  # a file held open keeps its blocks once deleted: a push deletes what is proven
        self.seconds += time.perf_counter() - started
        return checks

    def close(self) -> None:
        """Stop the worker threads (a file's proof still under way finishes first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def check_tensor(self, name: str, out: Location) -> TensorCheck | None:
        """Check one output tensor (None: a name that is not the base's, counted as extra)."""
        started = time.perf_counter()
        try:
            return self._tensor(name, out)
        finally:
            self.seconds += time.perf_counter() - started

    def _tensor(self, name: str, out: Location) -> TensorCheck | None:
        with self._lock:
            if name not in self.expected:
                self.extra.append(name)
                return None
            self.seen.add(name)
        check = self._check(name, out)
        with self._lock:
            self.checks.append(check)
        return check

    def _check(self, name: str, out: Location) -> TensorCheck:
        rule = self.rules.get(name)
        base = self.base.get(rule.base_name if rule and rule.base_name else name)
        kind = rule.kind if rule else "untouched"
        module = rule.module if rule else None
        if base is None and not (rule and rule.added):
            return TensorCheck(name, kind, module, math.inf, problem="no base tensor to start from")
        if base is None:  # a head the base lacks: the referee's value whole, in the base's weights' dtype
            want_dtype, want_shape = self.out_dtype or self.weights_dtype, rule.shape
        else:
            want_dtype = self.out_dtype if self.out_dtype and base.dtype in FLOATING else base.dtype
            want_shape = (rule.shape if rule and rule.shape else None) or base.shape
        if out.dtype != want_dtype or tuple(out.shape) != tuple(want_shape):
            return TensorCheck(name, kind, module, math.inf, problem=(
                f"stored as {out.dtype} {list(out.shape)}, expected {want_dtype} {list(want_shape)}"))  # fmt: skip
        if rule is None:
            return self._untouched(name, base, out)
        try:
            return self._changed(name, rule, base, out)
        except Exception as e:  # noqa: BLE001 - the referee's library failed: it cannot judge, which is not "wrong"
            who = f"{self.referee.info.name} could not compute {name} ({rule.module})"
            raise RefereeUnavailable(could_not(who, e)) from None

    def _untouched(self, name: str, base: Location, out: Location) -> TensorCheck:
        differ = self._bytes_differ(base, out) if base.dtype == out.dtype else self._cast_differs(base, out)
        if not differ:
            return TensorCheck(name, "untouched")
        cast = "" if base.dtype == out.dtype else f" cast to {out.dtype}"
        problem = f"not changed by any adapter, but {differ} element(s) differ from the base{cast}"
        return TensorCheck(name, "untouched", ratio=math.inf, problem=problem)

    def _changed(self, name: str, rule: Expectation, base: Location, out: Location) -> TensorCheck:
        if out.dtype not in UNIT_ROUNDOFF:
            return TensorCheck(name, rule.kind, rule.module, math.inf, problem=f"{out.dtype} is not a float dtype")
        check = TensorCheck(name, rule.kind, rule.module, numel=math.prod(out.shape), changed=0)
        for s, e in self._blocks_of(rule, base, out):
            found = self._block(rule, base, out, s, e)
            if isinstance(found, str):
                check.problem, check.ratio = found, math.inf
                return check
            ratio, inexact, changed = found
            check.ratio, check.inexact, check.changed = max(check.ratio, ratio), check.inexact + inexact, (
                check.changed + changed)  # fmt: skip
        if not check.ratio <= 1:
            self._failed[name] = (rule, base, out)  # described in result(), for the failures it names
            check.problem = f"{check.ratio:.3g}x its rounding bound"
        return check

    def _blocks_of(self, rule: Expectation, base: Location | None, out: Location) -> list[tuple[int, int]]:
        whole = base is None or not rule.row_blocks or base.shape != out.shape
        return [(0, _rows_of(out))] if whole else _blocks(out.shape)

    def _expected(self, rule: Expectation, base: Location | None, out: Location, s: int, e: int, raw=None):
        """The referee's rows s:e, from the base's rows (the whole base tensor when not row by row; nothing for a
        head the base lacks); `raw`: those base rows as read already (their bits)."""
        import torch

        dtype = _working_dtype(out.dtype)
        if base is None:
            return rule.rows(torch.empty(0, dtype=dtype), s, e)
        if raw is None:
            raw = self._base_raw(rule, base, s, e)
        return rule.rows(self._values(raw, base, dtype), s, e)

    def _base_raw(self, rule: Expectation, base: Location | None, s: int, e: int):
        """The base's rows a block's expectation starts from, as read (None for a head the base lacks)."""
        if base is None:
            return None
        return self._raw_rows(base, s, e) if rule.row_blocks else self._raw_rows(base, 0, _rows_of(base))

    def _block(self, rule: Expectation, base: Location, out: Location, s: int, e: int):
        """(worst ratio, inexact elements, changed elements) of rows s:e, or the problem in words. Elements that
        are exactly the expectation rounded to the output dtype pass without more arithmetic (their error is at
        most half a unit in the last place, within u·|v|); only the others are held to the full bound. The base's
        rows are read once (their bits: what the adapters change; their values: the referee's input, which it
        overwrites with the merged rows, and the bound's base at the few inexact elements)."""
        import numpy as np
        import torch

        raw = self._base_raw(rule, base, s, e)
        want = self._expected(rule, base, out, s, e, raw)
        v = want.value
        m_bits = self._raw_rows(out, s, e).numpy()
        if tuple(v.shape) != (e - s, *out.shape[1:]):
            return f"the referee's {list(v.shape)} does not fit the output's {[e - s, *out.shape[1:]]}"
        rounded = self._take("rounded", v.numel(), _torch(out.dtype)).copy_(v.reshape(-1))  # torch's rounding
        rounded = rounded.view(_bits(out.dtype)).numpy()
        same_shape = base is not None and base.shape == out.shape  # then the base's rows read are rows s:e
        if same_shape:
            base_bits = raw.numpy() if base.dtype == out.dtype else _cast_bits(raw, base, out.dtype).numpy()
            changed = int(np.count_nonzero(rounded != base_bits))
        else:
            changed = rounded.size
        off = np.flatnonzero(rounded != m_bits)  # numpy's comparisons: several times torch's speed
        if not off.size:
            return 0.0, 0, changed
        off = torch.from_numpy(off)
        vv = v.reshape(-1)[off]
        mm = torch.from_numpy(m_bits[off.numpy()]).view(_torch(out.dtype)).to(vv.dtype)
        ww = raw.view(_torch(base.dtype)).reshape(-1)[off].to(vv.dtype) if same_shape else vv
        bound = _bound(vv, ww, _allowance_at(want.allowance, off, vv), out.dtype)
        ratio = float(((mm - vv).abs() / bound).max())
        return (math.inf if math.isnan(ratio) else ratio), int(off.numel()), changed  # NaN: never a pass

    def _relative(self, rule: Expectation, base: Location, out: Location) -> tuple[float, float | None]:
        """A failed tensor's ‖merged - expected‖ / ‖expected - base‖ and the cosine between the two (one more
        pass, for the failures the report names)."""

        err2 = change2 = dot = 0.0
        for s, e in self._blocks_of(rule, base, out):
            v = self._expected(rule, base, out, s, e).value
            err = (self._rows(out, s, e, v.dtype) - v).nan_to_num_(posinf=1e30, neginf=-1e30).reshape(-1)
            err2 += float(err.double().square().sum())
            if base is None or base.shape == out.shape:  # (an added head changes from nothing)
                change = (v if base is None else v - self._rows(base, s, e, v.dtype)).reshape(-1).double()
                change2, dot = change2 + float(change.square().sum()), dot + float(err.double() @ change)
        if change2 == 0:
            return (0.0 if err2 == 0 else math.inf), None
        return math.sqrt(err2 / change2), (dot / math.sqrt(err2 * change2) if err2 else None)

    def _values(self, raw, loc: Location, dtype):
        """A tensor's rows, as read (their bits), as numbers in `dtype` (exact for every float dtype up to its
        width): a copy even in the same dtype, since a referee merges into it and the bits stay the base's."""
        rows = raw.numel() // max(math.prod(loc.shape[1:]), 1) if loc.shape else None
        values = self._take("values", raw.numel(), dtype).copy_(raw.view(_torch(loc.dtype)))
        return values.reshape((rows, *loc.shape[1:]) if loc.shape else ())

    def _take(self, role: str, numel: int, dtype):
        """A flat tensor of `numel` elements for one role in this worker's block (its contents: garbage), reused
        from block to block up to BLOCK_ELEMENTS: a fresh 4 MiB tensor per block costs about as much in page faults
        and zeroing as the conversion that fills it. Larger ones are fresh."""
        import torch

        if numel > BLOCK_ELEMENTS:
            return torch.empty(numel, dtype=dtype)
        kept = self._scratch.__dict__
        buf = kept.get((role, dtype))
        if buf is None:
            buf = kept[(role, dtype)] = torch.empty(BLOCK_ELEMENTS, dtype=dtype)
        return buf[:numel]

    def _bytes_differ(self, a: Location, b: Location) -> int:
        """How many elements differ (0: identical bytes), read in blocks: equal blocks cost one memcmp."""
        import numpy as np

        count = 0
        for s, e in _blocks(a.shape):
            x, y = self._raw_rows(a, s, e).numpy(), self._raw_rows(b, s, e).numpy()
            if not same_bytes(x, y):
                count += int(np.count_nonzero(x != y))
        return count

    def _cast_differs(self, base: Location, out: Location) -> int:
        """How many elements differ from the base's exact cast to the output dtype (torch's conversion)."""
        import numpy as np

        count = 0
        for s, e in _blocks(base.shape):
            cast = _cast_bits(self._raw_rows(base, s, e), base, out.dtype).numpy()
            count += int(np.count_nonzero(cast != self._raw_rows(out, s, e).numpy()))
        return count

    def _raw_rows(self, loc: Location, start: int, end: int):
        """Rows start:end as integers of the element's width (exact bit patterns, NaN-safe comparisons)."""
        import torch

        row = _row_bytes(loc)
        data = self._read(loc.path, loc.start + start * row, (end - start) * row)
        return torch.frombuffer(data, dtype=_bits(loc.dtype)) if len(data) else torch.empty(0, dtype=_bits(loc.dtype))

    def _rows(self, loc: Location, start: int, end: int, dtype=None):
        """Rows start:end in `dtype` (float64 by default; exact for every float dtype up to its width)."""
        import torch

        raw = self._raw_rows(loc, start, end)
        shape = (end - start, *loc.shape[1:]) if loc.shape else ()
        return raw.view(_torch(loc.dtype)).to(dtype or torch.float64).reshape(shape)

    def _close_files(self) -> None:
        with self._lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()

    def _read(self, path: Path, offset: int, size: int):
        from converter.io.safetensors_file import buffer

        with self._lock:
            if path not in self._files:
                self._files[path] = os.open(path, os.O_RDONLY)
            fd = self._files[path]
        buf, done = buffer(size), 0  # not zero-filled, huge pages where the kernel gives them
        view = memoryview(buf)
        while done < size:
            got = os.preadv(fd, [view[done : done + 2**30]], offset + done)
            if not got:
                raise OSError(f"{path}: could not read {size} bytes at offset {offset} (truncated file?)")
            done += got
        if hasattr(os, "posix_fadvise"):  # read once: keep the page cache from growing by the model's size
            os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
        return buf

    def result(self) -> TensorProofResult:
        # Workers finish in any order: by name, ties (and so the report, and a re-push's "nothing changed") are
        # the same run to run.
        self.checks.sort(key=lambda c: c.name)
        failures = sorted((c for c in self.checks if not c.ok), key=lambda c: -c.ratio)
        for check in failures[:MAX_NAMED]:  # what the named failures look like: one more pass over each
            if check.name in self._failed:
                check.relative, check.alignment = self._relative(*self._failed[check.name])
                check.problem = _what(check)
        self._close_files()
        changed = [c for c in self.checks if c.kind != "untouched" and c.changed is not None]
        return TensorProofResult(
            referee=self.referee.info,
            tensors=len(self.checks),
            untouched=sum(c.kind == "untouched" for c in self.checks),
            changed=len(changed),
            worst=max(changed, key=lambda c: c.ratio, default=None),
            weakest_effect=min(changed, key=lambda c: c.changed / max(c.numel, 1), default=None),
            elements=sum(c.numel for c in changed),
            inexact=sum(c.inexact for c in changed),
            failures=failures[:MAX_NAMED],
            failed=len(failures),
            groups=_groups(self.checks),
            missing=sorted(self.expected - self.seen),
            extra=sorted(self.extra),
            added=sorted(n for n, r in self.rules.items() if r.added),
            dropped=sorted(self.dropped),
            seconds=round(self.seconds, 2),
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        )


def _weights_dtype(base: dict[str, Location]) -> str:
    """The dtype most of the base's floating tensors have (a head the base lacks is made in it)."""
    from collections import Counter

    counts = Counter(loc.dtype for loc in base.values() if loc.dtype in FLOATING)
    return counts.most_common(1)[0][0] if counts else "F32"


def _working_dtype(out_dtype: str):
    """float64 for 32/64-bit outputs; float32 for 16-bit ones, whose rounding (2^-8, 2^-11) dwarfs float32's
    own (2^-24, allowed for in the bound): half the memory traffic, the same verdict."""
    import torch

    return torch.float64 if out_dtype in ("F32", "F64") else torch.float32


def _cast_bits(raw, loc: Location, dtype: str):
    """A tensor's rows, as read, cast to `dtype` (torch's conversion: what --dtype writes), as integers."""
    return raw.view(_torch(loc.dtype)).to(_torch(dtype)).reshape(-1).view(_bits(dtype))


def _bound(v, w, allowance, out_dtype: str):
    """u·|v| + u·|v - w| + the referee's allowance + subnormal spacing (+ float32's own rounding of v, when the
    proof works in float32)."""
    import torch

    u = UNIT_ROUNDOFF[out_dtype]
    slack = 0.0 if v.dtype == torch.float64 else 4 * 2.0**-24
    bound = v.abs().mul_(u + slack).add_((v - w).abs_(), alpha=u)
    return bound.add_(allowance).add_(SUBNORMAL_HALF_SPACING[out_dtype] + 2.0**-149)


def _allowance_at(allowance, flat, like):
    """The referee's allowance at these flat positions of the block: a number, a tensor, or a function of them."""
    if callable(allowance):
        return allowance(flat).to(like.dtype)
    if isinstance(allowance, int | float):
        return allowance
    return allowance.reshape(-1)[flat].to(like.dtype)


def _groups(checks: list[TensorCheck]) -> dict[str, TensorGroup]:
    """Per component of a diffusers pipeline (the name's first part), else one group "model"."""
    out: dict[str, TensorGroup] = {}
    for c in checks:
        g = out.setdefault(c.name.split("/", 1)[0] if "/" in c.name else "model", TensorGroup())
        g.tensors += 1
        g.failed += not c.ok
        if c.kind != "untouched":
            g.changed += 1
            g.worst_ratio = max(g.worst_ratio, c.ratio)
    return out


def _what(check: TensorCheck) -> str:
    """A failure in words: how far off, in units of the bound, and what that looks like next to the change the
    adapters make (the same size, pointing back: not merged; twice its size, back: negated; the same, forward:
    applied twice)."""
    rel, cos = check.relative, check.alignment
    shape = "not finite" if rel is None or not math.isfinite(rel) else f"error {rel:.3g}x the adapters' own change"
    if rel is not None and cos is not None and math.isfinite(rel) and abs(cos) > 0.9:  # rounding blurs a little
        if abs(rel - 1) < 0.1:
            shape = "as if the change were not merged" if cos < 0 else "as if the change were applied twice"
        elif abs(rel - 2) < 0.1 and cos < 0:
            shape = "as if the change were negated"
    return f"{check.ratio:.3g}x its rounding bound ({shape})"


def _blocks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    rows = shape[0] if shape else 1
    per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
    step = max(1, BLOCK_ELEMENTS // max(per_row, 1))
    return [(s, min(s + step, rows)) for s in range(0, rows, step)] or [(0, 0)]


def _rows_of(loc: Location) -> int:
    return loc.shape[0] if loc.shape else 1


def _row_bytes(loc: Location) -> int:
    rows = _rows_of(loc)
    return (loc.end - loc.start) // rows if rows else 0


def _torch(dtype: str):
    from converter.io.dtypes import ST_TO_TORCH

    return ST_TO_TORCH[dtype]


def _bits(dtype: str):
    import torch

    from converter.io.dtypes import ITEMSIZE

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ITEMSIZE[dtype]]


def locations(checkpoint) -> dict[str, Location]:
    """Every tensor of a converter Checkpoint (plain folder, diffusers pipeline, single file) by its name."""
    out = {}
    for name in checkpoint.names():
        info = checkpoint.info(name)
        out[name] = Location(checkpoint.where[name].path, info.start, info.end, info.dtype, tuple(info.shape))
    return out
