"""What mlx-lm would write for a model folder and an MLX type, worked out from its own code with no weights loaded.

Why from mlx-lm's code: the tensor names, which modules are quantized and how, the dtypes, the `quantization` block
of config.json and the shards are mlx-lm's decisions (its model classes, their `sanitize`, `quantize_model` with the
model's own predicate). We build its model for the config with lazy stand-ins (mlx computes nothing until asked),
quantize that model as `mlx_lm.convert` does, and read the layout off it. Each output tensor then comes from one
tensor of the merged folder, read, cast and quantized on its own: memory holds one module, never the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from converter.errors import BadInputError, UsageError
from converter.io.safetensors_file import SafetensorsFile, TensorInfo
from converter.mlx import runtime
from converter.mlx.types import MLXType

#: mlx dtype name -> safetensors dtype
ST_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint32": "U32", "uint8": "U8", "int32": "I32"}
MX_NAME = {v: k for k, v in ST_DTYPE.items()} | {"I64": "int64", "U16": "uint16", "I8": "int8", "BOOL": "bool_"}
QUANT_PARTS = ("weight", "scales", "biases")


@dataclass(frozen=True)
class OutTensor:
    name: str  # in the MLX folder
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    source: str  # the merged folder's tensor it is made from
    quant: tuple[int, int, str] | None = None  # (group_size, bits, mode) for a quantized module's parts
    part: str = "weight"  # of a quantized module: weight, scales or biases

    @property
    def nbytes(self) -> int:
        from converter.io.dtypes import ITEMSIZE

        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass
class Layout:
    type: MLXType
    tensors: list[OutTensor]  # in mlx-lm's order
    shards: list[list[str]]  # tensor names per file, as mlx-lm splits them
    config: dict  # what mlx-lm writes as config.json (before its save_config's clean-up)
    total_parameters: int
    sources: dict[str, tuple[SafetensorsFile, TensorInfo]]


def source_tensors(folder: Path) -> dict[str, tuple[SafetensorsFile, TensorInfo]]:
    """Every tensor of the folder's safetensors files (headers only)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise BadInputError(f"{folder}: no .safetensors files (MLX export reads a merged model folder)", file=folder)
    found = {}
    for path in files:
        f = SafetensorsFile(path)
        for name, info in f.tensors.items():
            found[name] = (f, info)
    return found


def model_for(folder: Path, config: dict):
    """mlx-lm's model for this config, its weights lazy stand-ins; a one-line refusal for an architecture it does
    not know."""
    _, lm = runtime.require("MLX export")
    try:
        model_class, args_class = lm._get_classes(config)
    except ValueError:
        raise UsageError(
            f"{folder}: mlx-lm does not know the architecture {config.get('model_type')!r}; "
            "MLX export needs a model type mlx-lm runs (merge without --mlx)"
        ) from None
    return model_class(args_class.from_dict(config))


def plan(folder: str | Path, mtype: MLXType) -> Layout:
    """The layout mlx-lm writes for `folder` as `mtype`; refused in one line where a tensor of mlx-lm's model is not
    one tensor of the folder (mlx-lm stacks or computes it)."""
    mx, lm = runtime.require("MLX export")
    from mlx.utils import tree_flatten, tree_map_with_path

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise BadInputError(f"{folder}: no config.json (MLX export reads a merged model folder)", file=folder)
    config = lm.load_config(folder)
    model = model_for(folder, config)
    sources = source_tensors(folder)
    origin = _origins(model, folder, sources, config)
    cast = _conversion_dtype(config, mtype, mx)
    keep = getattr(model, "cast_predicate", lambda _: True)

    def stand_in(path, value):
        info = sources[origin[path]][1]
        dtype = getattr(mx, MX_NAME[info.dtype])
        if cast is not None and keep(path) and mx.issubdtype(dtype, mx.floating):
            dtype = cast
        return mx.zeros(info.shape, dtype)  # lazy: never computed

    model.update(tree_map_with_path(stand_in, model.parameters()))
    if mtype.bits is not None:
        with runtime.quietly():
            model, config = lm.quantize_model(model, copy.deepcopy(config), mtype.group_size, mtype.bits,
                                              mode=mtype.mode)  # fmt: skip
    params = dict(tree_flatten(model.parameters()))
    tensors = _tensors(model, params, origin)
    shards = [list(s) for s in lm.make_shards(params)]
    return Layout(mtype, tensors, shards, config, int(lm.get_total_parameters(model)), sources)


def _origins(model, folder: Path, sources: dict, config: dict) -> dict[str, str]:
    """mlx-lm's parameter name -> the folder's tensor it is, through the model's own `sanitize` run on stand-ins:
    a tensor passed through (renamed or not) is that tensor; one it makes from others cannot be streamed."""
    mx, _ = runtime.require("MLX export")
    from mlx.utils import tree_flatten

    stand_ins = {}
    for name, (_, info) in sources.items():
        if info.dtype not in MX_NAME:
            raise BadInputError(f"{folder}: tensor {name!r} has dtype {info.dtype}, which mlx does not read",
                                file=folder, tensor=name)  # fmt: skip
        stand_ins[name] = mx.zeros(info.shape, getattr(mx, MX_NAME[info.dtype]))
    by_id = {id(v): k for k, v in stand_ins.items()}
    sanitized = model.sanitize(dict(stand_ins)) if hasattr(model, "sanitize") else stand_ins
    expected = dict(tree_flatten(model.parameters()))
    kind = config.get("model_type")
    origin = {}
    for name, value in sanitized.items():
        if id(value) not in by_id:
            raise UsageError(
                f"{folder}: mlx-lm's {kind} model makes {name!r} from several tensors (stacked experts, "
                "fused projections); MLX export streams one tensor at a time and does not write it yet"
            )
        if name not in expected:
            raise UsageError(f"{folder}: tensor {by_id[id(value)]!r} has no place in mlx-lm's {kind} model")
        if tuple(value.shape) != tuple(expected[name].shape):
            raise UsageError(f"{folder}: tensor {by_id[id(value)]!r} has shape {list(value.shape)}, mlx-lm's {kind} "
                             f"model expects {list(expected[name].shape)} for {name!r}")  # fmt: skip
        origin[name] = by_id[id(value)]
    if missing := [n for n in expected if n not in origin]:
        raise UsageError(f"{folder}: mlx-lm's {kind} model needs {missing[0]!r}, which the folder does not hold")
    return origin


def _conversion_dtype(config: dict, mtype: MLXType, mx):
    """What mlx_lm.convert casts floating weights to: the type's own dtype (bf16), else the config's
    `torch_dtype` (mlx-lm reads that key, or a text_config's `dtype`); None: kept as stored."""
    name = mtype.dtype or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return getattr(mx, name) if name in ("float16", "bfloat16", "float32") else None


def _tensors(model, params: dict, origin: dict[str, str]) -> list[OutTensor]:
    quantized = {path: m for path, m in model.named_modules() if hasattr(m, "bits") and hasattr(m, "scales")}
    out = []
    for name, value in params.items():
        module, _, part = name.rpartition(".")
        dtype, shape = ST_DTYPE[str(value.dtype).split(".")[-1]], tuple(value.shape)
        if module in quantized and part in QUANT_PARTS:
            m = quantized[module]
            out.append(OutTensor(name, dtype, shape, origin[f"{module}.weight"], (m.group_size, m.bits, m.mode), part))
        else:
            out.append(OutTensor(name, dtype, shape, origin[name]))
    return out
