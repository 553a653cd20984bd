"""A training checkpoint seen as a merge base: Hugging Face names, the LoRA inside fused, a tied head dropped.

The reader underneath (FSDP rank files, DCP) rebuilds one tensor from its shards on demand; this view gives it
the `checkpoint.Checkpoint` interface (`names`, `info`, `read`, `files`, `where`, `parts`, `config`) so planning,
streaming and writing are the ones every other base goes through. `folder` is the `huggingface/` folder verl
saves beside the weights: config, tokenizer and generation config are carried over from there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from converter.engine.checkpoint import Checkpoint, Part
from converter.engine.keymap import keymap_for
from converter.errors import BadInputError, CheckpointError
from converter.formats import patches
from converter.formats.patches import lora_scale
from converter.io import dtypes
from converter.io.dtypes import ITEMSIZE
from converter.io.lazy import torch
from converter.io.safetensors_file import TensorInfo, file_sha256

PEFT_PREFIX = "base_model.model."
# trl's AutoModelForCausalLMWithValueHead holds the causal LM as `pretrained_model` beside its `v_head.summary`;
# trl saves the LM's own names plus `v_head.*` (which transformers ignores and trl loads), so that is what we write.
TRL_PREFIX = "pretrained_model."
LORA_ROLES = (  # (suffix, role): verl keeps PEFT's adapter name ("default") in the sharded state dict
    (".lora_A.default.weight", "A"),
    (".lora_B.default.weight", "B"),
    (".lora_A.weight", "A"),
    (".lora_B.weight", "B"),
    (".base_layer.weight", "weight"),
    (".base_layer.bias", "bias"),
)
# Model types whose transformers experts module keeps its 3D tensors (E, in, out) (`is_transposed=True` in
# transformers 5); PEFT's target_parameters LoRA then gives ΔW[e] = (B_e @ A_e)ᵀ. The others store (E, out, in).
TRANSPOSED_EXPERTS = {"gpt_oss", "aria", "openai_privacy_filter"}
LAYER = re.compile(r"model\.layers\.(\d+)\.")
NESTED = re.compile(r"(?:\.base_layer)+\.(?=\w+_bias$)")  # `experts.base_layer.base_layer.gate_up_proj_bias`
UNSUPPORTED_LORA = ("lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "lora_dropout")


class _RankFile:
    """One weight file of the checkpoint, as `engine.merging.write_weights` sees files: hashed for provenance."""

    def __init__(self, path: Path, owner: TrainingCheckpoint, tensors: dict[str, TensorInfo]):
        self.path = path
        self.size = path.stat().st_size
        self.tensors = tensors
        self.owner = owner

    def reader(self) -> _Reader:
        return _Reader(self)


class _Reader:
    """The `SequentialReader` interface over a sharded source: tensors rebuilt from every rank, in plan order;
    the file's sha256 is taken at the end (a second read of the file, never held in memory)."""

    def __init__(self, file: _RankFile):
        self.file = file

    def read(self, info: TensorInfo) -> torch.Tensor:
        return self.file.owner.read(info.name)

    def copy(self, info: TensorInfo, sink) -> None:
        t = self.file.owner.read(info.name)
        sink(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))

    def finish(self) -> str:
        return file_sha256(self.file.path)

    def abort(self) -> None:
        pass


class TrainingCheckpoint(Checkpoint):
    """A sharded training checkpoint (`source`: an FsdpSource or a DcpSource) as a base."""

    parts = (Part(),)
    diffusion = None

    def __init__(
        self, folder: Path, source, *, lora_alpha: float | None = None, config_file: Path | None = None,
        notes: tuple[str, ...] = (),
    ):  # fmt: skip  # noqa: D107 - no super()
        self.weights_folder = Path(folder)  # verl's actor/ (or critic/, or the step folder): LoRA meta files there
        self.source = source
        self.notes: list[str] = list(notes)
        config_file = Path(config_file) if config_file else self.weights_folder / "huggingface" / "config.json"
        self.config: dict = self.read_config(config_file)
        self.folder = config_file.parent  # config, tokenizer, generation config: carried over from here
        self._build_names(lora_alpha)
        infos = {n: self._info(n) for n in self._order}
        files = [Path(p) for p in source.files]
        self.files = [_RankFile(files[0], self, infos)] + [_RankFile(p, self, {}) for p in files[1:]]
        self.where = dict.fromkeys(infos, self.files[0])
        self._infos = infos
        self.notes.insert(
            len(notes),
            f"base reassembled from {source.kind} shards ({len(files)} files, read weights-only, one tensor at a time)",
        )

    @staticmethod
    def read_config(config_path: Path) -> dict:
        """The model's config.json (verl saves it, with the tokenizer, in huggingface/ beside the weights)."""
        if not config_path.is_file():
            raise CheckpointError(
                f"{config_path.parent.parent}: training checkpoint without huggingface/config.json; give --config "
                "with the base model's folder or its config.json",
                file=config_path.parent.parent,
            )
        try:
            return json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise BadInputError(f"{config_path}: invalid JSON ({e.msg} at line {e.lineno})", file=config_path) from None

    def _build_names(self, lora_alpha: float | None) -> None:
        """HF name → (source key, LoRA (A key, B key) or None); keys in the source's order."""
        groups, plain = self._group_keys()
        self._map: dict[str, str] = {}
        self._lora: dict[str, tuple[str, str, float]] = {}
        # fused expert tensor -> (lora_A key, lora_B key, scale, experts, PEFT wrapper module, stored (E, in, out))
        self._experts: dict[str, tuple[str, str, float, int, str, bool]] = {}
        self.alpha: tuple[float, bool, str, int | None] | None = None
        ranks = set()
        for module, roles in groups.items():
            if (r := self._place_module(module, roles, plain, lora_alpha)) is not None:
                ranks.add(r)
        self._map.update(plain)
        order = {k: i for i, k in enumerate(self.source.names())}
        self._order = sorted(self._map, key=lambda n: order[self._map[n]])
        self._check_layers()
        self._drop_tied_head()
        self._note_names(ranks)

    def _group_keys(self) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
        """The source's keys as (module -> its LoRA roles' keys: A, B, weight, bias; the other tensors by name)."""
        groups: dict[str, dict[str, str]] = {}
        plain: dict[str, str] = {}
        for key in self.source.names():
            bare = key.removeprefix(TRL_PREFIX)
            bare = bare.removeprefix(PEFT_PREFIX)
            if any(f".{u}." in bare or bare.endswith(f".{u}") for u in UNSUPPORTED_LORA):
                raise CheckpointError(
                    f"{self.weights_folder}: tensor {key}: embedding LoRA / DoRA inside a training checkpoint is "
                    "not supported yet; save the adapter with PEFT and merge it as an adapter",
                    file=self.weights_folder,
                    tensor=key,
                )
            for suffix, role in LORA_ROLES:
                if bare.endswith(suffix):
                    groups.setdefault(bare[: -len(suffix)], {})[role] = key
                    break
            else:  # a wrapped module's other parameters sit under its base_layer(s) (PEFT ParamWrapper nesting)
                plain[bare if ".lora_" in bare else NESTED.sub(".", bare)] = key
        return groups, plain

    def _place_module(self, module: str, roles: dict[str, str], plain: dict[str, str],
                      lora_alpha: float | None) -> int | None:  # fmt: skip
        """One wrapped module's tensors into the name map, its LoRA (if any) paired and scaled: its rank, or None."""
        if ("A" in roles) != ("B" in roles):
            raise CheckpointError(
                f"{self.weights_folder}: module {module} has only half a LoRA pair", file=self.weights_folder
            )
        if "weight" not in roles and "A" in roles:  # PEFT target_parameters: a LoRA on a 3D expert tensor
            if self.alpha is None:
                self.alpha = self._alpha(lora_alpha)
            name, key, experts, transposed = self._expert_target(module, roles, plain)
            r = self.source.shape(roles["A"])[0] // experts
            self._map[name] = key
            scale = lora_scale(self.alpha[0], r, self.alpha[1])
            self._experts[name] = (roles["A"], roles["B"], scale, experts, module, transposed)
            return r
        if "weight" not in roles:
            raise CheckpointError(
                f"{self.weights_folder}: module {module} has a base_layer but no base weight",
                file=self.weights_folder,
            )
        self._map[f"{module}.weight"] = roles["weight"]
        if "bias" in roles:
            self._map[f"{module}.bias"] = roles["bias"]
        if "A" not in roles:
            return None
        r = self.source.shape(roles["A"])[0]
        if self.alpha is None:
            self.alpha = self._alpha(lora_alpha)
        if self.alpha[3] is not None and self.alpha[3] != r:
            raise CheckpointError(
                f"{self.weights_folder}: {roles['A']} has rank {r} but lora_train_meta.json says r={self.alpha[3]}",
                file=self.weights_folder,
                tensor=roles["A"],
            )
        self._lora[f"{module}.weight"] = (roles["A"], roles["B"], lora_scale(self.alpha[0], r, self.alpha[1]))
        return r

    def _note_names(self, ranks: set[int]) -> None:
        """What reading the names did, for the plan's notes: a value head kept, the LoRA fused, float32 state."""
        if heads := [n for n in self._order if n.startswith("v_head.")]:
            self.notes.append(
                f"value head kept as {', '.join(heads)} (trl's AutoModelForCausalLMWithValueHead loads it from the "
                "same files; transformers' AutoModelForCausalLM ignores it)"
            )
        if (self._lora or self._experts) and (alpha := self.alpha) is not None:
            self.notes.append(
                f"LoRA inside the checkpoint fused into {len(self._lora) + len(self._experts)} weights "
                + (f"({len(self._experts)} of them fused MoE expert tensors) " if self._experts else "")
                + f"(rank {', '.join(map(str, sorted(ranks)))}, "
                f"lora_alpha {alpha[0]:g} from {alpha[2]}, scale alpha/{'sqrt(r)' if alpha[1] else 'r'}), in float32, "
                "rounded once"
            )
        stored = {dtypes.TORCH_TO_ST[self.source.dtype(self._map[n])] for n in self._order}
        declared = self.config.get("dtype") or self.config.get("torch_dtype")
        if declared and stored == {"F32"} and declared != "float32":
            self.notes.append(
                f"the training state is float32 (FSDP master weights) while config.json says {declared}; "
                f"written as stored unless --dtype {declared} is given"
            )

    def _expert_target(self, module: str, roles: dict[str, str], plain: dict[str, str]) -> tuple[str, str, int, bool]:
        """The 3D parameter a target_parameters LoRA acts on. PEFT nests one wrapper per parameter
        (`experts.base_layer.lora_A` is the inner one, the parameter itself `experts.base_layer.base_layer.<p>`), so
        the pairing comes from shapes: A is (r·E, in), B (out, r·E), the parameter (E, out, in), or (E, in, out)
        where the experts module stores it transposed (GPT-OSS: PEFT then gives ΔW[e] transposed)."""
        root = re.sub(r"(\.base_layer)+$", "", module)
        pattern = re.compile(re.escape(root) + r"(?:\.base_layer)+\.(\w+)")
        (rows, inp), out = self.source.shape(roles["A"]), self.source.shape(roles["B"])[0]
        transposed = self.config.get("model_type") in TRANSPOSED_EXPERTS
        want = (inp, out) if transposed else (out, inp)
        fits = []
        for bare, key in plain.items():
            shape = self.source.shape(key)
            if (m := pattern.fullmatch(bare)) and len(shape) == 3 and shape[1:] == want and rows % shape[0] == 0:
                fits.append((m.group(1), bare, key, shape[0]))
        if len(fits) != 1:
            layout = "(experts, in, out)" if transposed else "(experts, out, in)"
            why = (
                f"several parameters fit its shapes ({', '.join(f[1] for f in fits)})"
                if fits
                else f"no base_layer.weight and no {layout} parameter it fits ({self.config.get('model_type')} "
                "stores its experts that way)"
            )
            raise CheckpointError(
                f"{self.weights_folder}: LoRA {roles['A']}: {why}", file=self.weights_folder, tensor=roles["A"]
            )
        param, bare, key, experts = fits[0]
        del plain[bare]
        return f"{root}.{param}", key, experts, transposed

    def _alpha(self, explicit: float | None) -> tuple[float, bool, str, int | None]:
        """(lora_alpha, use_rslora, where it came from, r the meta file declares): --lora-alpha, then
        lora_train_meta.json, then lora_adapter/adapter_config.json."""
        rslora = False
        sources = []
        declared_r = None
        for path in (self.weights_folder / "lora_train_meta.json", self.weights_folder / "lora_adapter" /
                     "adapter_config.json"):  # fmt: skip
            if path.is_file():
                try:
                    meta = json.loads(path.read_text())
                except json.JSONDecodeError as e:
                    raise BadInputError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})", file=path) from None
                rslora = rslora or bool(meta.get("use_rslora", False))
                if declared_r is None and isinstance(meta.get("r"), int) and not meta.get("rank_pattern"):
                    declared_r = meta["r"]
                if meta.get("lora_alpha") is not None:
                    sources.append((float(meta["lora_alpha"]), path.relative_to(self.weights_folder)))
        if explicit is not None:
            return float(explicit), rslora, "--lora-alpha", declared_r
        if sources:
            return sources[0][0], rslora, str(sources[0][1]), declared_r
        raise CheckpointError(
            f"{self.weights_folder}: the checkpoint holds a LoRA but no lora_alpha (no lora_train_meta.json or "
            "lora_adapter/adapter_config.json with one); give --lora-alpha (the value training used)",
            file=self.weights_folder,
        )

    def _check_layers(self) -> None:
        """The layers the checkpoint holds are the ones config.json describes (else: another model's config)."""
        text = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else {}
        declared = self.config.get("num_hidden_layers", text.get("num_hidden_layers"))
        held = {int(m.group(1)) for n in self._order if (m := LAYER.match(n))}
        if declared is not None and held and held != set(range(declared)):
            raise CheckpointError(
                f"{self.weights_folder}: the checkpoint holds {len(held)} layers (up to {max(held)}) but its config "
                f"says num_hidden_layers {declared}: another model's config?",
                file=self.weights_folder,
            )

    def _drop_tied_head(self) -> None:
        """transformers saves a tied head once (the embedding); the training state lists both names. A LoRA on
        either side unties them (as PEFT's merge does): both are written and config.json says so."""
        text = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else {}
        tied = self.config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        if not tied:
            return
        for head, emb in keymap_for(self.config).tied.items():
            if head in self._map and emb in self._map and (head in self._lora or emb in self._lora):
                self.config["tie_word_embeddings"] = False
                self.notes.append(f"{head} written untied from {emb}: the LoRA inside changes one of them")
                continue
            if head in self._map and emb in self._map:
                shared = self.source.storage_of(self._map[head]) == self.source.storage_of(self._map[emb])
                self._order.remove(head)
                del self._map[head]
                self.notes.append(
                    f"{head} dropped: tied to {emb} (tie_word_embeddings)"
                    + ("" if shared else ", though the training state stored it separately")
                )

    @property
    def expert_lora(self) -> dict[str, tuple[str, str, float, int, str, bool]]:
        """Fused expert tensor -> (lora_A key, lora_B key, scale, experts, PEFT wrapper module, stored (E, in, out))."""
        return dict(self._experts)

    @property
    def lora(self) -> dict[str, tuple[str, str, float]]:
        """HF weight name -> (lora_A key, lora_B key, scale) for the LoRA inside the checkpoint."""
        return dict(self._lora)

    @property
    def task_type(self) -> str | None:
        meta = self.weights_folder / "lora_train_meta.json"
        return json.loads(meta.read_text()).get("task_type") if meta.is_file() else "CAUSAL_LM"

    def source_info(self, key: str) -> TensorInfo:
        """Header facts of a tensor by its key in the training state (LoRA factors included)."""
        dtype = dtypes.TORCH_TO_ST[self.source.dtype(key)]
        shape = tuple(self.source.shape(key))
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= d
        return TensorInfo(key, dtype, shape, 0, n)

    def read_unfused(self, name: str) -> torch.Tensor:
        """The base weight as stored, LoRA not applied (for `--keep-adapter` and verification)."""
        return self.source.read(self._map[name])

    def _info(self, name: str) -> TensorInfo:
        info = self.source_info(self._map[name])
        return TensorInfo(name, info.dtype, info.shape, 0, info.nbytes)

    def names(self) -> list[str]:
        return list(self._order)

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def read(self, name: str) -> torch.Tensor:
        t = self.source.read(self._map[name])
        if name in self._experts:
            a_key, b_key, scale, experts, _, transposed = self._experts[name]
            w = t.to(torch.float32, copy=True)
            delta = patches.expert_delta(self.source.read(a_key).float(), self.source.read(b_key).float(), experts)
            if transposed:
                delta = delta.transpose(1, 2)
            return w.add_(delta, alpha=scale).to(t.dtype)
        if name not in self._lora:
            return t
        a_key, b_key, scale = self._lora[name]
        w = t.to(torch.float32, copy=True)
        w.addmm_(self.source.read(b_key).to(torch.float32), self.source.read(a_key).to(torch.float32), alpha=scale)
        return w.to(t.dtype)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)
