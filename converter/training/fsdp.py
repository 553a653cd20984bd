"""verl FSDP rank files (`model_world_size_{W}_rank_{r}.pt`): each tensor rebuilt from its shards by byte range.

A rank file is a `torch.save` zip whose values are DTensors (`Shard(d)` / `Replicate` placements on a
`("fsdp",)` or `("ddp", "fsdp")` mesh) or plain tensors sharded on dim 0. We unpickle it with
`weights_only=True` (torch allow-lists the DTensor types) onto the meta device: that gives every local
shard's shape, stride and byte offset in the file (`_checkpoint_offset`) without reading any data. A tensor is
then read shard by shard, so memory holds one tensor, never a rank file or the model.
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from converter.errors import CheckpointError
from converter.io.dtypes import TORCH_TO_ST

RANK_FILE = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")
MESHES = {("fsdp",), ("ddp", "fsdp")}  # what verl itself accepts


@dataclass(frozen=True)
class Piece:
    """One rank's local shard: where its storage starts in the file, and its view on that storage."""

    path: Path
    offset: int  # absolute byte offset of the storage in the file
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim: int | None  # concatenate the pieces on this dim; None: replicated, take the first
    pieces: tuple[Piece, ...]


def rank_files(folder: Path) -> tuple[int, list[Path]]:
    """The world size and the W rank files, checked against fsdp_config.json and each other."""
    found: dict[int, dict[int, Path]] = {}
    for p in folder.iterdir():
        if m := RANK_FILE.fullmatch(p.name):
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = p
    config = folder / "fsdp_config.json"
    declared = None
    if config.is_file():
        try:
            declared = int(json.loads(config.read_text())["world_size"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{config}: not a verl fsdp_config.json (no integer world_size)", file=config
            ) from None
    if not found:
        raise CheckpointError(
            f"{folder}: no model_world_size_W_rank_R.pt files (not a verl FSDP checkpoint folder)", file=folder
        )
    if len(found) > 1:
        raise CheckpointError(
            f"{folder}: rank files of several world sizes ({', '.join(map(str, sorted(found)))}); "
            "keep only the files of one save",
            file=folder,
        )
    (world,) = found
    if declared is not None and declared != world:
        raise CheckpointError(
            f"{config}: world_size is {declared} but the rank files are for world size {world} "
            "(files from another save mixed in?)",
            file=config,
        )
    missing = [r for r in range(world) if r not in found[world]]
    if missing:
        raise CheckpointError(
            f"{folder}: model_world_size_{world}_rank_{missing[0]}.pt is missing "
            f"({len(found[world])} of {world} rank files present); copy every rank's file",
            file=folder / f"model_world_size_{world}_rank_{missing[0]}.pt",
        )
    extra = sorted(r for r in found[world] if r >= world)
    if extra:
        raise CheckpointError(
            f"{found[world][extra[0]]}: rank {extra[0]} is outside world size {world}", file=found[world][extra[0]]
        )
    return world, [found[world][r] for r in range(world)]


def load_meta(path: Path, allow_pickle: bool) -> dict:
    """A rank file's state dict on the meta device: structure and byte offsets, no tensor data read."""
    import torch.distributed.tensor  # noqa: F401 - registers DTensor with the weights-only unpickler

    quiet = logging.getLogger("torch.distributed.device_mesh")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "unpickling of the DeviceMesh before the PGs were created": expected here
    try:
        state = torch.load(path, map_location="meta", weights_only=not allow_pickle, mmap=False)
    except pickle.UnpicklingError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(
            f"{path}: holds objects other than tensors, which a weights-only load refuses ({first}); "
            "pass --allow-pickle only if you trust where the file came from",
            file=path,
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{path}: not a readable torch.save file ({_first_line(e)}): truncated or corrupt? copy it again", file=path
        ) from None
    finally:
        quiet.setLevel(level)
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path}: expected a state dict (name -> tensor), found {type(state).__name__}", file=path
        )
    return state


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:160] if text else type(e).__name__


def piece_of(path: Path, t: torch.Tensor) -> Piece:
    if t.numel() == 0:  # an uneven split can leave a rank no rows: nothing to read
        return Piece(path, 0, 0, tuple(t.shape), tuple(t.stride()))
    storage = t.untyped_storage()
    offset = getattr(storage, "_checkpoint_offset", None)
    if offset is None:
        raise CheckpointError(
            f"{path}: cannot locate tensor data in the file (not a zip-format torch.save?)", file=path
        )
    return Piece(path, int(offset), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _placement(path: Path, name: str, value) -> tuple[torch.Tensor, int | None, tuple[int, ...], int]:
    """(local tensor, shard dim or None, global shape, how many ranks hold distinct shards) for one value."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(value, DTensor):
        mesh = value.device_mesh
        names = tuple(mesh.mesh_dim_names or ())
        if names not in MESHES:
            raise CheckpointError(
                f"{path}: tensor {name} is on a device mesh named {names or 'without names'}; "
                "only verl's ('fsdp',) and ('ddp', 'fsdp') meshes are understood",
                file=path,
                tensor=name,
            )
        placements = tuple(value.placements)
        if names == ("ddp", "fsdp"):
            if not isinstance(placements[0], Replicate):
                raise CheckpointError(
                    f"{path}: tensor {name} is not replicated across the ddp mesh dim ({placements})",
                    file=path,
                    tensor=name,
                )
            placements = placements[1:]
        (p,) = placements
        fsdp_size = mesh.shape[-1]
        if isinstance(p, Shard) and type(p) is Shard:
            return value._local_tensor, p.dim, tuple(value.shape), fsdp_size
        if isinstance(p, Replicate):
            return value._local_tensor, None, tuple(value.shape), fsdp_size
        raise CheckpointError(
            f"{path}: tensor {name} has placement {p}; only Shard(d) and Replicate can be reassembled "
            "(a Partial tensor is an unreduced sum: save the checkpoint after a reduction)",
            file=path,
            tensor=name,
        )
    if isinstance(value, torch.Tensor):
        return value, 0, (), 0
    raise CheckpointError(f"{path}: entry {name} is a {type(value).__name__}, not a tensor", file=path, tensor=name)


def index_ranks(files: list[Path], allow_pickle: bool) -> dict[str, Entry]:
    """Every tensor's pieces across the ranks, checked for agreement (names, dtypes, shapes, world size)."""
    world = len(files)
    per_rank: list[dict] = []
    for path in files:
        state = load_meta(path, allow_pickle)
        if per_rank and list(state) != list(per_rank[0]):
            other = sorted(set(state) ^ set(per_rank[0]))
            raise CheckpointError(
                f"{path}: holds other tensors than {files[0].name} (e.g. {other[0] if other else 'a different order'})",
                file=path,
            )
        per_rank.append(state)
    entries: dict[str, Entry] = {}
    for name in per_rank[0]:
        locals_, dims, shapes = [], set(), set()
        shards = None
        for path, state in zip(files, per_rank, strict=True):
            local, dim, shape, size = _placement(path, name, state[name])
            if size and size * (world // size) != world:
                raise CheckpointError(
                    f"{path}: tensor {name} is on a mesh of {size} ranks, not {world}", file=path, tensor=name
                )
            shards = size or world
            locals_.append((path, local))
            dims.add(dim)
            shapes.add(shape)
        if len(dims) != 1 or len(shapes) != 1 or len({t.dtype for _, t in locals_}) != 1:
            raise CheckpointError(
                f"{files[0].parent}: tensor {name} is sharded differently on different ranks",
                file=files[0].parent,
                tensor=name,
            )
        (dim,), (shape,) = dims, shapes
        pieces = tuple(piece_of(p, t) for p, t in locals_[:shards])
        dtype = locals_[0][1].dtype
        if dim is None:
            shape, pieces = pieces[0].shape, pieces[:1]
        else:
            if not shape:  # plain tensors: sharded on dim 0 by verl's convention
                first = pieces[0].shape
                shape = (sum(p.shape[0] for p in pieces), *first[1:]) if first else ()
            got = sum(p.shape[dim] for p in pieces) if pieces[0].shape else 0
            if len(shape) <= dim or got != shape[dim]:
                raise CheckpointError(
                    f"{files[0].parent}: tensor {name}: the shards add up to {got} rows on dim {dim}, "
                    f"the full tensor has shape {list(shape)}",
                    file=files[0].parent,
                    tensor=name,
                )
        if dtype not in TORCH_TO_ST:
            raise CheckpointError(
                f"{files[0]}: tensor {name} has dtype {dtype}, which safetensors cannot store",
                file=files[0],
                tensor=name,
            )
        entries[name] = Entry(name, dtype, tuple(shape), dim, pieces)
    return entries


def read_piece(piece: Piece, dtype: torch.dtype, size: int, name: str) -> torch.Tensor:
    """One local shard from its byte range (contiguous or not), as a fresh tensor."""
    item = torch.empty((), dtype=dtype).element_size()
    if math.prod(piece.shape) == 0:
        return torch.empty(piece.shape, dtype=dtype)
    span = 1 + sum((n - 1) * s for n, s in zip(piece.shape, piece.stride, strict=True))
    start = piece.offset + piece.storage_offset * item
    if start + span * item > size:
        raise CheckpointError(
            f"{piece.path}: tensor {name} lies past the end of the file (truncated: copy the file again)",
            file=piece.path,
            tensor=name,
        )
    buf = bytearray(span * item)
    with open(piece.path, "rb") as f:
        f.seek(start)
        if f.readinto(buf) != len(buf):
            raise CheckpointError(
                f"{piece.path}: tensor {name} could not be read completely (truncated file)",
                file=piece.path,
                tensor=name,
            )
    flat = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
    t = flat.as_strided(piece.shape, piece.stride)
    return t if t.is_contiguous() else t.contiguous()


class FsdpSource:
    """A verl FSDP folder's model rank files: names in rank 0's order, each tensor reassembled on demand."""

    kind = "verl FSDP"

    def __init__(self, folder: Path, *, allow_pickle: bool = False):
        self.folder = Path(folder)
        self.world_size, self.files = rank_files(self.folder)
        self.sizes = {p: p.stat().st_size for p in self.files}
        self.entries = index_ranks(self.files, allow_pickle)

    def names(self) -> list[str]:
        return list(self.entries)

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def storage_of(self, name: str) -> tuple:
        """Identity of the stored data (shared storages are saved once: a tied head and its embedding)."""
        e = self.entries[name]
        return tuple((p.path, p.offset, p.storage_offset, p.stride) for p in e.pieces)

    def read(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        if e.dim is None:
            return read_piece(e.pieces[0], e.dtype, self.sizes[e.pieces[0].path], name)
        out = torch.empty(e.shape, dtype=e.dtype)
        at = 0
        for piece in e.pieces:
            n = piece.shape[e.dim] if piece.shape else 0
            if n:
                out.narrow(e.dim, at, n).copy_(read_piece(piece, e.dtype, self.sizes[piece.path], name))
            at += n
        return out
