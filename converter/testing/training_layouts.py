"""Training checkpoints laid out as verl, Megatron-LM and torchtitan lay them out, for tests (2 gloo CPU processes).

`python -m converter.testing.training_layouts OUT` writes, under OUT:
  ref/llama/base, ref/moe/base     the models before sharding (save_pretrained): the exact expected outputs
  ref/gptoss/base, ref/gptoss/adapter   GPT-OSS (experts stored (E, in, out)) and the PEFT LoRA trained into it
  fsdp/step10, fsdp/step20         verl FSDP actor/ folders (rank files, fsdp_config.json, huggingface/): another
                                   model at step 10, the llama at step 20
  critic/                          a verl FSDP critic (LlamaForTokenClassification) for a PPO step folder
  gptoss/                          verl FSDP actor of GPT-OSS with its LoRA inside (target_parameters on experts)
  mcore/llama, mcore/llama_v015    Megatron torch_dist folders (tensor parallel 2, homogeneous layers stacked on a
                                   layer axis, swiglu fc1 in gate/up halves, vocabulary padded to 128, optimizer and
                                   RNG state beside, common.pt + metadata.json); _v015 pickles `.metadata` as
                                   Megatron-Core <= 0.15 does (its MCoreMetadata class)
  mcore/moe                        the same for Qwen3-MoE: grouped experts on a (layer, expert) axis pair
  titan/step-10, titan/step-20     torchtitan DCP step folders (FSDP2 DTensors, Shard(0)) of the llama with
                                   torchtitan's names and RoPE layout, optimizer and train state beside
The test module composes runs from these (tracker files, step folders, actor/critic, dist_ckpt/, iter_N/).
Megatron's and torchtitan's layouts are written from their own sources' facts (sharded keys, offsets, names);
neither library is needed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import sys
import types
from pathlib import Path

import torch

from converter.testing.training_checkpoints import _config, _model, _shard_and_save, _side_files, free_port

TP = 2
VOCAB_PAD = 128  # Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by (128) x TP


def to_mcore(hf: dict[str, torch.Tensor], config: dict) -> dict[str, tuple[torch.Tensor, str]]:
    """Megatron-Core's global tensors for a transformers Llama / Qwen3-MoE, stacked over layers (and experts) as its
    homogeneous sharded state dict keys them, each with how tensor parallelism splits it."""
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    hidden = config["hidden_size"]
    hd = config.get("head_dim") or hidden // heads
    layers = range(config["num_hidden_layers"])
    out: dict[str, tuple[torch.Tensor, str]] = {}

    def stack(name: str, fn, kind: str) -> None:
        out[f"decoder.layers.{name}"] = (torch.stack([fn(f"model.layers.{n}.") for n in layers]), kind)

    def qkv(p: str) -> torch.Tensor:
        q = hf[p + "self_attn.q_proj.weight"].reshape(groups, heads // groups * hd, hidden)
        k = hf[p + "self_attn.k_proj.weight"].reshape(groups, hd, hidden)
        v = hf[p + "self_attn.v_proj.weight"].reshape(groups, hd, hidden)
        return torch.cat([q, k, v], dim=1).reshape(-1, hidden)

    padded = -(-config["vocab_size"] // VOCAB_PAD) * VOCAB_PAD
    pad = lambda t: torch.cat([t, torch.zeros(padded - t.shape[0], t.shape[1], dtype=t.dtype)])  # noqa: E731
    out["embedding.word_embeddings.weight"] = (pad(hf["model.embed_tokens.weight"]), "column")
    stack("self_attention.linear_qkv.weight", qkv, "column")
    stack("self_attention.linear_proj.weight", lambda p: hf[p + "self_attn.o_proj.weight"], "row")
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        stack("self_attention.linear_qkv.layer_norm_weight", lambda p: hf[p + "input_layernorm.weight"], "replicated")
        stack("self_attention.q_layernorm.weight", lambda p: hf[p + "self_attn.q_norm.weight"], "replicated")
        stack("self_attention.k_layernorm.weight", lambda p: hf[p + "self_attn.k_norm.weight"], "replicated")
        stack("pre_mlp_layernorm.weight", lambda p: hf[p + "post_attention_layernorm.weight"], "replicated")
        stack("mlp.router.weight", lambda p: hf[p + "mlp.gate.weight"], "replicated")

        def fc1(p: str) -> torch.Tensor:
            return torch.stack(
                [torch.cat([hf[f"{p}mlp.experts.{x}.{w}_proj.weight"] for w in ("gate", "up")]) for x in range(experts)]
            )

        def fc2(p: str) -> torch.Tensor:
            return torch.stack([hf[f"{p}mlp.experts.{x}.down_proj.weight"] for x in range(experts)])

        stack("mlp.experts.linear_fc1.weight", fc1, "fc1")
        stack("mlp.experts.linear_fc2.weight", fc2, "row")
    else:
        stack("self_attention.linear_qkv.layer_norm_weight", lambda p: hf[p + "input_layernorm.weight"], "replicated")
        stack("mlp.linear_fc1.layer_norm_weight", lambda p: hf[p + "post_attention_layernorm.weight"], "replicated")
        stack("mlp.linear_fc1.weight", lambda p: torch.cat([hf[p + "mlp.gate_proj.weight"],
                                                             hf[p + "mlp.up_proj.weight"]]), "fc1")  # fmt: skip
        stack("mlp.linear_fc2.weight", lambda p: hf[p + "mlp.down_proj.weight"], "row")
    out["decoder.final_layernorm.weight"] = (hf["model.norm.weight"], "replicated")
    out["output_layer.weight"] = (pad(hf["lm_head.weight"]), "column")
    return out


def _pieces(key: str, t: torch.Tensor, kind: str, rank: int) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """What tensor-parallel rank `rank` saves of a global tensor: one chunk per layer (and expert) of a stacked key,
    as Megatron's per-layer ShardedTensors with a prepended axis; fc1 as its gate and up halves (swiglu factory)."""
    lead = (2 if ".experts." in key else 1) if key.startswith("decoder.layers.") else 0
    if kind == "replicated" and rank:
        return []
    out = []
    for index in _indices(t.shape[:lead]):
        block = t[index]
        if kind == "fc1":
            n = block.shape[0] // 2 // TP
            spans = [(0, part * block.shape[0] // 2 + rank * n, n) for part in (0, 1)]
        elif kind == "column":
            spans = [(0, rank * (block.shape[0] // TP), block.shape[0] // TP)]
        elif kind == "row":
            spans = [(block.dim() - 1, rank * (block.shape[-1] // TP), block.shape[-1] // TP)]
        else:
            spans = [(0, 0, block.shape[0])]
        for dim, start, n in spans:
            piece = block.narrow(dim, start, n)
            offsets = [0] * block.dim()
            offsets[dim] = start
            out.append((piece.reshape((1,) * lead + tuple(piece.shape)).contiguous(), (*index, *offsets)))
    return out


def _indices(shape) -> list[tuple[int, ...]]:
    if not shape:
        return [()]
    return [(i, *rest) for i in range(shape[0]) for rest in _indices(shape[1:])]


def _sharded(t: torch.Tensor, kind: str, key: str, rank: int, world: int):
    """A torch ShardedTensor holding this rank's pieces, with every rank's pieces in its global metadata (what
    Megatron's torch_dist strategy builds)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

    metas, local = [], []
    for r in range(world):
        for piece, offsets in _pieces(key, t, kind, r):
            metas.append(ShardMetadata(list(offsets), list(piece.shape), f"rank:{r}/cpu"))
            if r == rank:
                local.append(Shard.from_tensor_and_offsets(piece, list(offsets), rank))
    meta = ShardedTensorMetadata(metas, t.shape, TensorProperties(dtype=t.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta, process_group=None)


def _save_mcore(hf: dict, config: dict, folder: Path, rank: int, world: int, v015: bool) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = {k: _sharded(t, kind, k, rank, world) for k, (t, kind) in to_mcore(hf, config).items()}
    optimizer = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"
    state[f"{optimizer}.exp_avg"] = torch.full((64,), float(rank))
    state["rng_state"] = io.BytesIO(pickle.dumps({"random_rng_state": rank}))
    dcp.save(state, checkpoint_id=str(folder))
    dist.barrier()
    if rank == 0:
        torch.save({"args": None, "iteration": 5, "checkpoint_version": 3.0}, folder / "common.pt")
        (folder / "metadata.json").write_text(
            json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
        )
        if v015:
            _as_mcore_metadata(folder / ".metadata")


def _as_mcore_metadata(path: Path) -> None:
    """Re-pickle `.metadata` as Megatron-Core <= 0.15 writes it: its Metadata subclass with `mcore_data`, and each
    rank's plan as its SavePlan subclass in `all_local_plans` (classes registered under Megatron's module name)."""
    from dataclasses import dataclass

    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

    name = "megatron.core.dist_checkpointing.strategies.torch"

    @dataclass
    class MCoreMetadata(Metadata):
        mcore_data: dict | None = None

    @dataclass(frozen=True)
    class MCoreSavePlan(SavePlan):
        mcore_data: dict | None = None

    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    for cls in (MCoreMetadata, MCoreSavePlan):
        cls.__module__, cls.__qualname__ = name, cls.__name__
        setattr(sys.modules[name], cls.__name__, cls)
    with open(path, "rb") as f:
        meta = pickle.load(f)
    data = {f: getattr(meta, f) for f in meta.__dataclass_fields__}
    out = MCoreMetadata(**data, mcore_data={k: {} for k in meta.state_dict_metadata})
    out.all_local_plans = [MCoreSavePlan(items=[], mcore_data={})]
    with open(path, "wb") as f:
        pickle.dump(out, f)


def to_torchtitan(hf: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """torchtitan's Llama 3 names and RoPE layout (its adapter's from_hf: q/k rows per head as adjacent pairs)."""
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]

    def pairs(w: torch.Tensor, n: int) -> torch.Tensor:  # halves -> adjacent pairs, per head
        rows, cols = w.shape
        return w.view(n, 2, rows // n // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()

    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"]}
    for n in range(config["num_hidden_layers"]):
        p, t = f"model.layers.{n}.", f"layers.{n}."
        out[t + "attention.qkv_linear.wq.weight"] = pairs(hf[p + "self_attn.q_proj.weight"], heads)
        out[t + "attention.qkv_linear.wk.weight"] = pairs(hf[p + "self_attn.k_proj.weight"], groups)
        out[t + "attention.qkv_linear.wv.weight"] = hf[p + "self_attn.v_proj.weight"]
        out[t + "attention.wo.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[t + "feed_forward.w1.weight"] = hf[p + "mlp.gate_proj.weight"]
        out[t + "feed_forward.w3.weight"] = hf[p + "mlp.up_proj.weight"]
        out[t + "feed_forward.w2.weight"] = hf[p + "mlp.down_proj.weight"]
        out[t + "attention_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[t + "ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
    out["norm.weight"] = hf["model.norm.weight"]
    out["lm_head.weight"] = hf["lm_head.weight"]
    return out


def _save_titan(hf: dict, config: dict, folder: Path, world: int) -> None:
    """What torchtitan's CheckpointManager saves: the FSDP2 model state flat at the top, then its other states."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    state = {k: distribute_tensor(v.contiguous(), mesh, [Shard(0)]) for k, v in to_torchtitan(hf, config).items()}
    state["optimizer.state.layers.0.attention.wo.weight.exp_avg"] = distribute_tensor(
        torch.ones_like(hf["model.layers.0.self_attn.o_proj.weight"]), mesh, [Shard(0)]
    )
    state["lr_scheduler"] = {"last_epoch": 20}
    state["train_state"] = io.BytesIO(pickle.dumps({"step": 20}))
    dcp.save(state, checkpoint_id=str(folder))


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _run(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(out)
    try:
        config = _config(4, 32, tied=False)
        model = _model(config, seed=11)
        if rank == 0:
            model.save_pretrained(root / "ref/llama/base")
            for step in ("step10", "step20"):
                _side_files(config, root / f"fsdp/{step}", world, None)
        dist.barrier()
        _shard_and_save(model, root / "fsdp/step20", rank, world)
        _shard_and_save(_model(config, seed=12), root / "fsdp/step10", rank, world)
        dist.barrier()
        hf = _hf_tensors(root / "ref/llama/base")
        cfg = json.loads((root / "ref/llama/base/config.json").read_text())
        _save_mcore(hf, cfg, root / "mcore/llama", rank, world, v015=False)
        _save_mcore(hf, cfg, root / "mcore/llama_v015", rank, world, v015=True)
        _save_titan(hf, cfg, root / "titan/step-20", world)
        _save_titan(hf, cfg, root / "titan/step-10", world)

        from transformers import AutoModelForTokenClassification

        critic = _config(4, 32, tied=False)
        critic.num_labels, critic.architectures = 1, ["LlamaForTokenClassification"]
        torch.manual_seed(13)
        model = AutoModelForTokenClassification.from_config(critic)
        if rank == 0:
            _side_files(critic, root / "critic", world, None)
        dist.barrier()
        _shard_and_save(model, root / "critic", rank, world)

        from transformers import Qwen3MoeConfig

        moe = Qwen3MoeConfig(
            vocab_size=67, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        )  # fmt: skip
        if rank == 0:
            _model(moe, seed=14).save_pretrained(root / "ref/moe/base")
        dist.barrier()
        hf = _hf_tensors(root / "ref/moe/base")
        cfg = json.loads((root / "ref/moe/base/config.json").read_text())
        _save_mcore(hf, cfg, root / "mcore/moe", rank, world, v015=False)
        _gptoss(root, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _gptoss(root: Path, rank: int, world: int) -> None:
    """GPT-OSS keeps its experts (E, in, out); a PEFT target_parameters LoRA on both expert tensors, inside verl's
    FSDP state (the down projection is square, so only the model type tells its orientation)."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import GptOssConfig

    config = GptOssConfig(
        vocab_size=67, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = _model(config, seed=15)
    if rank == 0:
        model.save_pretrained(root / "ref/gptoss/base")
    lora = dict(r=2, lora_alpha=4, task_type="CAUSAL_LM")
    torch.manual_seed(16)
    targets = dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(model, LoraConfig(init_lora_weights=False, **targets, **lora))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    if rank == 0:
        model.save_pretrained(root / "ref/gptoss/adapter")
        _side_files(config, root / "gptoss", world, lora)
    dist.barrier()
    _shard_and_save(model, root / "gptoss", rank, world)


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("out")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    mp.spawn(_run, args=(2, free_port(), a.out), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
