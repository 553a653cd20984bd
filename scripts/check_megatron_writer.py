"""Optional check against Megatron-Core itself (not part of the test suite: it needs `megatron-core` installed).

    pip install --no-deps --target /tmp/mcore megatron-core==0.16.1   # or 0.13.1 (pickles its own Metadata)
    PYTHONPATH=/tmp/mcore python scripts/check_megatron_writer.py /tmp/megatron-check

Two gloo CPU processes build a tiny GPTModel (local layer spec, tensor parallel 2, 4 layers, GQA, swiglu, RMSNorm),
give it random weights and save it with Megatron's own `dist_checkpointing.save` (torch_dist). One process then loads
that checkpoint into a tensor-parallel-1 model with Megatron's own `dist_checkpointing.load`: the oracle. Converter's
reader must give every tensor of it, per layer, bit for bit. CPU-only torch lacks CUDA calls Megatron's writer
makes around its file writes; they are replaced by no-ops for this run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

torch.cuda.synchronize = lambda *a, **k: None  # CPU-only torch: Megatron calls these around its writes
torch.cuda.current_device = lambda: "cpu"
# Megatron's local layer spec keys the norms under the fused (Transformer Engine) names in its sharded state dict.
SHARDED_NAME = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}  # fmt: skip


def _model(tp: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        add_bias_linear=False, use_cpu_initialization=True, tensor_model_parallel_size=tp, params_dtype=torch.float32,
    )  # fmt: skip
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=128,
        max_sequence_length=64, share_embeddings_and_output_weights=False, position_embedding_type="rope",
    )  # fmt: skip


def _run(rank: int, world: int, port: int, out: str, mode: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(world)
    metadata = {"singleton_local_shards": False}  # verl's setting: homogeneous layers stacked on one key
    if mode == "save":
        with torch.no_grad():
            g = torch.Generator().manual_seed(100 + rank)
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        dist_checkpointing.save({"model": model.sharded_state_dict(metadata=metadata)}, f"{out}/ckpt")
    else:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, f"{out}/ckpt")
        torch.save({k: v for k, v in loaded["model"].items() if isinstance(v, torch.Tensor)}, f"{out}/tp1.pt")
    dist.barrier()
    dist.destroy_process_group()


def main(out: str) -> int:
    import torch.multiprocessing as mp

    from converter.testing.training_checkpoints import free_port
    from converter.training.dcp import DcpSource
    from converter.training.mcore_dist import MegatronDist

    Path(out, "ckpt").mkdir(parents=True, exist_ok=True)
    mp.spawn(_run, args=(2, free_port(), out, "save"), nprocs=2)
    mp.spawn(_run, args=(1, free_port(), out, "load"), nprocs=1)
    oracle = torch.load(f"{out}/tp1.pt")
    ours = MegatronDist(DcpSource(Path(out, "ckpt")), {"vocab_size": 128})
    wrong = []
    for key, expected in oracle.items():
        name = key
        for local, sharded in SHARDED_NAME.items():
            name = name.replace(local, sharded)
        if name not in ours.names() or not torch.equal(ours.read(name), expected):
            wrong.append(key)
    print(f"{len(oracle) - len(wrong)} of {len(oracle)} tensors equal Megatron's own tensor-parallel-1 load")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
