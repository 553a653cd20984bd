"""The Hub job as a pipeline: base weights stream in while the merge reads them, output shards stream out as soon
as the merge finishes each, and one commit publishes them all at the end.

Three things run at once. A download thread fills each base weight file that the HF cache does not already have
into a job-owned file, front to back; before any data arrives that file is a stand-in with the real header
(fetched byte for byte) and the real length, so the whole plan (and every error) exists first, and the merge reads
each tensor as soon as its bytes are there. The merge itself writes output shards; each one, once durable, goes to
an upload thread that runs the per-shard check (when one is given), then `preupload_lfs_files` with the sha256
the writer took as it wrote (no second read). Files fetched only for this job are deleted once merged (after the
output shard holding their last tensor is finished), output shards once uploaded, so the scratch disk holds a few
shards, whatever the model's size. Files already in the user's HF cache are read from there and left alone.

A verified push reads both models again for its behavioural comparison, while they stream
(converter.verification.streamed): a base file or an output shard is then also *held* until that comparison has
read it, and the merge waits while more than a few output shards are held, so the bound stays. Where the
comparison cannot stream, everything is held until the end (the whole model on disk, as the check says before).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from converter.engine.writer import Shard
from converter.errors import BadInputError, ConverterError, HubError
from converter.hub import client as hub
from converter.hub.sources import Fetched, Remote, cache_dir, parse_source, resolve
from converter.io.background import Worker
from converter.io.holes import punch
from converter.io.safetensors_header import HeaderError, decode_header

# Base bytes on disk at once (downloaded, not yet given back), in output shards: those the shard being proven reads,
# those the merge reads now and those arriving. Readers past it wait, unless every one of them waits for bytes.
WINDOW_SHARDS = 2
CHUNK = 64 * 2**20  # a download's range requests, the window checked between them
# Output shards on disk at most: the one being written, and three more (being proven, uploading, being read); the
# merge waits for one to go, unless a reader waits for one not written yet.
SHARDS_ON_DISK = 4


def _disk_bytes(folders: list[Path]) -> int:
    """Bytes the files under `folders` take on disk (holes not counted), and those of files this process deleted
    there but still holds open (their blocks stay until they are closed)."""
    total = 0
    for folder in folders:
        for root, _, names in os.walk(folder):
            for name in names:
                with contextlib.suppress(FileNotFoundError):  # deleted by another thread meanwhile
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total + _deleted_but_open(folders)


def _deleted_but_open(folders: list[Path]) -> int:
    """Blocks of files under `folders` that are deleted but still open in this process (Linux: /proc/self/fd)."""
    total, roots = 0, tuple(str(f) for f in folders)
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.endswith(" (deleted)") and target.startswith(roots):
                    total += os.stat(f"/proc/self/fd/{fd}").st_blocks * 512
    return total


class ScratchMeter:
    """The largest disk use of the job's own folders seen at the pipeline's events (shards in and out)."""

    def __init__(self, folders: list[Path]):
        self.folders, self.peak = folders, 0
        self._lock = threading.Lock()

    def sample(self) -> None:
        used = _disk_bytes(self.folders)
        with self._lock:
            self.peak = max(self.peak, used)


class _Download:
    """One base file, filled front to back; `have` bytes from the start are on disk, `freed` of them given back
    (holes where every reader is done with a tensor, converter.io.holes)."""

    def __init__(self, index: int, name: str, path: Path, size: int):
        self.index, self.name, self.path, self.size = index, name, path, size
        self.have = self.freed = 0
        self.started = self.deleted = False
        self.tensors: dict[str, tuple[int, int]] = {}  # name -> its bytes [start, end) in the file
        self.after: str | None = None  # the merge's last read of the file: it goes after this output's shard ...
        self.tensor_after: dict[str, str] = {}  # ... or a tensor after its own last read's output's shard
        self.held: set[tuple[int, int]] = set()  # tensor byte ranges another reader still reads (see hold)
        self.gone: set[str] = set()  # tensors whose bytes were given back


class StreamedBase:
    """A Hub base for one job: side files from the HF cache, weights from the cache where they already are,
    the rest downloaded by one thread into job-owned files that the merge reads as they arrive, deleted once
    merged and no longer held."""

    def __init__(self, remote: Remote, folder: Path, token: str | None, meter: ScratchMeter | None = None):
        self.remote, self.folder, self.token, self.meter = remote, folder, token, meter
        self.downloads: list[_Download] = []
        self.window = WINDOW_SHARDS * 256 * 2**20  # bytes; the push sets it from its output shards' size
        self._cond = threading.Condition()
        self._waits: list[str] = []  # readers ("merge", "other") waiting for bytes not yet here
        self._holding = False  # another reader holds files (see `hold`)
        self._error: BaseException | None = None
        self._stop = False
        self._written: set[str] = set()  # output tensors in shards written, proven or not
        self._finished: set[str] = set()  # ... and proven
        self._keep = False  # every file stays until close (verification reads the whole base after the merge)
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, spec: str, token: str | None, folder: Path, meter: ScratchMeter | None = None) -> StreamedBase:
        """Resolve the base, link its side files and cached weights into `folder`, stand-ins for the rest."""
        from huggingface_hub import hf_hub_download

        source = parse_source(spec)
        remote = resolve(source, "model", token)
        self = cls(remote, folder, token, meter)
        weights = sorted(n for n in remote.wanted if n.endswith(".safetensors"))
        for name in remote.wanted:
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            cached = remote.cached(name)
            if name in weights and cached is None:
                self.downloads.append(_Download(len(self.downloads), name, target, remote.siblings[name].size or 0))
                continue
            if cached is None:  # a side file (config, tokenizer, card): small, into the HF cache as usual
                cached = hub.call(
                    f"{remote.where}/{name}",
                    lambda n=name: hf_hub_download(
                        remote.source.repo_id, n, revision=remote.sha, token=token, cache_dir=cache_dir()
                    ),
                    **remote.ids,
                )
            os.symlink(os.path.realpath(cached), target)
        for d in self.downloads:
            self._standin(d)
        return self

    @property
    def fetched(self) -> Fetched:
        """The base as `merge` takes it; its job-owned files carry their arrival and release hooks."""
        source = self.remote.source
        local = self.folder / source.path if source.path else self.folder
        card = (local.parent if local.is_file() else local) / "README.md"
        streams = {d.path: self for d in self.downloads}
        text = card.read_text(errors="replace") if card.is_file() else None
        return Fetched(source, local, self.remote.sha, self.remote.records(), text, streams)

    # -- HTTP --------------------------------------------------------------------------------------------------------

    def _get(self, name: str, start: int, end: int, sink: Callable[[bytes], None]) -> None:
        """Bytes [start, end) of `name` at the pinned commit, passed to `sink` as they arrive."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.remote.source.repo_id, name, revision=self.remote.sha)
        headers = {**build_hf_headers(token=self.token), "Range": f"bytes={start}-{end - 1}"}
        with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=60) as r:
            if r.status_code >= 400:
                r.read()
                hf_raise_for_status(r)
            if r.status_code != 206 and start > 0:
                raise HubError(f"{self.remote.where}/{name}: the server ignored a Range request", **self.remote.ids)
            for chunk in r.iter_bytes():  # as received: a dropped connection loses nothing already read
                sink(chunk)

    def _range(self, name: str, start: int, end: int) -> bytes:
        def get() -> bytes:
            buf = bytearray()
            self._get(name, start, end, buf.extend)
            return bytes(buf)

        return hub.call(f"{self.remote.where}/{name}", get, **self.remote.ids)

    def _standin(self, d: _Download) -> None:
        """The file with its real header bytes and its real length, the data a hole until it arrives."""
        head = _RangeReader(self, d.name)
        try:
            decode_header(head, d.size)  # two range reads: the length, then the header it announces
        except HeaderError as e:
            raise BadInputError(f"{self.remote.where}/{d.name}: {e}", file=f"{self.remote.where}/{d.name}") from None
        with open(d.path, "wb") as f:
            f.write(head.seen)
            f.truncate(d.size)
        d.have = len(head.seen)
        header, data = decode_header(io.BytesIO(bytes(head.seen)), d.size)
        d.tensors = {name: (data + e["data_offsets"][0], data + e["data_offsets"][1]) for name, e in header.items()
                     if name != "__metadata__"}  # fmt: skip

    # -- the download thread -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="converter-download", daemon=True)
        self._thread.start()

    def _present(self) -> int:
        """Base bytes on disk now (downloaded, not given back)."""
        return sum(d.have - d.freed for d in self.downloads if d.started and not d.deleted)

    def _may_fetch(self) -> bool:
        """Whether the next chunk may come: while the window has room, or when every reader waits for bytes not
        here yet (none of them can then free any: a read out of order, such as a head at the end from the first
        file). A busy reader holds the others back instead."""
        if self._keep or self._present() < self.window:
            return True
        if self._proof_behind():
            return False  # the shards' proof will give bytes back, without waiting for any download
        return set(self._waits) >= ({"merge", "other"} if self._holding else {"merge"})

    def _proof_behind(self) -> bool:
        """Whether bytes on disk wait only for the proof of a shard already written."""
        pending = self._written - self._finished
        for d in self.downloads:
            if d.started and not d.deleted:
                for name, span in d.tensors.items():
                    if name not in d.gone and span not in d.held and d.tensor_after.get(name, d.after) in pending:
                        return True
        return False

    def _run(self) -> None:
        try:
            for d in self.downloads:
                with self._cond:
                    d.started = True
                self._fill(d)
        except BaseException as e:  # noqa: BLE001 - handed to the readers
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _fill(self, d: _Download) -> None:
        where = f"{self.remote.where}/{d.name}"
        with open(d.path, "r+b", buffering=0) as f:
            metered = [d.have]

            def sink(chunk: bytes) -> None:
                if self._stop:
                    raise _Stopped
                f.seek(d.have)
                f.write(chunk)
                with self._cond:
                    d.have += len(chunk)
                    self._cond.notify_all()
                if self.meter is not None and d.have - metered[0] >= 64 * 2**20:
                    metered[0] = d.have
                    self.meter.sample()

            while d.have < d.size:  # a chunk at a time, each try resuming where the last one stopped
                with self._cond:
                    while not self._stop and not self._may_fetch():
                        self._cond.wait()
                end = min(d.size, d.have + CHUNK)
                hub.call(where, lambda end=end: self._get(d.name, d.have, end, sink), **self.remote.ids)
        if self.meter is not None:
            self.meter.sample()

    # -- the readers' side ---------------------------------------------------------------------------------------------

    def wait(self, path: Path, end: int, *, other: bool = False) -> None:
        """Block until bytes [0, end) of `path` are on disk (its readers read as the file arrives; a file of the
        HF cache is complete). `other`: a reader besides the merge (it holds files, see `hold`)."""
        d = self._by_path(path)
        if d is None:
            return
        with self._cond:
            reader = "other" if other else "merge"
            self._waits.append(reader)
            self._cond.notify_all()
            try:
                while d.have < end and self._error is None and not self._stop:
                    self._cond.wait()
            finally:
                self._waits.remove(reader)
            if d.have < end:
                if isinstance(self._error, ConverterError):
                    raise self._error
                why = self._error or "the job stopped"
                raise HubError(f"{self.remote.where}/{d.name}: download failed ({why})", **self.remote.ids)

    def release(self, path: Path, after: str, tensor: str | None = None) -> None:
        """The merge has read all it needs of `tensor` in `path` (None: of the whole file): its bytes can go once
        the output tensor `after` is in a finished (proven) shard."""
        d = self._by_path(path)
        with self._cond:
            if tensor is None:
                d.after = after
            else:
                d.tensor_after[tensor] = after
            self._give_back(d)

    def shard_written(self, tensors: tuple[str, ...]) -> None:
        """An output shard is written, its proof to come."""
        with self._cond:
            self._written.update(tensors)

    def shard_done(self, tensors: tuple[str, ...]) -> None:
        """An output shard is finished (and checked): the base bytes only it still needed can go."""
        with self._cond:
            self._finished.update(tensors)
            for d in self.downloads:
                self._give_back(d)

    def hold(self) -> None:
        """Keep every tensor of every job-owned file, even once merged, until `let_go` says another reader is done
        with it (call before the merge starts); that reader's waits count in the window until `done_holding`."""
        with self._cond:
            self._holding = True
            for d in self.downloads:
                d.held = set(d.tensors.values())

    def fail(self, error: BaseException) -> None:
        """The job failed elsewhere (an upload, a shard's proof): readers waiting for bytes get `error` now."""
        with self._cond:
            self._error = self._error or error
            self._stop = True
            self._cond.notify_all()

    def done_holding(self) -> None:
        """The other reader is done: what it still held goes once merged, and the window is the merge's."""
        with self._cond:
            self._holding = False
            for d in self.downloads:
                d.held.clear()
                self._give_back(d)
            self._cond.notify_all()

    def keep(self) -> None:
        """Keep every job-owned file until `close` (call before the merge starts)."""
        with self._cond:
            self._keep = True

    @property
    def keeping(self) -> bool:
        return self._keep

    @property
    def holding(self) -> bool:
        """Whether another reader still holds files (see `hold`)."""
        return self._holding

    def let_go(self, path: Path, start: int, end: int) -> None:
        """Another reader is done with bytes [start, end) of `path`, a tensor (a file of the HF cache: nothing to
        do)."""
        d = self._by_path(path)
        if d is None:
            return
        with self._cond:
            d.held.discard((start, end))
            self._give_back(d)

    def _give_back(self, d: _Download) -> None:
        """Holes where every reader is done with a tensor; the file goes once all of them are (under the lock)."""
        if d.deleted or self._keep:
            return
        for name, span in d.tensors.items():
            after = d.tensor_after.get(name, d.after)
            if name not in d.gone and after in self._finished and span not in d.held:
                d.gone.add(name)
                d.freed += punch(d.path, *span)
        if len(d.gone) == len(d.tensors) and d.after in self._finished:
            d.path.unlink(missing_ok=True)
            d.deleted = True
        self._cond.notify_all()

    def _by_path(self, path: Path) -> _Download | None:
        return next((d for d in self.downloads if d.path == Path(path)), None)

    def close(self) -> None:
        """Stop downloading and delete every job-owned file (the folder itself is the caller's)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=120)
        for d in self.downloads:
            d.path.unlink(missing_ok=True)
            d.deleted = True


class _RangeReader:
    """A Hub file read from its start by HTTP ranges, one per `read` (what the header codec asks for)."""

    def __init__(self, base: StreamedBase, name: str):
        self.base, self.name, self.seen = base, name, bytearray()

    def read(self, n: int) -> bytes:
        start = len(self.seen)
        data = self.base._range(self.name, start, start + n) if n > 0 else b""
        self.seen += data
        return data


class _Stopped(Exception):
    """The job ended while a download was running."""


class ShardReader(Protocol):
    """Reads the output shards while the job streams (the behavioural comparison of a verified push)."""

    def arrived(self, shard: Shard, let_go: Callable[[], None]) -> None:
        """`shard` (at its stable spool path) is on disk; call `let_go` once done with it."""

    @property
    def starved(self) -> bool:
        """Whether the reader waits for a shard not written yet (the merge must then go on, however many wait)."""


class ShardUploader:
    """Uploads each finished output shard (`preupload_lfs_files`) on its own thread while the merge goes on;
    `operations` are what the one commit at the end names. A shard's `check` (the tensor proof) runs on a thread
    of its own, before that shard's upload and during the previous one's, so a CPU-bound proof and a network-bound
    upload overlap instead of taking turns. Without `keep`, at most one shard waits at each step: a slower upload
    holds the merge back instead of filling the disk; a `reader` (the streamed behaviour) is handed each shard
    too, and its file goes once both the upload and the reader are done with it. With `keep` every shard also
    stays in the output folder (what reads the finished folder needs it), so nothing holds the merge back: it runs
    ahead of a slow upload."""

    def __init__(
        self,
        api,
        repo_id: str,
        spool: Path,
        *,
        ensure_repo: Callable[[], None],
        revision: str | None = None,
        create_pr: bool = False,
        keep: bool = False,
        check: Callable[[Shard], None] | None = None,
        finished: Callable[[tuple[str, ...]], None] | None = None,
        written: Callable[[tuple[str, ...]], None] | None = None,
        failed: Callable[[BaseException], None] | None = None,
        reader: ShardReader | None = None,
        meter: ScratchMeter | None = None,
        log: Callable[[str], None] = print,
    ):
        self.api, self.repo_id, self.spool = api, repo_id, spool
        spool.mkdir(parents=True, exist_ok=True)
        self.ensure_repo, self.revision, self.create_pr, self.keep = ensure_repo, revision, create_pr, keep
        self.check, self.finished, self.written, self.failed = check, finished, written, failed
        self.reader, self.meter, self.log = reader, meter, log
        self.operations: list = []
        self.uploaded = 0
        self._worker_items = 0
        self._gone = threading.Condition()
        self._alive: set[Path] = set()  # spool files on disk
        self._read: set[Path] = set()  # spool files the reader is done with (or never had)
        self._sent: set[Path] = set()  # spool files uploaded
        waiting = 0 if keep else 1  # 0: no limit
        self._worker = Worker(self._told(self._upload), maxsize=waiting, name="converter-upload")
        self._checker = (Worker(self._told(self._check), maxsize=waiting, name="converter-check")
                         if check is not None else None)  # fmt: skip

    def submit(self, shard: Shard) -> None:
        """Called by the writer thread with each durable shard; without `keep`, blocks while the uploader is a
        shard behind, or while SHARDS_ON_DISK shards would be on disk with the next one (unless the reader waits
        for one not written yet).

        The shard is hard-linked into the spool folder first: the merge's output folder is renamed into place
        when the merge ends, and without `keep` the shard leaves it at once (the spool's link is uploaded)."""
        link = self.spool / f"{self._worker_items:05d}-{shard.path.name}"
        self._worker_items += 1
        os.link(shard.path, link)
        if not self.keep:
            shard.path.unlink()
        with self._gone:
            self._alive.add(link)
        spooled = dataclasses.replace(shard, path=link)
        if self.written is not None:
            self.written(shard.tensors)
        if self.reader is not None:
            self.reader.arrived(spooled, lambda: self._done(link, self._read))
        else:
            self._read.add(link)
        (self._checker or self._worker).put(spooled)
        if not self.keep:
            self._make_room()

    def _make_room(self) -> None:
        """Wait until the next shard fits in SHARDS_ON_DISK (the reader's hunger is polled: it tells nobody)."""
        with self._gone:
            while len(self._alive) >= SHARDS_ON_DISK and not (self.reader is not None and self.reader.starved):
                self._gone.wait(0.05)
                if self._worker.failed or (self._checker is not None and self._checker.failed):
                    return  # the next put raises it

    def _done(self, link: Path, party: set[Path]) -> None:
        """One of the spool file's two users (upload, reader) is done with it; the second deletes it."""
        with self._gone:
            party.add(link)
            if link in self._read and link in self._sent:
                link.unlink(missing_ok=True)
                self._alive.discard(link)
                self._gone.notify_all()

    def _told(self, step: Callable[[Shard], None]) -> Callable[[Shard], None]:
        """`step`, whose failure `failed` also hears at once (a streamed base stops: the merge may be waiting for
        its bytes rather than at a shard, where the failure would reach it)."""

        def run(shard: Shard) -> None:
            try:
                step(shard)
            except BaseException as e:
                if self.failed is not None:
                    self.failed(e)
                raise

        return run

    def _check(self, shard: Shard) -> None:
        self.check(shard)
        self._worker.put(shard)

    def _upload(self, shard: Shard) -> None:
        from huggingface_hub import CommitOperationAdd
        from huggingface_hub.lfs import UploadInfo

        if self.finished is not None:
            self.finished(shard.tensors)
        if self.meter is not None:
            self.meter.sample()
        self.ensure_repo()
        name = shard.name
        op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(shard.path))  # reads 512 bytes, no hash
        op.upload_info = UploadInfo(size=shard.size, sample=shard.sample, sha256=bytes.fromhex(shard.sha256))
        started = time.monotonic()
        hub.call(
            self.repo_id,
            lambda: self.api.preupload_lfs_files(
                self.repo_id, [op], revision=self.revision, create_pr=self.create_pr or None
            ),
            repo_id=self.repo_id,
            revision=self.revision,
        )
        self.operations.append(op)
        self.uploaded += shard.size
        self._done(shard.path, self._sent)
        self.log(f"  uploaded {name} ({shard.size / 1e9:.2f} GB, {time.monotonic() - started:.1f} s)")

    def checked(self) -> None:
        """Wait until every submitted shard has passed its check (uploads may still be running); re-raise a
        failed check."""
        if self._checker is not None:
            self._checker.close()
            self._checker = None

    def close(self) -> list:
        """Wait for the last upload; the operations, in upload order."""
        self.checked()
        self._worker.close()
        return self.operations

    def abort(self) -> None:
        """Stop: the upload in flight ends, nothing queued starts (checks first: they feed the uploads)."""
        if self._checker is not None:
            self._checker.abort()
        self._worker.abort()
