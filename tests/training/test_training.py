"""Training checkpoints as bases: real verl-style FSDP2 rank files and a DCP folder, made by 2 gloo processes.

The oracle is the model before sharding (bit for bit where there is no LoRA) and PEFT's own unmerged forward
(and its float64 merge, rounded once) where the checkpoint carries a LoRA.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from model_helpers import (
    assert_failed,
    assert_proven,
    load_merged,
    logits,
    peft_merged_fp64,
    read_tensors,
    reference_model,
)

pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture(scope="module")
def ckpts(training_checkpoints):
    """One build of every checkpoint, shared with the other modules that use them (conftest)."""
    return training_checkpoints


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("layout", ["plain/actor", "dcp/actor"])
def test_reassembled_base_is_bit_identical_to_the_model_before_sharding(ckpts, layout, tmp_path, cli):
    code, out, err = cli("merge", "--base", ckpts / layout, "--out", tmp_path / "m")
    assert code == 0, err
    assert "reassembled from" in out
    ours, expected = read_tensors(tmp_path / "m"), read_tensors(ckpts / "ref/plain/base")
    assert set(ours) == set(expected)
    assert all(_bytes_equal(ours[k], expected[k]) for k in expected)
    assert ours["model.embed_tokens.weight"].shape[0] == 67  # uneven shards (34 + 33 rows) put back together
    provenance = json.loads((tmp_path / "m/converter_provenance.json").read_text())
    names = {f["name"] for f in provenance["base"]["files"]}
    if layout.startswith("plain"):
        assert names == {"model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"}
    else:
        assert ".metadata" in names and "__0_0.distcp" in names
    model = load_merged(tmp_path / "m")
    ids = torch.randint(3, 67, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(model, ids), logits(load_merged(ckpts / "ref/plain/base"), ids))


def test_lora_inside_is_fused_like_peft(ckpts, tmp_path, cli):
    """verl's state keeps base_layer + lora_A/lora_B.default: fused with alpha from lora_train_meta.json."""
    code, out, err = cli("merge", "--base", ckpts / "lora", "--out", tmp_path / "m")  # global_step_N-style folder
    assert code == 0, err
    assert "LoRA inside the checkpoint fused into 14 weights" in out and "lora_alpha 8" in out
    ours = read_tensors(tmp_path / "m")
    base = read_tensors(ckpts / "ref/lora/base")
    reference = peft_merged_fp64(ckpts / "ref/lora/base", ckpts / "ref/lora/adapter")
    assert "lm_head.weight" not in ours  # tied: written once, as transformers saves it
    assert set(ours) == set(base)
    changed = 0
    for name, tensor in ours.items():
        expected = reference[name].to(torch.float32)
        if torch.equal(expected, base[name]):
            assert _bytes_equal(tensor, base[name]), name
            continue
        changed += 1
        torch.testing.assert_close(tensor, expected, atol=1e-6, rtol=1e-6)
    assert changed == 14
    ids = torch.randint(3, 67, (2, 10), generator=torch.Generator().manual_seed(0))
    peft = logits(reference_model(ckpts / "ref/lora/base", [ckpts / "ref/lora/adapter"]), ids)
    merged = load_merged(tmp_path / "m")
    assert merged.config.tie_word_embeddings
    torch.testing.assert_close(logits(merged, ids), peft, atol=1e-5, rtol=1e-5)
    bare = logits(load_merged(ckpts / "ref/lora/base"), ids)
    assert (bare - peft).abs().max() > 100 * (logits(merged, ids) - peft).abs().max()  # the LoRA did matter


def test_missing_lora_alpha_is_an_error_and_explicit_alpha_works(ckpts, tmp_path, cli):
    from converter.engine.base_reader import open_base

    actor = tmp_path / "actor"
    shutil.copytree(ckpts / "lora/actor", actor)
    (actor / "lora_train_meta.json").unlink()
    code, out, err = cli("merge", "--base", actor, "--out", tmp_path / "m")
    assert code == 2 and "no lora_alpha" in err and "--lora-alpha" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "m").exists()
    ckpt = open_base(actor, lora_alpha=8)
    name = "model.layers.0.self_attn.q_proj.weight"
    expected = peft_merged_fp64(ckpts / "ref/lora/base", ckpts / "ref/lora/adapter")[name].float()
    torch.testing.assert_close(ckpt.read(name), expected, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(open_base(actor, lora_alpha=16).read(name), expected)
    code, _, err = cli("merge", "--base", actor, "--out", tmp_path / "m", "--lora-alpha", "8", "--no-verify")
    assert code == 0, err
    from safetensors.torch import load_file

    merged = {k: v for f in sorted((tmp_path / "m").glob("*.safetensors")) for k, v in load_file(f).items()}
    torch.testing.assert_close(merged[name].float(), expected, atol=1e-6, rtol=1e-6)
    shutil.rmtree(tmp_path / "m")
    (actor / "lora_train_meta.json").write_text('{"r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM"}')
    code, _, err = cli("merge", "--base", actor, "--out", tmp_path / "m")
    assert code == 2 and "has rank 4 but lora_train_meta.json says r=8" in err, err


def _broken(ckpts, tmp_path, damage) -> object:
    actor = tmp_path / "global_step_1" / "actor"
    shutil.copytree(ckpts / "plain/actor", actor)
    damage(actor)
    return actor


def _truncate(actor):
    f = actor / "model_world_size_2_rank_1.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


class _NotATensor:
    pass


def _non_tensor(actor):
    torch.save({"model.norm.weight": _NotATensor()}, actor / "model_world_size_2_rank_1.pt")


def _partial_from(ckpts):
    def damage(actor):
        for r in (0, 1):
            shutil.copy(ckpts / f"partial/model_world_size_2_rank_{r}.pt", actor)

    return damage


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "model_world_size_2_rank_1.pt is missing"),
        ("truncated", "model_world_size_2_rank_1.pt: not a readable torch.save file"),
        ("world_size", "world_size is 4 but the rank files are for world size 2"),
        ("two_saves", "rank files of several world sizes"),
        ("non_tensor", "holds objects other than tensors"),
        ("partial", "only Shard(d) and Replicate can be reassembled"),
    ],
)
def test_bad_training_checkpoints_are_one_line_errors(ckpts, tmp_path, cli, case, message):
    damage = {
        "missing": lambda a: (a / "model_world_size_2_rank_1.pt").unlink(),
        "truncated": _truncate,
        "world_size": lambda a: (a / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 4}'),
        "two_saves": lambda a: shutil.copy(a / "model_world_size_2_rank_0.pt", a / "model_world_size_4_rank_0.pt"),
        "non_tensor": _non_tensor,
        "partial": _partial_from(ckpts),
    }[case]
    actor = _broken(ckpts, tmp_path, damage)
    out = tmp_path / "merged"
    code, stdout, err = cli("merge", "--base", actor.parent, "--out", out)
    assert code == 2, (stdout, err)
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".merged*"))


def test_truncated_dcp_chunk_file_is_refused(ckpts, tmp_path, cli):
    actor = tmp_path / "actor"
    shutil.copytree(ckpts / "dcp/actor", actor)
    f = actor / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:100])
    code, _, err = cli("merge", "--base", actor, "--out", tmp_path / "m")
    assert code == 2 and "__1_0.distcp: tensor" in err and "past the end of the file" in err, err
    assert not (tmp_path / "m").exists()


def test_dcp_metadata_with_foreign_objects_is_refused(ckpts, tmp_path, cli):
    import pickle

    actor = tmp_path / "actor"
    shutil.copytree(ckpts / "dcp/actor", actor)
    (actor / ".metadata").write_bytes(pickle.dumps({"x": _NotATensor()}))
    code, _, err = cli("merge", "--base", actor, "--out", tmp_path / "m")
    assert code == 2 and "not a checkpoint metadata type" in err and "--allow-pickle" in err, err


def test_reading_one_tensor_touches_only_its_byte_ranges(ckpts, monkeypatch):
    """Lazy: opening reads structure only; a tensor read opens its shards' ranges, not whole rank files."""
    from converter.training import open_training

    ckpt = open_training(ckpts / "plain/actor")
    reads = []
    real_open = open

    def spy(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        if "b" in mode and str(path).endswith(".pt"):
            real_read = f.readinto

            def readinto(buf):
                reads.append(len(buf))
                return real_read(buf)

            f.readinto = readinto
        return f

    monkeypatch.setattr("builtins.open", spy)
    t = ckpt.read("model.norm.weight")
    assert t.shape == (32,) and sum(reads) == 32 * 4  # two ranks' halves: 16 floats each


def test_merge_is_verified_with_peft_on_the_checkpoint_written_unmerged(ckpts, tmp_path, cli):
    run = cli("merge", "--base", ckpts / "lora/actor", "--out", tmp_path / "m", verify=True)
    assert_proven(run)
    assert "written unmerged (base + its LoRA)" in run[1]


def test_verification_catches_a_wrong_fusion(ckpts, tmp_path, cli, monkeypatch):
    """Sabotage: the LoRA fused at half its scale (a wrong alpha/r) must fail against PEFT's forward."""
    from converter.training import view

    real = view.TrainingCheckpoint.read

    def half(self, name):
        t = real(self, name)
        if name in self._lora:
            base = self.read_unfused(name)
            return (base.float() + (t.float() - base.float()) * 0.5).to(t.dtype)
        return t

    monkeypatch.setattr(view.TrainingCheckpoint, "read", half)
    assert cli("merge", "--base", ckpts / "lora/actor", "--out", tmp_path / "m")[0] == 0
    monkeypatch.setattr(view.TrainingCheckpoint, "read", real)
    assert_failed(cli("verify", tmp_path / "m"))


def _to_megatron(hf: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """What Megatron-Core stores for a Llama: fused qkv interleaved per KV group, gate/up stacked, norms fused."""
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    hidden = config["hidden_size"]
    hd = hidden // heads
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        q = hf[p + "self_attn.q_proj.weight"].reshape(groups, heads // groups * hd, hidden)
        k = hf[p + "self_attn.k_proj.weight"].reshape(groups, hd, hidden)
        v = hf[p + "self_attn.v_proj.weight"].reshape(groups, hd, hidden)
        m = f"decoder.layers.{n}."
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, hidden).clone()
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


def test_megatron_core_names_in_a_dcp_checkpoint_map_to_transformers_names(ckpts, tmp_path, cli):
    """A DCP checkpoint with Megatron-Core names (written directly with torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    ref = ckpts / "ref/plain/base"
    config = json.loads((ref / "config.json").read_text())
    actor = tmp_path / "megatron"
    dcp.save(_to_megatron(read_tensors(ref), config), checkpoint_id=str(actor), no_dist=True)
    (actor / "huggingface").mkdir()
    shutil.copy(ref / "config.json", actor / "huggingface/config.json")
    code, out, err = cli("merge", "--base", actor, "--out", tmp_path / "m")
    assert code == 0, err
    assert "Megatron-Core names" in out
    ours, expected = read_tensors(tmp_path / "m"), read_tensors(ref)
    assert set(ours) == set(expected)
    assert all(_bytes_equal(ours[k], expected[k]) for k in expected)

    wrong = json.loads(json.dumps(config)) | {"num_key_value_heads": 1}  # another model's config
    (actor / "huggingface/config.json").write_text(json.dumps(wrong))
    code, _, err = cli("merge", "--base", actor, "--out", tmp_path / "m2")
    assert code == 2 and "linear_qkv.weight has 64 rows; config.json implies 1 x 32 + 8 + 8" in err, err


def test_megatron_rename_rules_follow_the_keymap_schema():
    import yaml

    from converter.engine.keymap import load_keymap
    from converter.engine.keymap_schema import KeymapError

    rule = {"from": "^a$", "to": ["x", "y"], "split": {"rows": [1, 1]}}
    km = load_keymap(
        "keymaps/megatron.yaml", yaml.safe_dump({"name": "megatron", "model_types": [], "renames": [rule]})
    )
    assert km.renames[0].rows == ["1", "1"] and km.renames[0].groups == "1"
    bad = {**rule, "split": {"row": [1, 1]}}
    with pytest.raises(KeymapError, match=r"renames\[0\]\.split\.row: unknown key \(did you mean 'rows'\?"):
        load_keymap("keymaps/megatron.yaml", yaml.safe_dump({"name": "megatron", "model_types": [], "renames": [bad]}))
    with pytest.raises(KeymapError, match=r"renames\[0\]\.from: not a valid regular expression"):
        load_keymap(
            "keymaps/megatron.yaml",
            yaml.safe_dump({"name": "megatron", "model_types": [], "renames": [{**rule, "from": "("}]}),
        )


def test_moe_with_fused_experts_reassembles_and_loads(ckpts, tmp_path, cli):
    """Qwen3-MoE in memory (what FSDP saves) fuses experts into 3D tensors, sharded over the expert dim; the output
    keeps them fused, which transformers 5 loads as is: the same parameters and logits as the model before."""
    code, _, err = cli("merge", "--base", ckpts / "moe/actor", "--out", tmp_path / "m")
    assert code == 0, err
    ours = read_tensors(tmp_path / "m")
    assert ours["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    assert ours["model.layers.0.mlp.experts.down_proj"].shape == (4, 32, 16)
    merged, before = load_merged(tmp_path / "m"), load_merged(ckpts / "ref/moe/base")
    a, b = merged.state_dict(), before.state_dict()
    assert set(a) == set(b) and all(_bytes_equal(a[k], b[k]) for k in b)
    ids = torch.randint(3, 67, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(merged, ids), logits(before, ids))


def test_inspect_describes_a_training_checkpoint(ckpts, cli):
    code, out, err = cli("inspect", ckpts / "lora", "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    assert info["layout"] == "verl FSDP" and info["architecture"] == "LlamaForCausalLM"
    assert info["shards"] == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    assert info["tensors"] == 20 and any("LoRA inside" in n for n in info["notes"])


def test_critic_on_a_hybrid_mesh_keeps_its_value_head(ckpts, tmp_path, cli):
    """verl's critic/ (a ForTokenClassification model) saved with HSDP: placements (Replicate, Shard(0))."""
    from transformers import AutoModelForTokenClassification

    from converter.training.fsdp import load_meta

    state = load_meta(ckpts / "critic/critic/model_world_size_2_rank_0.pt", allow_pickle=False)
    assert state["score.weight"].device_mesh.mesh_dim_names == ("ddp", "fsdp")
    assert [type(p).__name__ for p in state["score.weight"].placements] == ["Replicate", "Shard"]
    code, _, err = cli("merge", "--base", ckpts / "critic", "--out", tmp_path / "m")  # critic/ found inside
    assert code == 0, err
    ours, expected = read_tensors(tmp_path / "m"), read_tensors(ckpts / "ref/critic/base")
    assert "score.weight" in ours and ours["score.weight"].shape == (1, 32)
    assert set(ours) == set(expected) and all(_bytes_equal(ours[k], expected[k]) for k in expected)
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "m")
    assert type(model).__name__ == "LlamaForTokenClassification"


def test_push_publishes_a_training_checkpoint(ckpts, tmp_path):
    """`converter push --base <global_step>/actor`: merged, verified against PEFT, uploaded in one commit."""
    from safetensors.torch import load

    from converter.testing.hub import HubServer, client_env

    token = "hf_fake_alice_0123456789"
    hub = HubServer(tmp_path / "server").start()
    try:
        hub.add_user("alice", token)
        proc = subprocess.run(
            [sys.executable, "-m", "converter", "push", "--repo", "alice/rl-run", "--base", str(ckpts / "lora")],
            capture_output=True, text=True, env=client_env(hub, token, None), timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "**Passed**" in proc.stdout and token not in proc.stdout + proc.stderr
        files = hub.files("alice/rl-run")
        assert {"model.safetensors", "config.json", "README.md", "converter_provenance.json"} <= set(files)
        pushed = load(hub.read_file("alice/rl-run", "model.safetensors"))
        local = tmp_path / "local"
        from model_helpers import run_cli

        assert run_cli("merge", "--base", ckpts / "lora/actor", "--out", local, "--no-verify") == 0
        assert (local / "model.safetensors").read_bytes() == hub.read_file("alice/rl-run", "model.safetensors")
        assert "lm_head.weight" not in pushed
        provenance = json.loads(hub.read_file("alice/rl-run", "converter_provenance.json"))
        assert any("LoRA inside the checkpoint" in n for n in provenance["notes"])
    finally:
        hub.stop()


class _MemorySource:
    """A sharded source stand-in (the reader interface), for the view's naming rules alone."""

    kind = "test"

    def __init__(self, tensors: dict[str, torch.Tensor], folder):
        self.tensors, self.files = tensors, [folder / "state.pt"]
        self.files[0].write_bytes(b"x")  # the view lists (and sizes) the source's files

    def names(self):
        return list(self.tensors)

    def dtype(self, name):
        return self.tensors[name].dtype

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def storage_of(self, name):
        return (name,)

    def read(self, name):
        return self.tensors[name].clone()


def test_a_lora_on_a_tied_head_unties_it(tmp_path):
    """As PEFT's merge does: a LoRA on lm_head of a tied model gives an untied head and says so in config.json."""
    from converter.training import TrainingCheckpoint

    (tmp_path / "huggingface").mkdir()
    (tmp_path / "huggingface/config.json").write_text('{"model_type": "llama", "tie_word_embeddings": true}')
    (tmp_path / "lora_train_meta.json").write_text('{"r": 2, "lora_alpha": 4}')
    g = torch.Generator().manual_seed(0)
    emb, a, b = torch.randn(10, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(10, 2, generator=g)
    tensors = {
        "base_model.model.model.embed_tokens.weight": emb,
        "base_model.model.lm_head.base_layer.weight": emb,
        "base_model.model.lm_head.lora_A.default.weight": a,
        "base_model.model.lm_head.lora_B.default.weight": b,
    }
    ckpt = TrainingCheckpoint(tmp_path, _MemorySource(tensors, tmp_path))
    assert ckpt.names() == ["model.embed_tokens.weight", "lm_head.weight"]
    assert ckpt.config["tie_word_embeddings"] is False
    torch.testing.assert_close(ckpt.read("lm_head.weight"), emb + 2.0 * b @ a)
    assert torch.equal(ckpt.read("model.embed_tokens.weight"), emb)


def test_merging_a_training_checkpoint_imports_no_heavy_library(ckpts, tmp_path):
    code = (
        "import sys; from converter.cli import main; "
        f"main(['merge', '--base', {str(ckpts / 'lora')!r}, '--out', {str(tmp_path / 'm')!r}, '--no-verify']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'peft', 'safetensors', 'accelerate', 'diffusers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "m/model.safetensors").is_file()


def _legacy_megatron(mcore: dict[str, torch.Tensor], config: dict, folder, tp: int = 2, pp: int = 2) -> None:
    """mp_rank_XX_YYY/model_optim_rng.pt as Megatron writes them: TP shards (column-parallel on dim 0, row-parallel
    linear_proj / linear_fc2 on dim 1, gate/up split per rank, vocab padded to a multiple of tp), stages numbering
    their layers from 0."""
    import argparse

    inter = config["intermediate_size"]
    layers = config["num_hidden_layers"]
    per_stage = layers // pp
    vocab = config["vocab_size"]
    padded = -(-vocab // tp) * tp

    def shard(key: str, t: torch.Tensor, r: int) -> torch.Tensor:
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = torch.cat([t, torch.zeros(padded - vocab, t.shape[1])])
            return t.chunk(tp)[r]
        if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
            return t.chunk(tp, dim=1)[r]
        if key.endswith("linear_fc1.weight"):
            gate, up = t[:inter].chunk(tp)[r], t[inter:].chunk(tp)[r]
            return torch.cat([gate, up])
        if key.endswith("linear_qkv.weight"):
            return t.chunk(tp)[r]  # whole KV groups per rank
        return t  # norms: replicated

    for p in range(pp):
        for r in range(tp):
            state = {}
            for key, t in mcore.items():
                m = re.match(r"decoder\.layers\.(\d+)\.(.*)", key)
                if m:
                    n = int(m.group(1))
                    if n // per_stage != p:
                        continue
                    local = f"decoder.layers.{n - p * per_stage}.{m.group(2)}"
                elif key.startswith("embedding.") and p != 0 or not key.startswith("embedding.") and p != pp - 1:
                    continue
                else:
                    local = key
                state[local] = shard(key, t, r).clone()
                state[local.rsplit(".", 1)[0] + "._extra_state"] = None
            d = folder / f"mp_rank_{r:02d}_{p:03d}"
            d.mkdir(parents=True)
            args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            torch.save({"model": state, "args": args, "iteration": 100, "checkpoint_version": 3.0},
                       d / "model_optim_rng.pt")  # fmt: skip


def test_legacy_megatron_tp_and_pp_shards_are_joined_by_the_keymap(ckpts, tmp_path, cli):
    ref = ckpts / "ref/plain/base"
    config = json.loads((ref / "config.json").read_text())
    folder = tmp_path / "iter_0000100"
    _legacy_megatron(_to_megatron(read_tensors(ref), config), config, folder)
    (folder / "huggingface").mkdir()
    shutil.copy(ref / "config.json", folder / "huggingface/config.json")
    code, out, err = cli("merge", "--base", folder, "--out", tmp_path / "m")
    assert code == 0, err
    assert "Megatron mp_rank (Megatron-Core names) shards (4 files" in out
    ours, expected = read_tensors(tmp_path / "m"), read_tensors(ref)
    assert set(ours) == set(expected)
    assert all(_bytes_equal(ours[k], expected[k]) for k in expected), [
        k for k in expected if not _bytes_equal(ours[k], expected[k])
    ]
    shutil.rmtree(folder / "mp_rank_01_001")
    code, _, err = cli("merge", "--base", folder, "--out", tmp_path / "m2")
    assert code == 2 and "mp_rank_01_001/model_optim_rng.pt is missing (2 tensor x 2 pipeline" in err, err


def test_an_older_checkpoint_without_fsdp_config_and_a_dtype(ckpts, tmp_path, cli):
    """No fsdp_config.json (older verl): the world size comes from the file names. --dtype rounds once."""
    actor = tmp_path / "actor"
    shutil.copytree(ckpts / "plain/actor", actor)
    (actor / "fsdp_config.json").unlink()
    code, _, err = cli("merge", "--base", actor, "--out", tmp_path / "m", "--dtype", "bfloat16")
    assert code == 0, err
    ours, expected = read_tensors(tmp_path / "m"), read_tensors(ckpts / "ref/plain/base")
    assert all(torch.equal(ours[k], expected[k].to(torch.bfloat16)) for k in expected)
    assert json.loads((tmp_path / "m/config.json").read_text())["dtype"] == "bfloat16"


def _moe_lora_merged(ckpts, tmp_path, cli):
    code, out, err = cli("merge", "--base", ckpts / "moe_lora", "--out", tmp_path / "m")
    assert code == 0, err
    assert "fused into 6 weights (4 of them fused MoE expert tensors)" in out
    ids = torch.randint(3, 67, (2, 10), generator=torch.Generator().manual_seed(0))
    peft = logits(reference_model(ckpts / "ref/moe_lora/base", [ckpts / "ref/moe_lora/adapter"]), ids)
    bare = logits(load_merged(ckpts / "ref/moe_lora/base"), ids)
    return logits(load_merged(tmp_path / "m"), ids), peft, bare


def test_lora_on_fused_moe_experts_matches_peft_forward(ckpts, tmp_path, cli):
    """PEFT target_parameters on gate_up_proj (E, 2I, H) and down_proj (E, H, I): the oracle is PEFT's forward."""
    merged, peft, bare = _moe_lora_merged(ckpts, tmp_path, cli)
    torch.testing.assert_close(merged, peft, atol=1e-5, rtol=1e-5)
    assert (bare - peft).abs().max() > 100 * (merged - peft).abs().max()
    a = read_tensors(tmp_path / "m")["model.layers.0.mlp.experts.gate_up_proj"]
    b = read_tensors(ckpts / "ref/moe_lora/base")
    assert not torch.equal(a[0, :16], b["model.layers.0.mlp.experts.0.gate_proj.weight"])  # the LoRA landed


def test_scrambled_experts_are_caught_by_the_oracle(ckpts, tmp_path, cli, monkeypatch):
    """Unsloth's bug: reading A rank-major instead of expert-major permutes the experts' deltas; PEFT disagrees."""
    from converter.formats import patches

    def scrambled(a, b, experts):
        r = a.shape[0] // experts
        return b.reshape(b.shape[0], r, experts).permute(2, 0, 1), a.reshape(r, experts, a.shape[1]).transpose(0, 1)

    monkeypatch.setattr(patches, "expert_factors", scrambled)
    merged, peft, _ = _moe_lora_merged(ckpts, tmp_path, cli)
    assert not torch.allclose(merged, peft, atol=1e-4, rtol=1e-4)


def test_a_training_checkpoint_with_moe_lora_is_verified(ckpts, tmp_path, cli):
    """Written unmerged (fused experts + a target_parameters adapter, as PEFT saves one), checked through PEFT."""
    assert_proven(cli("merge", "--base", ckpts / "moe_lora", "--out", tmp_path / "m", verify=True))


@pytest.mark.parametrize("layout", ["lora", "moe_lora"])
def test_keep_adapter_writes_the_base_unmerged_and_a_peft_adapter(ckpts, tmp_path, cli, layout):
    """`merge --keep-adapter`: OUT/base is the base as trained (bit for bit the model before the LoRA), OUT/adapter
    a PEFT folder (target_parameters for fused experts) that PEFT loads onto it and that equals the fused merge."""
    code, out, err = cli("merge", "--base", ckpts / layout, "--out", tmp_path / "k", "--keep-adapter")
    assert code == 0, err
    assert "LoRA not applied" in out and f"lora_alpha {4 if layout == 'moe_lora' else 8} " in out
    ours, before = read_tensors(tmp_path / "k/base"), read_tensors(ckpts / f"ref/{layout}/base")
    if layout == "lora":
        assert set(ours) == set(before) and all(_bytes_equal(ours[k], before[k]) for k in before)
    config = json.loads((tmp_path / "k/adapter/adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and bool(config["target_parameters"]) == (layout == "moe_lora")
    ids = torch.randint(3, 67, (2, 10), generator=torch.Generator().manual_seed(0))
    kept = logits(reference_model(tmp_path / "k/base", [tmp_path / "k/adapter"]), ids)
    peft = logits(reference_model(ckpts / f"ref/{layout}/base", [ckpts / f"ref/{layout}/adapter"]), ids)
    torch.testing.assert_close(kept, peft, atol=1e-5, rtol=1e-5)
    assert cli("merge", "--base", ckpts / layout, "--out", tmp_path / "m")[0] == 0
    torch.testing.assert_close(logits(load_merged(tmp_path / "m"), ids), kept, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--base", "plain"), "holds no LoRA"),
        (("--base", "lora", "--adapter", "ref/lora/adapter"), "--adapter does not apply"),
        (("--base", "lora", "--dtype", "bfloat16"), "--dtype does not apply"),
        (("--base", "ref/lora/base"), "is for training checkpoints"),
    ],
)
def test_keep_adapter_refuses_what_does_not_apply(ckpts, tmp_path, cli, args, message):
    args = tuple(str(ckpts / a) if a in ("plain", "lora", "ref/lora/adapter", "ref/lora/base") else a for a in args)
    code, _, err = cli("merge", *args, "--out", tmp_path / "k", "--keep-adapter")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "k").exists()


def test_a_trl_value_head_critic_keeps_its_head_under_trls_names(ckpts, tmp_path, cli):
    """trl's AutoModelForCausalLMWithValueHead: `pretrained_model.` stripped (trl saves the LM's own names), the head
    kept as `v_head.summary.weight/bias` (trl's loader reads those keys; transformers ignores them), tied head once."""
    from safetensors.torch import load_file

    code, out, err = cli("merge", "--base", ckpts / "value", "--out", tmp_path / "m")  # critic/ found inside
    assert code == 0, err
    assert "value head kept as v_head.summary.weight, v_head.summary.bias" in out
    ours, before = read_tensors(tmp_path / "m"), read_tensors(ckpts / "ref/value/base")
    head = load_file(ckpts / "ref/value/v_head.safetensors")
    assert set(ours) == set(before) | set(head) and "lm_head.weight" not in ours
    assert all(_bytes_equal(ours[k], v) for k, v in {**before, **head}.items())
    ids = torch.randint(3, 67, (2, 10), generator=torch.Generator().manual_seed(0))
    merged = load_merged(tmp_path / "m")
    assert merged.config.tie_word_embeddings
    assert torch.equal(logits(merged, ids), logits(load_merged(ckpts / "ref/value/base"), ids))
