"""Real verl-style training checkpoints for tests and the bench: W gloo processes on CPU, FSDP2 `fully_shard`.

`python -m converter.testing.training_checkpoints OUT [--world 2] [--layers 2] [--hidden 32] [--only-plain]`
writes, under OUT:
  ref/<variant>/base       the model before sharding (save_pretrained), the exact expected output
  ref/<variant>/adapter    the PEFT adapter trained into it (LoRA variants), PEFT's forward is the oracle
  <variant>/actor/         model_world_size_W_rank_r.pt, fsdp_config.json, huggingface/, lora_train_meta.json
  dcp/actor/               the `plain` model's sharded state dict saved with torch.distributed.checkpoint
  moe/actor/               a tiny Qwen3-MoE: experts fused in memory (gate_up_proj (E, 2I, H), down_proj (E, H, I))
  moe_lora/actor/          the same with a PEFT LoRA on q_proj and, through target_parameters, on both expert tensors
  critic/critic/           a verl critic: LlamaForTokenClassification (num_labels 1), HSDP mesh ("ddp", "fsdp")
  value/critic/            a trl AutoModelForCausalLMWithValueHead-shaped critic (tied Llama under `pretrained_model.`,
                           `v_head.summary` Linear(hidden, 1)); ref/value/v_head.safetensors holds the head
  partial/                 rank files holding a `Partial` DTensor (to be refused)
Variants: `plain` (untied Llama, odd vocab so the shards are uneven), `lora` (tied Llama with a PEFT LoRA on
all linear layers, kept unmerged as verl does: base_layer + lora_A/lora_B.default). Needs transformers and peft.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch


def _config(layers: int, hidden: int, tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=67, hidden_size=hidden, intermediate_size=hidden * 3 // 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=tied,
    )  # fmt: skip


def _model(config, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _shard_and_save(model, actor: Path, rank: int, world: int, dcp: Path | None = None, hsdp: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if hsdp:  # hybrid sharding: replicated over "ddp" (here 1 replica), sharded over "fsdp"
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ddp", "fsdp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    inner = model.base_model.model if hasattr(model, "peft_config") else getattr(model, "pretrained_model", model)
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    actor.mkdir(parents=True, exist_ok=True)
    torch.save(state, actor / f"model_world_size_{world}_rank_{rank}.pt")
    if dcp is not None:
        import torch.distributed.checkpoint as dist_cp

        dist_cp.save(state, checkpoint_id=str(dcp))


class _ValueHeadModel(torch.nn.Module):
    """The parameter layout of trl's AutoModelForCausalLMWithValueHead (trl is not a dependency): the causal LM
    as `pretrained_model`, a scalar head `v_head.summary` on its hidden states."""

    def __init__(self, model):
        super().__init__()
        self.pretrained_model = model
        self.v_head = torch.nn.Module()
        self.v_head.summary = torch.nn.Linear(model.config.hidden_size, 1)


def _side_files(config, actor: Path, world: int, lora: dict | None) -> None:
    actor.mkdir(parents=True, exist_ok=True)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    config.save_pretrained(actor / "huggingface")
    if lora:
        (actor / "lora_train_meta.json").write_text(json.dumps(lora))


def _run(rank: int, world: int, port: int, out: str, layers: int, hidden: int, only_plain: bool) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(out)
    try:
        if only_plain:  # the bench: one big plain checkpoint, nothing else
            _plain(root, rank, world, layers, hidden, bench=True)
            return
        _plain(root, rank, world, layers, hidden)
        _lora(root, rank, world, layers, hidden)
        _partial(root / "partial", rank, world)
        _critic(root, rank, world, layers, hidden)
        _value(root, rank, world, layers, hidden)
        _moe(root, rank, world, layers, hidden)
    finally:
        dist.destroy_process_group()


# Each variant below is built by every rank in turn, in this order: the seeds and barriers are the ranks' common steps.


def _plain(root: Path, rank: int, world: int, layers: int, hidden: int, bench: bool = False) -> None:
    """plain/actor (untied Llama) and, beside it, its sharded state dict as DCP (dcp/actor); `bench`: that alone."""
    import torch.distributed as dist

    config = _config(layers, hidden, tied=False)
    model = _model(config, seed=0)
    if bench:
        if rank == 0:
            _side_files(config, root / "plain/actor", world, None)
        dist.barrier()
        _shard_and_save(model, root / "plain/actor", rank, world)
        dist.barrier()
        return
    if rank == 0:
        model.save_pretrained(root / "ref/plain/base")
        _side_files(config, root / "plain/actor", world, None)
        config.save_pretrained(root / "dcp/actor/huggingface")
    dist.barrier()
    _shard_and_save(model, root / "plain/actor", rank, world, dcp=root / "dcp/actor")


def _with_lora(model, lora: dict, **targets):
    """`model` wrapped by PEFT with a LoRA whose factors are all non-zero (as after training)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(init_lora_weights=False, **targets, **lora))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return model


def _lora(root: Path, rank: int, world: int, layers: int, hidden: int) -> None:
    """lora/actor: a tied Llama with a PEFT LoRA on all linear layers, kept unmerged as verl does."""
    import torch.distributed as dist

    config = _config(layers, hidden, tied=True)
    model = _model(config, seed=1)
    if rank == 0:
        model.save_pretrained(root / "ref/lora/base")
    lora = dict(r=4, lora_alpha=8, task_type="CAUSAL_LM")
    torch.manual_seed(2)
    model = _with_lora(model, lora, target_modules="all-linear")
    if rank == 0:
        model.save_pretrained(root / "ref/lora/adapter")
        _side_files(config, root / "lora/actor", world, lora)
    dist.barrier()
    _shard_and_save(model, root / "lora/actor", rank, world)
    dist.barrier()


def _critic(root: Path, rank: int, world: int, layers: int, hidden: int) -> None:
    """critic/critic: a verl critic (LlamaForTokenClassification, one label) on an HSDP mesh."""
    import torch.distributed as dist
    from transformers import AutoModelForTokenClassification

    config = _config(layers, hidden, tied=False)
    config.num_labels = 1
    config.architectures = ["LlamaForTokenClassification"]
    torch.manual_seed(4)
    model = AutoModelForTokenClassification.from_config(config)
    if rank == 0:
        model.save_pretrained(root / "ref/critic/base")
        _side_files(config, root / "critic/critic", world, None)
    dist.barrier()
    _shard_and_save(model, root / "critic/critic", rank, world, hsdp=True)


def _value(root: Path, rank: int, world: int, layers: int, hidden: int) -> None:
    """value/critic: trl's value-head layout; ref/value/v_head.safetensors holds the head."""
    import torch.distributed as dist

    config = _config(layers, hidden, tied=True)
    value = _ValueHeadModel(_model(config, seed=7))
    if rank == 0:
        from safetensors.torch import save_file

        value.pretrained_model.save_pretrained(root / "ref/value/base")
        save_file({f"v_head.{k}": v.contiguous() for k, v in value.v_head.state_dict().items()},
                  root / "ref/value/v_head.safetensors")  # fmt: skip
        _side_files(config, root / "value/critic", world, None)
    dist.barrier()
    _shard_and_save(value, root / "value/critic", rank, world)


def _moe(root: Path, rank: int, world: int, layers: int, hidden: int) -> None:
    """moe/actor (a tiny Qwen3-MoE) and moe_lora/actor (a LoRA on attention and on the fused expert tensors)."""
    import torch.distributed as dist
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=67, hidden_size=hidden, intermediate_size=hidden * 3 // 2, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = _model(config, seed=3)
    if rank == 0:
        model.save_pretrained(root / "ref/moe/base")
        _side_files(config, root / "moe/actor", world, None)
    dist.barrier()
    _shard_and_save(model, root / "moe/actor", rank, world)

    model = _model(config, seed=5)
    if rank == 0:
        model.save_pretrained(root / "ref/moe_lora/base")
    torch.manual_seed(6)
    lora = dict(r=2, lora_alpha=4, task_type="CAUSAL_LM")
    model = _with_lora(model, lora, target_modules=["q_proj"],
                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    if rank == 0:
        model.save_pretrained(root / "ref/moe_lora/adapter")
        _side_files(config, root / "moe_lora/actor", world, lora)
    dist.barrier()
    _shard_and_save(model, root / "moe_lora/actor", rank, world)


def _partial(folder: Path, rank: int, world: int) -> None:
    """A rank file whose tensor is a `Partial` DTensor (an unreduced sum): a reader must refuse it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    folder.mkdir(parents=True, exist_ok=True)
    value = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()], run_check=False)
    torch.save({"model.norm.weight": value}, folder / f"model_world_size_{world}_rank_{rank}.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--only-plain", action="store_true", help="only plain/actor (no reference, LoRA, DCP, MoE)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    mp.spawn(_run, args=(a.world, free_port(), a.out, a.layers, a.hidden, a.only_plain), nprocs=a.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
