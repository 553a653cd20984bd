"""`merge --gguf`: the GGUF files written while the merge streams, so the merged folder is never read back for them.

Why in the same pass: a GGUF's header needs every tensor's name and shape, and the merge plan knows them before the
first tensor is merged; so each file's header is written first (converter.gguf.write.GGUFFile) and each merged
tensor, as the merge writes it, is decoded, reordered and quantized into every requested file on a thread of its
own, holding a couple of tensors at most. The files are the same bytes `converter gguf` writes from the merged
folder (tests/gguf/test_gguf_stream.py compares them); they are proven afterwards, as export's files are, the tensor
proof reading each file back against the digests of what the merge streamed (converter.gguf.write.Written) instead
of reading the merged folder again.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from converter.engine.model_class import wait_for_warmup
from converter.engine.writer import OutSpec
from converter.gguf.arch import family_of
from converter.gguf.quantize import on_this_thread_alone
from converter.gguf.source import Entry, Source, check_dtype, decode
from converter.gguf.types import written_in_python
from converter.gguf.vocab import vocab_metadata
from converter.gguf.write import GGUFFile, Written
from converter.io.background import Worker


class GGUFTee:
    """The engine's TensorTee (converter.engine.merging) writing GGUF files of `types` into a folder of its own
    inside `out`; `finish` hands their paths to export (converter.gguf.export), `discard` removes them."""

    def __init__(self, types: list[str], out: Path, stem: str, log: Callable[[str], None] = print):
        self.types, self.stem, self.log = written_in_python(types), stem, log
        self._made_out = None if out.exists() else out  # removed again by discard if still empty
        out.mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix=".gguf-streamed-", dir=out))
        self.files: dict[str, GGUFFile] = {}
        self._worker: Worker | None = None
        self._buffer, self._started = None, False  # see _float32, _write

    def start(self, folder: Path, specs: list[OutSpec]) -> None:
        wait_for_warmup()  # the header needs transformers' tokenizer; a verified merge may be importing it already
        config = json.loads((folder / "config.json").read_text())
        for s in specs:
            check_dtype(folder, s.name, s.dtype)
        source = Source(folder, config, {s.name: Entry(None, 0, 0, s.dtype, tuple(s.shape)) for s in specs})
        family = family_of(config, folder)
        vocab = vocab_metadata(folder, config, family)
        for t in self.types:
            path = self.folder / f"{self.stem}-{t}.gguf"
            self.log(f"{path.name}: writing as the merge streams")
            self.files[t] = GGUFFile(source, family, t, path, name=self.stem, vocab=vocab)
        # two tensors queued at most: the merge waits rather than memory growing
        self._worker = Worker(self._write, maxsize=2, name="converter-gguf")

    def put(self, spec: OutSpec, chunks: list) -> None:
        if any(f.wants(spec.name) for f in self.files.values()):
            self._worker.put((spec, chunks))

    def _write(self, item: tuple[OutSpec, list]) -> None:
        spec, chunks = item
        if not self._started:  # the first tensor, on the tee's thread
            on_this_thread_alone()
            self._started = True
        data = self._float32(chunks, spec.dtype, tuple(spec.shape))
        for f in self.files.values():
            if f.wants(spec.name):
                f.put(spec.name, data)

    def _float32(self, chunks: list, dtype: str, shape: tuple[int, ...]):
        """A merged tensor's bytes, in the chunks the merge wrote, as float32: bf16 widened chunk by chunk into one
        buffer kept for every tensor (a new one per tensor cost more in page faults than the widening itself; each
        file is done with a tensor before the next comes); any other dtype, or a chunk that splits a value, through
        source.decode."""
        import numpy as np

        n = int(np.prod(shape, dtype=np.int64))
        if dtype != "BF16" or any(len(c) % 2 for c in chunks) or sum(len(c) for c in chunks) != 2 * n:
            return decode(b"".join(chunks), dtype, shape)  # (a wrong size is refused there, as it always was)
        if self._buffer is None or self._buffer.size < n:
            self._buffer = np.empty(n, np.uint32)
        out, at = self._buffer[:n], 0
        for chunk in chunks:
            values = np.frombuffer(chunk, np.uint16)
            np.left_shift(values, np.uint32(16), out=out[at : at + len(values)], dtype=np.uint32)
            at += len(values)
        return out.view(np.float32).reshape(shape)

    def finish(self) -> dict[str, Written]:
        """Wait for the last tensor; every file complete and in place. Returns {type: the file and its digests}."""
        if self._worker is not None:
            self._worker.close()
        self._buffer = None
        for f in self.files.values():
            f.finish()
        return {t: Written(f.path, f.digests) for t, f in self.files.items()}

    def discard(self) -> None:
        if self._worker is not None:
            self._worker.abort()
        self._buffer = None
        for f in self.files.values():
            f.abort()
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._made_out is not None:
            with contextlib.suppress(OSError):
                self._made_out.rmdir()  # only if nothing else was put there
