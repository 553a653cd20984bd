"""Where weights come from: a local path, or `org/name[@revision][/path/in/repo]` on the Hugging Face Hub.

Every Hub source is resolved to a commit sha before anything is downloaded; that sha is what recipes,
provenance and cards name. Downloads go through huggingface_hub into the normal HF cache (reused across runs)
and fetch only what the job needs.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from converter.errors import BadInputError, ConverterError, HubError, OutputError, UsageError
from converter.hub import client as hub
from converter.io.units import human_bytes

HUB_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[^/\s]+))?(?:/(?P<path>\S+))?$")

# What a merge needs from a base repo: weights (safetensors only), config, tokenizer, generation config, card,
# licence, custom code. Never original/, consolidated, GGUF, ONNX or other duplicate formats (top level only).
TOKENIZER_FILES = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.jinja",
    "chat_template.json",
    "*.tiktoken",
    "spiece.model",
]
MODEL_FILES = [
    "config.json", "generation_config.json", "model.safetensors", "model-*.safetensors",
    "model.safetensors.index.json", *TOKENIZER_FILES, "README.md", "LICENSE*", "USE_POLICY*", "NOTICE*",
    "configuration_*.py", "modeling_*.py", "tokenization_*.py",
]  # fmt: skip
ADAPTER_FILES = [
    "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "config.json", "README.md",
    *TOKENIZER_FILES,
]  # fmt: skip


# Per-job settings of a server front end (the Space app): its own HF cache folder, and Hub ids only (a user of a
# web form must not be able to name a file on the server). Context variables, so concurrent jobs do not mix.
_CACHE_DIR: ContextVar[str | None] = ContextVar("converter_cache_dir", default=None)
_HUB_ONLY: ContextVar[bool] = ContextVar("converter_hub_only", default=False)


@contextmanager
def job_sources(cache_dir: str | Path, hub_only: bool = True) -> Iterator[None]:
    """Within this block (same thread), downloads go to `cache_dir` and, with `hub_only`, local paths are refused."""
    tokens = (_CACHE_DIR.set(str(cache_dir)), _HUB_ONLY.set(hub_only))
    try:
        yield
    finally:
        _CACHE_DIR.reset(tokens[0])
        _HUB_ONLY.reset(tokens[1])


def cache_dir() -> str | None:
    """The HF cache folder of the current job (None: huggingface_hub's default)."""
    return _CACHE_DIR.get()


# Pinned Hub sources already on this machine, as a Hugging Face Jobs volume mounts a repo: (repo id, commit sha) ->
# the folder. Process-wide, not per context: the threads of a push (the proofs) fetch the base too.
_MOUNTED: dict[tuple[str, str], Path] = {}


def use_mounted(spec: str, folder: str | Path) -> None:
    """`spec` (org/name@<commit sha>) is already in `folder` (a Jobs volume): `fetch` reads it there, downloading
    nothing, and records it as the Hub id it is, so recipe, provenance and card stay true. Each file is checked
    against the Hub's listing of that commit (present, same size) when it is fetched."""
    source = parse_source(spec)
    if source.repo_id is None or not re.fullmatch(r"[0-9a-f]{40}", source.revision or ""):
        raise UsageError(f"{spec}: a mounted base is named by its commit, org/name@<40-hex sha>")
    if not Path(folder).is_dir():
        raise BadInputError(f"{folder}: the folder of the mounted base {spec} does not exist", file=folder)
    _MOUNTED[(source.repo_id.lower(), source.revision)] = Path(folder)


def mounted(source: Source) -> Path | None:
    """Where a pinned Hub source is mounted (use_mounted), or None."""
    if source.repo_id is None or source.revision is None:
        return None
    return _MOUNTED.get((source.repo_id.lower(), source.revision))


@dataclass(frozen=True)
class Source:
    """A parsed source spec: `local` for paths on disk, else a Hub repo (+ revision, + file inside it)."""

    spec: str
    local: Path | None = None
    repo_id: str | None = None
    revision: str | None = None
    path: str | None = None

    def __str__(self) -> str:
        return self.spec


@dataclass
class Fetched:
    """A source made local: where it is, and exactly which commit and files it came from."""

    source: Source
    local: Path
    sha: str | None = None
    files: list[dict] = field(default_factory=list)  # {"name", "size", "sha256"} as the Hub reports them
    card: str | None = None  # the repo's README.md text, when it has one
    # Weight files still arriving (converter.jobs.streaming): path -> the StreamedBase filling it (wait / release)
    streams: dict = field(default_factory=dict)

    @property
    def pinned(self) -> str:
        """`org/name@sha[/path]` for Hub sources, the absolute path for local ones: what a recipe records."""
        if self.source.repo_id is None:
            return str(self.local)
        return f"{self.source.repo_id}@{self.sha}" + (f"/{self.source.path}" if self.source.path else "")


def same_hub_model(declared: str, declared_revision: str | None, pinned: str) -> bool | None:
    """Whether an adapter's declared base (`org/name[@rev]`, PEFT's base_model_name_or_path + revision) is the
    pinned base `org/name@sha`: repo ids compared as the Hub does (case-insensitively), a declared commit against
    the resolved sha. None when either is not a Hub id (then only names can be compared). A declared branch or
    tag is taken as agreeing: resolving it would need the Hub, and a warning that may be wrong is worse."""
    ours, theirs = HUB_SPEC.match(pinned), HUB_SPEC.match(declared.strip())
    if not ours or not theirs or theirs["path"] or Path(declared).is_absolute() or declared.startswith("."):
        return None
    if ours["repo"].lower() != theirs["repo"].lower():
        return False
    revision, sha = theirs["rev"] or declared_revision, ours["rev"] or ""
    is_commit = bool(revision and re.fullmatch(r"[0-9a-f]{7,40}", revision))
    return not (is_commit and sha and not sha.startswith(revision))


def parse_source(spec: str) -> Source:
    path = Path(spec).expanduser()
    if _HUB_ONLY.get():
        if spec.startswith((".", "/", "~")) or not HUB_SPEC.match(spec) or ".." in spec:
            raise UsageError(f"{spec}: not a Hub id (write org/name, org/name@revision or org/name@rev/file)")
    elif path.exists():
        return Source(spec, local=path.resolve())
    if spec.startswith((".", "/", "~")):
        raise BadInputError(f"{spec}: no such file or folder", file=spec)
    m = HUB_SPEC.match(spec)
    if not m or ".." in spec:
        raise UsageError(
            f"{spec}: neither a local path nor a Hub id (write org/name, org/name@revision or org/name@rev/file)"
        )
    return Source(spec, repo_id=m["repo"], revision=m["rev"], path=m["path"])


@dataclass
class Remote:
    """A Hub source resolved to a commit: its files as the Hub lists them and the ones a job needs."""

    source: Source
    sha: str
    siblings: dict  # every file of the repo at `sha` -> huggingface_hub's RepoSibling (size, LFS sha256)
    wanted: list[str]

    @property
    def where(self) -> str:
        return f"{self.source.repo_id}@{self.source.revision or 'main'}"

    @property
    def ids(self) -> dict[str, str | None]:
        """The repo and revision asked for, as `hub.call` and HubError take them."""
        return {"repo_id": self.source.repo_id, "revision": self.source.revision or "main"}

    def records(self) -> list[dict]:
        """{"name", "size", "sha256"} of the wanted files, as the Hub reports them (LFS ids: no hashing)."""
        return [
            {"name": n, "size": self.siblings[n].size, "sha256": getattr(self.siblings[n].lfs, "sha256", None)}
            for n in self.wanted
        ]

    def cached(self, name: str, token: str | None = None) -> str | None:
        """Where `name` already is in the HF cache (of this job), or None."""
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.source.repo_id, name, cache_dir=cache_dir(), revision=self.sha)
        return found if isinstance(found, str) else None


def resolve(source: Source, kind: str = "model", token: str | None = None) -> Remote:
    """Pin a Hub source to its commit and decide which of its files a job of `kind` needs (nothing downloaded)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo, revision = source.repo_id, source.revision or "main"
    where = f"{repo}@{revision}"
    info = hub.call(
        where,
        lambda: api.model_info(repo, revision=revision, files_metadata=True),
        repo_id=repo,
        revision=revision,
    )
    siblings = {s.rfilename: s for s in info.siblings or []}
    _check_names(where, repo, revision, siblings)
    if source.path is not None:
        if source.path not in siblings:
            raise HubError(
                f"{where}: file {source.path} not found in the repo (files: {_sample(siblings)})",
                repo_id=repo,
                revision=revision,
                reason="file-not-found",
            )
        folder = source.path.rsplit("/", 1)[0] + "/" if "/" in source.path else ""
        wanted = [source.path] + [
            f"{folder}{n}" for n in ("adapter_config.json", "README.md") if f"{folder}{n}" in siblings
        ]
    elif kind == "model" and "model_index.json" in siblings:
        wanted = diffusers_files(list(siblings))
    else:
        patterns = MODEL_FILES if kind == "model" else ADAPTER_FILES
        wanted = [name for name in siblings if "/" not in name and any(fnmatch.fnmatch(name, p) for p in patterns)]
        _check_repo_kind(where, kind, wanted, siblings, repo, revision)
    return Remote(source, info.sha, siblings, wanted)


def fetch(spec: str, kind: str = "model", token: str | None = None, need_bytes: int = 0) -> Fetched:
    """Make a source local. `kind` is "model" or "adapter" and decides which files are fetched."""
    source = parse_source(spec)
    if source.local is not None:
        card = (source.local if source.local.is_dir() else source.local.parent) / "README.md"
        return Fetched(source, source.local, card=card.read_text(errors="replace") if card.is_file() else None)
    from huggingface_hub import hf_hub_download, snapshot_download

    remote = resolve(source, kind, token)
    if (folder := mounted(source)) is not None:
        return _from_mount(remote, folder)
    repo, sha, where, wanted = source.repo_id, remote.sha, remote.where, remote.wanted
    cache = cache_dir()
    missing = [n for n in wanted if remote.cached(n) is None]
    check_disk(where, sum(remote.siblings[n].size or 0 for n in missing) + need_bytes)
    if source.path is not None:
        paths = [
            Path(
                hub.call(
                    f"{where}/{n}",
                    lambda n=n: hf_hub_download(repo, n, revision=sha, token=token, cache_dir=cache),
                    **remote.ids,
                )
            )
            for n in wanted
        ]
        local = paths[0]
    else:
        local = Path(
            hub.call(
                where,
                lambda: snapshot_download(repo, revision=sha, allow_patterns=wanted, token=token, cache_dir=cache),
                **remote.ids,
            )
        )
    card_path = (local.parent if local.is_file() else local) / "README.md"
    card = card_path.read_text() if card_path.is_file() else None
    return Fetched(source, local, sha, remote.records(), card)


def _from_mount(remote: Remote, folder: Path) -> Fetched:
    """A pinned source read from its mount: every file the job needs there, of the size the Hub lists."""
    for name in remote.wanted:
        path, size = folder / name, remote.siblings[name].size
        if not path.is_file() or (size is not None and path.stat().st_size != size):
            state = "missing" if not path.is_file() else f"{path.stat().st_size} bytes, the Hub lists {size}"
            raise BadInputError(
                f"{folder}: not {remote.source.repo_id}@{remote.sha} as mounted: {name} is {state}", file=path
            )
    source = remote.source
    local = folder / source.path if source.path else folder
    card_path = (local.parent if source.path else local) / "README.md"
    card = card_path.read_text(errors="replace") if card_path.is_file() else None
    return Fetched(source, local, remote.sha, remote.records(), card)


def _check_names(where: str, repo: str, revision: str, names) -> None:
    """A server that lists `../x`, `/etc/x` or `a\\b` is not a Hub we can trust with paths on this disk."""
    for name in names:
        parts = name.split("/")
        if not name or name.startswith("/") or "\\" in name or "\0" in name or ".." in parts or "" in parts[:-1]:
            raise HubError(
                f"{where}: the Hub lists a file named {name!r}, which is not a path inside a repo; refusing to "
                "download from it (check HF_ENDPOINT)",
                repo_id=repo,
                revision=revision,
            )


def diffusers_files(names: list[str]) -> list[str]:
    """What a merge needs from a diffusers pipeline repo: model_index.json, the card and licence, and in each
    component folder its configs, tokenizer files and safetensors weights, without the `.fp16.`-style variants
    when the plain files are there, and without anything deeper or in other formats (.bin, .onnx, .ckpt)."""
    top = [
        n
        for n in names
        if "/" not in n and any(fnmatch.fnmatch(n, p) for p in ("model_index.json", "README.md", "LICENSE*"))
    ]
    out = list(top)
    folders = sorted({n.split("/")[0] for n in names if n.count("/") == 1})
    for folder in folders:
        files = [n.split("/", 1)[1] for n in names if n.startswith(f"{folder}/") and n.count("/") == 1]
        weights = [f for f in files if f.endswith(".safetensors")]
        plain = [f for f in weights if "." not in f[: -len(".safetensors")]]
        keep = plain or weights
        indexes = [f for f in files if f.endswith(".safetensors.index.json") and "." not in f.split(".safetensors")[0]]
        side = [f for f in files if f.endswith((".json", ".txt", ".model")) and not f.endswith(".index.json")]
        out += [f"{folder}/{f}" for f in sorted({*keep, *indexes, *side})]
    return out


def _sample(names) -> str:
    names = sorted(names)
    return ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")


def _check_repo_kind(where: str, kind: str, wanted: list[str], siblings: dict, repo: str, revision: str) -> None:
    """Refuse a repo that does not hold a `kind` (a model, or an adapter) at its top level."""
    ids = {"repo_id": repo, "revision": revision}
    if kind == "model":
        if "config.json" not in wanted:
            hint = " (it looks like an adapter: pass it as --adapter)" if "adapter_config.json" in siblings else ""
            raise HubError(f"{where}: not a model repo: no config.json{hint}", **ids)
        if not any(n.endswith(".safetensors") for n in wanted):
            raise HubError(
                f"{where}: the repo has no safetensors weights at the top level ({_sample(siblings)})", **ids
            )
    elif "adapter_config.json" not in wanted:
        raise HubError(
            f"{where}: no adapter_config.json; for a single adapter file write {repo}@REV/path/file.safetensors",
            **ids,
        )


def is_diffusion_base(spec: str, token: str | None) -> bool:
    """A diffusers pipeline (model_index.json) or a single .safetensors file (a single-file diffusion checkpoint),
    local or on the Hub; False when the Hub cannot say (the merge reports that itself)."""
    source = parse_source(spec)
    if source.local is not None:
        return (source.local / "model_index.json").is_file() or source.local.suffix == ".safetensors"
    if source.path is not None:
        return source.path.endswith(".safetensors")
    from huggingface_hub import file_exists

    try:
        repo, revision = source.repo_id, source.revision
        return hub.call(
            spec,
            lambda: file_exists(repo, "model_index.json", revision=revision, token=token),
            repo_id=repo,
            revision=revision,
        )
    except ConverterError:
        return False


def check_disk(where: str, need: int, what: str = "download + output") -> None:
    """A clear error now, not a full disk midway: `need` bytes must fit in the HF cache's file system."""
    from huggingface_hub import constants

    cache = Path(cache_dir() or constants.HF_HUB_CACHE)
    probe = cache if cache.exists() else next(p for p in cache.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if need > free:
        raise OutputError(
            f"{where}: not enough disk space: needs {human_bytes(need)} ({what}), {human_bytes(free)} free "
            f"in {probe} ({human_bytes(need - free)} missing)",
            path=probe,
        )
