"""A Hub base model read from its configs and safetensors headers only, as a folder of sparse stand-in files.

Planning (the Space's Check), `inspect` and `convert --base` need names, shapes and byte ranges, never
weights. Each weights file becomes a stand-in with its real header and its real length, the data left a
hole (HTTP range reads of a few kilobytes; no disk used for the data), so `engine.base_reader.open_base` sees
exactly what it would see after the download.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from converter.errors import HubError, UsageError
from converter.hub import client as hub
from converter.hub.sources import (
    MODEL_FILES,
    TOKENIZER_FILES,
    Source,
    _check_repo_kind,
    cache_dir,
    diffusers_files,
    parse_source,
)
from converter.io.safetensors_header import encode_header, entry


@dataclass
class HubBase:
    path: Path  # the stand-in folder (or the single file asked for)
    repo: str
    sha: str
    where: str  # repo@revision, for messages
    files: list[str]  # what a download of this base would fetch
    sizes: dict[str, int]  # every file of the repo -> its size in bytes (0 when the Hub does not say)

    @property
    def pinned(self) -> str:
        return f"{self.repo}@{self.sha}"


def write_standin(path: Path, file_meta) -> None:
    """A safetensors file with the real header and the real length, its data a hole. `file_meta`: the Hub's
    parsed header (huggingface_hub's SafetensorsFileMetadata: .metadata, .tensors with dtype, shape,
    data_offsets)."""
    tensors = file_meta.tensors
    entries = {n: entry(t.dtype, t.shape, *t.data_offsets) for n, t in tensors.items()}
    raw = encode_header(entries, file_meta.metadata or None)
    end = max((t.data_offsets[1] for t in tensors.values()), default=0)
    with open(path, "wb") as f:
        f.write(raw)
        f.truncate(len(raw) + end)


def _names_only(name: str) -> bool:
    """Side files the planner reads: configs, indexes, model_index.json; never tokenizers or weights."""
    base = name.rsplit("/", 1)[-1]
    return base.endswith(".json") and not any(fnmatch.fnmatch(base, p) for p in TOKENIZER_FILES)


def hub_base_headers(spec: str | Source, token: str | None, workdir: Path) -> HubBase:
    """Stand-ins of a Hub base (`org/name[@rev]`, a diffusers pipeline repo, or `org/name[@rev]/file.safetensors`)
    in `workdir/<name>/`, named like the repo (the trained-on-another-base check compares names)."""
    from huggingface_hub import HfApi, hf_hub_download

    source = parse_source(spec) if isinstance(spec, str) else spec
    if source.local is not None:
        raise UsageError(f"{source.spec}: give the base as a Hub repo id, org/name or org/name@revision")
    api = HfApi(token=token)
    repo, revision = source.repo_id, source.revision or "main"
    where = f"{repo}@{revision}"
    ids = {"repo_id": repo, "revision": revision}
    info = hub.call(where, lambda: api.model_info(repo, revision=revision, files_metadata=True), **ids)
    siblings = {s.rfilename: s for s in info.siblings or []}
    if source.path is not None:
        if not source.path.endswith(".safetensors") or source.path not in siblings:
            raise HubError(
                f"{where}: {source.path} is not a .safetensors file of the repo",
                repo_id=repo,
                revision=revision,
                reason="file-not-found",
            )
        files = [source.path]
    elif "model_index.json" in siblings:
        files = diffusers_files(list(siblings))
    else:
        files = [n for n in siblings if "/" not in n and any(fnmatch.fnmatch(n, p) for p in MODEL_FILES)]
        _check_repo_kind(where, "model", files, siblings, repo, revision)
    folder = workdir / repo.split("/")[1]
    for name in files:
        target = folder / name
        if name.endswith(".safetensors"):
            meta = hub.call(
                f"{where}/{name}",
                lambda n=name: api.parse_safetensors_file_metadata(repo, n, revision=info.sha),
                **ids,
            )
            target.parent.mkdir(parents=True, exist_ok=True)
            write_standin(target, meta)
        elif _names_only(name):
            path = hub.call(
                f"{where}/{name}",
                lambda n=name: hf_hub_download(repo, n, revision=info.sha, token=token, cache_dir=cache_dir()),
                **ids,
            )
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(Path(path).read_bytes())
    sizes = {n: s.size or 0 for n, s in siblings.items()}
    return HubBase(folder / source.path if source.path else folder, repo, info.sha, where, files, sizes)
