"""The shape of a merge or push, read from headers alone: what it downloads, writes and holds, before any weight
is fetched (converter.jobs.fit turns this into disk, memory and time on a given machine).

A Hub base is read as converter.hub.remote_headers' stand-ins (its real safetensors headers, its data a hole); a
local base from its own files; adapters from the Hub's file listing or their files. Nothing here downloads a
weight, so a job that cannot fit is refused before it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from converter.engine.recipe import Recipe
from converter.errors import ConverterError
from converter.hub.remote_headers import hub_base_headers
from converter.hub.sources import Fetched, mounted, parse_source, resolve
from converter.io.dtypes import FLOATING, ITEMSIZE, parse_user_dtype
from converter.io.units import parse_size


def pipelined_shard_size(given: str | None, weights: int) -> str:
    """The output shard size of a pipelined push: the user's --max-shard-size when given (5GB too), else a sixteenth
    of the weights, 256 to 512 MiB, so that the first upload starts early, the last one (which nothing overlaps) is
    short, and the few shards a push holds on disk take the same room whatever the model's size."""
    return given if given is not None else str(min(512 * 2**20, max(256 * 2**20, weights // 16)))


@dataclass(frozen=True)
class JobShape:
    """Sizes in bytes. `hub`: the base is downloaded (a Hub base, not mounted); `largest_file`: its largest weight
    file, `largest_tensor` its largest tensor; `side`: its other files (configs, tokenizer); `adapters`: the Hub
    adapters' files; `output`: the merged weights; `behaviour`: what the streamed comparison holds, both forwards
    (converter.verification.loading.streamed_working_set; 0 where the comparison is not a transformers model's);
    `cannot_stream`: why the behaviour cannot be compared as the models stream on any machine (None: it can where
    memory allows); `verify`: whether verification runs at all."""

    base: str
    hub: bool
    weights: int
    largest_file: int
    largest_tensor: int
    side: int
    adapters: int
    output: int
    parameters: int
    behaviour: int
    cannot_stream: str | None
    verify: bool
    max_shard_size: str | None = None
    memory_budget: int | None = None  # --verify-memory: what the comparison may use, instead of what is available

    @property
    def shard(self) -> int:
        """The output shard size of a pipelined push (pipelined_shard_size)."""
        return parse_size(pipelined_shard_size(self.max_shard_size, self.weights))

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"shard": self.shard}


@dataclass(frozen=True)
class BaseHeaders:
    """A base as its headers: `path` (its folder or file: a Hub base's stand-ins, else the base itself), the bytes
    of the side files a download fetches, whether it is downloaded (`hub`), and for a Hub base the stand-ins as
    `merge(dry_run=True, base=...)` takes them (None where the plan needs real bytes: a pre-quantized base)."""

    path: Path
    side: int
    hub: bool
    fetched: Fetched | None = None


def shape_of(recipe: Recipe, verify: dict | None, token: str | None, workdir: Path,
             headers: BaseHeaders | None = None) -> JobShape:  # fmt: skip
    """The job's shape from headers (`workdir`: where a Hub base's stand-ins go; small, sparse files)."""
    headers = headers or base_headers(recipe.base, token, workdir)
    base, side, hub = headers.path, headers.side, headers.hub
    files = sorted(base.rglob("*.safetensors")) if base.is_dir() else [base]
    sizes = [f.stat().st_size for f in files]
    parameters, output, largest, transformers_model = _tensors(base, recipe.dtype)
    behaviour = _behaviour(base) if transformers_model and verify is not None else 0
    why = _cannot_stream(recipe, verify, transformers_model, token) if verify is not None else None
    return JobShape(
        base=recipe.base, hub=hub, weights=sum(sizes), largest_file=max(sizes, default=0), largest_tensor=largest,
        side=side, adapters=sum(adapter_bytes(s.source, token) for s in recipe.adapters), output=output or sum(sizes),
        parameters=parameters, behaviour=behaviour, cannot_stream=why, verify=verify is not None,
        max_shard_size=recipe.max_shard_size, memory_budget=(verify or {}).get("memory"),
    )  # fmt: skip


def base_headers(spec: str, token: str | None, workdir: Path) -> BaseHeaders:
    """The base's headers: a Hub base as stand-ins in `workdir`, a local or mounted one as it is."""
    source = parse_source(spec)
    if source.local is not None:
        return BaseHeaders(source.local, 0, False)
    if (folder := mounted(source)) is not None:
        return BaseHeaders(folder / source.path if source.path else folder, 0, False)
    if (cached := _cached(source, token)) is not None:
        return cached
    standin = hub_base_headers(source, token, workdir)
    side = sum(standin.sizes[n] for n in standin.files if not n.endswith(".safetensors"))
    config = standin.path / "config.json" if standin.path.is_dir() else None
    fetched = None
    if config is None or not config.is_file() or "quantization_config" not in config.read_text():
        records = [{"name": n, "size": standin.sizes.get(n), "sha256": None} for n in standin.files]
        fetched = Fetched(source, standin.path, standin.sha, records)
    return BaseHeaders(standin.path, side, True, fetched)


def _cached(source, token: str | None) -> BaseHeaders | None:
    """A Hub base whose every file is in the HF cache already: read there (nothing to download, nothing asked of
    the Hub but its listing)."""
    remote = resolve(source, "model", token)
    found = {name: remote.cached(name) for name in remote.wanted}
    if not found or None in found.values():
        return None
    name, path = next(iter(found.items()))
    root = Path(path[: -len(name)])  # the snapshot folder
    local = root / source.path if source.path else root
    return BaseHeaders(local, 0, False, Fetched(source, local, remote.sha, remote.records()))


def _tensors(base: Path, dtype: str | None) -> tuple[int, int, int, bool]:
    """(parameters, bytes of the merged weights, bytes of the largest base tensor, whether the base is one
    transformers model folder), from the headers; (0, 0, 0, False) where the base is no checkpoint converter reads
    that way (a training run)."""
    from converter.engine.base_reader import open_base

    try:
        checkpoint = open_base(base)
    except ConverterError:
        return 0, 0, 0, False
    target = parse_user_dtype(dtype) if dtype and not dtype.lower().startswith("bnb") else None
    parameters = output = largest = 0
    for name in checkpoint.names():
        info = checkpoint.info(name)
        parameters += info.numel
        largest = max(largest, info.numel * ITEMSIZE.get(info.dtype, 4))
        size = ITEMSIZE[target] if target and info.dtype in FLOATING else ITEMSIZE.get(info.dtype, 4)
        output += info.numel * size
    plain = base.is_dir() and (base / "config.json").is_file() and not (base / "model_index.json").is_file()
    return parameters, output, largest, plain and not getattr(checkpoint, "diffusion", False)


def _behaviour(base: Path) -> int:
    from converter.verification.loading import streamed_working_set

    try:
        return streamed_working_set(base)
    except (ConverterError, OSError, ValueError, KeyError):
        return 0


def _cannot_stream(recipe: Recipe, verify: dict, transformers_model: bool, token: str | None) -> str | None:
    """Why the behaviour cannot be compared while both models stream, whatever the machine: the reasons
    converter.verification.streamed gives a push, told from the recipe and the listings (the push itself decides;
    a model whose weights transformers converts on load is found only there, and then still refused before any
    download when its whole model does not fit)."""
    if verify.get("mode", "quick") != "quick":
        return "the full check generates continuations, which read every weight once per token"
    if "behaviour" not in verify.get("proofs", ("tensors", "behaviour")):
        return None
    if recipe.method not in (None, "sum"):
        return f"a --method {recipe.method} merge has no unmerged PEFT forward"
    if recipe.qlora_base == "dequantized" or (recipe.dtype or "").lower().startswith("bnb"):
        return "4-bit models are compared loaded whole"
    if not transformers_model:
        return "only a transformers model's comparison streams"
    not_peft = [s.source for s in recipe.adapters if not _peft_folder(s.source, token)]
    if not_peft:
        return f"{', '.join(not_peft)} is not a PEFT adapter folder"
    tasks = sorted({t for s in recipe.adapters if (t := _task_type(s.source, token)) not in (None, "CAUSAL_LM")})
    if tasks:
        return f"adapters trained for {', '.join(tasks)}: a task model is compared loaded whole, not as it streams"
    return None


def _task_type(spec: str, token: str | None) -> str | None:
    """A PEFT adapter folder's task_type, from its adapter_config.json (a Hub adapter's fetched into the HF
    cache, where its merge finds it); None where it says none or cannot be read."""
    import json

    source = parse_source(spec)
    try:
        if source.local is not None:
            config = source.local / "adapter_config.json"
        else:
            config = _hub_file(source, "adapter_config.json", token)
        return json.loads(config.read_text()).get("task_type")
    except (ConverterError, OSError, ValueError, AttributeError):
        return None


def _hub_file(source, name: str, token: str | None) -> Path:
    """One small file of a Hub repo, from the HF cache or downloaded into it."""
    from huggingface_hub import hf_hub_download

    from converter.hub import client as hub
    from converter.hub.sources import cache_dir

    remote = resolve(source, "adapter", token)
    found = remote.cached(name)
    if found is not None:
        return Path(found)

    def get() -> str:
        return hf_hub_download(source.repo_id, name, revision=remote.sha, token=token, cache_dir=cache_dir())

    return Path(hub.call(f"{remote.where}/{name}", get, **remote.ids))


def _peft_folder(spec: str, token: str | None) -> bool:
    source = parse_source(spec)
    if source.local is not None:
        return source.local.is_dir() and (source.local / "adapter_config.json").is_file()
    if source.path is not None:
        return False
    try:
        return "adapter_config.json" in resolve(source, "adapter", token).wanted
    except ConverterError:
        return False


def adapter_bytes(spec: str, token: str | None) -> int:
    """What an adapter's download takes (its files as the Hub lists them); 0 for a local one, read in place."""
    source = parse_source(spec)
    if source.local is not None:
        return 0
    try:
        return sum(r["size"] or 0 for r in resolve(source, "adapter", token).records())
    except ConverterError:
        return 0  # the job itself says what is wrong with it
