"""PyTorch Distributed Checkpoint folders (`.metadata` + `__{rank}_{n}.distcp`; Megatron `torch_dist`, `dcp.save`).

`.metadata` is a pickle of every tensor's global shape, dtype and chunks (offsets, sizes), and where each chunk's
bytes lie (file, offset, length). We unpickle it with an allow-list of exactly those record types (no other
global can be named, so no code runs), then rebuild a tensor by reading only its chunks' byte ranges and placing
each at its offset. `dcp_to_torch_save` would load the whole model at once; this holds one tensor.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from converter.errors import CheckpointError
from converter.io.dtypes import TORCH_TO_ST

ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron-Core 0.16 keeps every rank's save plan in the metadata (`all_local_plans`): plain planner records
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
    },
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"} | {name for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
}  # fmt: skip


# Megatron-Core up to 0.15 pickles `.metadata` as its own Metadata subclass and each rank's plan as its own SavePlan
# subclass (extra field `mcore_data`, plain data); they are read into stand-ins of that shape, so Megatron need not
# be installed (or imported: no code of it runs).
MCORE = "megatron.core.dist_checkpointing.strategies.torch"


def _mcore_standin(name: str) -> type | None:
    from dataclasses import dataclass

    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

    if name == "MCoreMetadata":

        @dataclass
        class MCoreMetadata(Metadata):
            mcore_data: dict | None = None

        return MCoreMetadata
    if name == "MCoreSavePlan":

        @dataclass(frozen=True)
        class MCoreSavePlan(SavePlan):
            mcore_data: dict | None = None

        return MCoreSavePlan
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == MCORE and (standin := _mcore_standin(name)) is not None:
            return standin
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata type")


def load_metadata(path: Path, allow_pickle: bool):
    import torch.distributed.checkpoint  # noqa: F401 - the record types' module

    try:
        with open(path, "rb") as f:
            return (pickle.Unpickler(f) if allow_pickle else _MetadataUnpickler(f)).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: holds objects other than checkpoint metadata ({e}); refused. Pass --allow-pickle only if "
            "you trust where the file came from",
            file=path,
        ) from None
    except (EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{path}: not a readable DCP .metadata file ({type(e).__name__}: truncated?)", file=path
        ) from None


class DcpSource:
    """A DCP folder's tensors (non-tensor entries such as optimizer step counters are left out)."""

    kind = "torch.distributed.checkpoint"

    def __init__(self, folder: Path, *, allow_pickle: bool = False):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder = Path(folder)
        meta = load_metadata(self.folder / ".metadata", allow_pickle)
        self.tensors = {fqn: m for fqn, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        if not self.tensors:
            raise CheckpointError(
                f"{self.folder / '.metadata'}: the checkpoint holds no tensors", file=self.folder / ".metadata"
            )
        self.where: dict[str, list] = {fqn: [] for fqn in self.tensors}
        for index, info in meta.storage_data.items():
            if index.fqn in self.where:
                if getattr(info, "transform_descriptors", None):
                    raise CheckpointError(
                        f"{self.folder}: tensor {index.fqn} is stored transformed ({info.transform_descriptors}); "
                        "only plain DCP chunks can be read",
                        file=self.folder,
                        tensor=index.fqn,
                    )
                self.where[index.fqn].append((tuple(index.offset or ()), info))
        used = sorted({info.relative_path for chunks in self.where.values() for _, info in chunks})
        missing = [n for n in used if not (self.folder / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{self.folder}: {missing[0]} is missing (the checkpoint lists {len(used)} files)",
                file=self.folder / missing[0],
            )
        self.files = [self.folder / ".metadata"] + [self.folder / n for n in used]
        self.sizes = {n: (self.folder / n).stat().st_size for n in used}
        for fqn, m in self.tensors.items():
            if m.properties.dtype not in TORCH_TO_ST:
                raise CheckpointError(
                    f"{self.folder}: tensor {fqn} has dtype {m.properties.dtype}, not storable",
                    file=self.folder,
                    tensor=fqn,
                )
            got = sum(torch.Size(c.sizes).numel() for c in m.chunks)
            if got != torch.Size(m.size).numel() or len(self.where[fqn]) != len(m.chunks):
                raise CheckpointError(
                    f"{self.folder}: tensor {fqn}: its chunks do not cover its shape {list(m.size)}",
                    file=self.folder,
                    tensor=fqn,
                )
            for _, info in self.where[fqn]:
                if info.offset + info.length > self.sizes[info.relative_path]:
                    raise CheckpointError(
                        f"{self.folder / info.relative_path}: tensor {fqn} lies past the end of the file "
                        "(truncated: copy it again)",
                        file=self.folder / info.relative_path,
                        tensor=fqn,
                    )

    def names(self) -> list[str]:
        return list(self.tensors)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].properties.dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].size)

    def storage_of(self, name: str) -> tuple:
        return tuple(sorted((str(i.relative_path), i.offset) for _, i in self.where[name]))

    def read(self, name: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The tensor, or `tensor[index]` (leading dims fixed: one layer of a stacked Megatron tensor) reading only
        the chunks that hold it."""
        m = self.tensors[name]
        lead = len(index)
        out = torch.empty(tuple(m.size)[lead:], dtype=m.properties.dtype)
        sizes = {tuple(c.offsets): tuple(c.sizes) for c in m.chunks}
        for offsets, info in self.where[name]:
            shape = sizes.get(offsets)
            if shape is not None and not all(o <= i < o + n for i, o, n in zip(index, offsets, shape, strict=False)):
                continue
            with open(self.folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            if len(blob) != info.length:
                raise CheckpointError(
                    f"{self.folder / info.relative_path}: tensor {name} is truncated",
                    file=self.folder / info.relative_path,
                    tensor=name,
                )
            try:
                chunk = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any failure to load a chunk is a corrupt file
                raise CheckpointError(
                    f"{self.folder / info.relative_path}: tensor {name}: chunk unreadable ({type(e).__name__})",
                    file=self.folder / info.relative_path,
                    tensor=name,
                ) from None
            shape = shape or tuple(chunk.shape)
            chunk = chunk.reshape(shape)
            for i, o in zip(index, offsets, strict=False):
                chunk = chunk[i - o]
            view = out
            for dim, (start, n) in enumerate(zip(offsets[lead:], shape[lead:], strict=True)):
                view = view.narrow(dim, start, n)
            view.copy_(chunk)
            del blob, chunk
        return out
