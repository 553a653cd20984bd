"""Training checkpoints as verl, Megatron-LM and torchtitan lay them out, from every folder a user would give.

The checkpoints are written once for the module by converter.testing.training_layouts (2 gloo processes) and
arranged here into the run trees the trainers keep. The oracle is the model before sharding (bit for bit) and,
for a LoRA inside, PEFT's own forward of the unmerged model.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from model_helpers import assert_proven, load_merged, logits, read_tensors, reference_model

pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    proc = subprocess.run(
        [sys.executable, "-m", "converter.testing.training_layouts", str(root)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _copy(src, dst):
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)


@pytest.fixture(scope="module")
def runs(built):
    """The trees each trainer writes, made of the built checkpoints (copies: a few hundred KiB)."""
    b, r = built, built / "runs"
    hf = b / "fsdp/step20/huggingface"
    # verl FSDP: <run>/latest_checkpointed_iteration.txt, global_step_N/actor/
    _copy(b / "fsdp/step10", r / "verl_fsdp/global_step_10/actor")
    _copy(b / "fsdp/step20", r / "verl_fsdp/global_step_20/actor")
    (r / "verl_fsdp/latest_checkpointed_iteration.txt").write_text("20")
    # a PPO step: actor and critic side by side
    _copy(b / "fsdp/step20", r / "ppo/global_step_20/actor")
    _copy(b / "critic", r / "ppo/global_step_20/critic")
    (r / "ppo/latest_checkpointed_iteration.txt").write_text("20")
    # verl Megatron before layout v2 (Megatron-Core <= 0.15): actor/dist_ckpt/ beside actor/huggingface/
    _copy(b / "mcore/llama_v015", r / "verl_mcore_v1/global_step_5/actor/dist_ckpt")
    _copy(hf, r / "verl_mcore_v1/global_step_5/actor/huggingface")
    (r / "verl_mcore_v1/latest_checkpointed_iteration.txt").write_text("5")
    # verl Megatron layout v2: actor/model/dist_ckpt/, model/huggingface/, optimizer/dist_ckpt/ (another model's
    # shards here: taking them for the weights would fail loudly)
    v2 = r / "verl_mcore_v2/global_step_5/actor"
    _copy(b / "mcore/llama", v2 / "model/dist_ckpt")
    _copy(hf, v2 / "model/huggingface")
    _copy(b / "mcore/moe", v2 / "optimizer/dist_ckpt")
    (v2 / "transformer_config.json").write_text("{}")
    (r / "verl_mcore_v2/latest_checkpointed_iteration.txt").write_text("5")
    # Megatron-LM: iter_NNNNNNN/ torch_dist folders, the tracker naming the latest; no Hugging Face config
    _copy(b / "mcore/llama", r / "megatron_lm/iter_0000005")
    _copy(b / "mcore/moe", r / "megatron_lm/iter_0000003")
    (r / "megatron_lm/latest_checkpointed_iteration.txt").write_text("5")
    # torchtitan: <dump>/checkpoint/step-N/, no tracker, no config
    _copy(b / "titan/step-10", r / "titan/checkpoint/step-10")
    _copy(b / "titan/step-20", r / "titan/checkpoint/step-20")
    return r


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _same_as(out, ref) -> None:
    ours, expected = read_tensors(out), read_tensors(ref)
    assert set(ours) == set(expected), set(ours) ^ set(expected)
    assert all(_bytes_equal(ours[k], expected[k]) for k in expected), [
        k for k in expected if not _bytes_equal(ours[k], expected[k])
    ]


LLAMA = "ref/llama/base"
ENTRY_POINTS = [
    # (where --base points, --config, the note that names the step taken, the reference)
    ("verl_fsdp", None, "global_step_20 taken: latest_checkpointed_iteration.txt", LLAMA),
    ("verl_fsdp/global_step_20", None, None, LLAMA),
    ("verl_fsdp/global_step_20/actor", None, None, LLAMA),
    ("verl_fsdp/global_step_20/actor/model_world_size_2_rank_1.pt", None, None, LLAMA),
    ("verl_mcore_v1", None, "global_step_5 taken", LLAMA),
    ("verl_mcore_v1/global_step_5", None, None, LLAMA),
    ("verl_mcore_v1/global_step_5/actor", None, None, LLAMA),
    ("verl_mcore_v1/global_step_5/actor/dist_ckpt", None, None, LLAMA),
    ("verl_mcore_v2", None, "global_step_5 taken", LLAMA),
    ("verl_mcore_v2/global_step_5/actor", None, None, LLAMA),
    ("verl_mcore_v2/global_step_5/actor/model", None, None, LLAMA),
    ("verl_mcore_v2/global_step_5/actor/model/dist_ckpt", None, None, LLAMA),
    ("megatron_lm", LLAMA, "iter_0000005 taken", LLAMA),
    ("megatron_lm/iter_0000005", LLAMA + "/config.json", None, LLAMA),
    ("megatron_lm/iter_0000003", "ref/moe/base", None, "ref/moe/base"),
    ("titan/checkpoint", LLAMA, "step-20 taken: the highest of 2", LLAMA),
    ("titan/checkpoint/step-20", LLAMA + "/config.json", None, LLAMA),
]


@pytest.mark.parametrize(("base", "config", "note", "ref"), ENTRY_POINTS)
def test_every_entry_point_merges_to_the_model_before_sharding(built, runs, tmp_path, cli, base, config, note, ref):
    args = ["--config", built / config] if config else []
    code, out, err = cli("merge", "--base", runs / base, "--out", tmp_path / "m", *args)
    assert code == 0, err
    assert "reassembled from" in out
    if note:
        assert note in out
    _same_as(tmp_path / "m", built / ref)
    config = json.loads((tmp_path / "m/config.json").read_text())
    assert config["model_type"] == json.loads((built / ref / "config.json").read_text())["model_type"]


def test_the_critic_is_its_own_reference(built, runs, tmp_path, cli):
    """The PPO critic merged from its folder equals the one verl's FSDP writer sharded (written directly)."""
    code, _, err = cli("merge", "--base", runs / "ppo/global_step_20/critic", "--out", tmp_path / "a")
    assert code == 0, err
    code, _, err = cli("merge", "--base", built / "critic", "--out", tmp_path / "b")
    assert code == 0, err
    a, b = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert "score.weight" in a and all(_bytes_equal(a[k], b[k]) for k in b)


def test_the_tracker_picks_the_step_not_the_newest_folder(built, runs, tmp_path, cli):
    run = tmp_path / "run"
    shutil.copytree(runs / "verl_fsdp", run)
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    code, out, err = cli("merge", "--base", run, "--out", tmp_path / "m")
    assert code == 0 and "global_step_10 taken" in out, err
    ours, step20 = read_tensors(tmp_path / "m"), read_tensors(built / LLAMA)
    assert not torch.equal(ours["model.norm.weight"], step20["model.norm.weight"])  # step 10 is another model


def _one_line(code: int, err: str) -> str:
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        ("ppo", (), "holds both an actor/ and a critic/ checkpoint; pass"),
        ("ppo/global_step_20", (), "holds both an actor/ and a critic/ checkpoint; pass"),
        ("empty", (), "no weights converter recognises; looked for verl FSDP rank files"),
        ("stray", (), "no weights converter recognises"),
        ("megatron_lm", (), "without its Hugging Face config.json (looked in"),
        ("titan/checkpoint/step-20", (), "give --config with the base model's folder or its config.json"),
        ("missing_step", (), "names step 30 but"),
        ("megatron_lm", ("--config", "nowhere"), "--config nowhere: no config.json there"),
        ("verl_mcore_v1/global_step_5/actor", ("--config", "ref/moe/base"), "holds 4 layers (up to 3) but its config"),
        ("mcore_lora", (), "holds a LoRA adapter's training state only"),
        ("adapter", (), "an adapter (adapter_config.json), not a model"),
        ("ref/llama/base", (), "merge needs at least one --adapter"),
        ("titan/checkpoint", ("--config", "ref/moe/base"), "model_type 'qwen3_moe'"),
    ],
)
def test_wrong_or_empty_folders_are_one_line_errors(built, runs, tmp_path, cli, make, args, message):
    """Each says what it looked for and where (or what to pass); none says `merge needs ... --adapter` wrongly."""
    base = runs / make
    if make == "empty":
        base = tmp_path / "empty"
        base.mkdir()
    elif make == "stray":
        base = tmp_path / "stray"
        (base / "actor").mkdir(parents=True)
        (base / "actor/notes.txt").write_text("x")
        (base / "actor/huggingface").mkdir()
    elif make == "missing_step":
        base = tmp_path / "run"
        shutil.copytree(runs / "verl_fsdp", base)
        (base / "latest_checkpointed_iteration.txt").write_text("30")
    elif make == "mcore_lora":
        base = tmp_path / "actor"
        shutil.copytree(runs / "verl_mcore_v1/global_step_5/actor", base)
        (base / "huggingface/adapter").mkdir()
        (base / "huggingface/adapter/adapter_config.json").write_text("{}")
    elif make == "adapter":
        base = tmp_path / "adapter"
        base.mkdir()
        (base / "adapter_config.json").write_text("{}")
    elif make.startswith("ref/"):
        base = built / make
    args = tuple(str(built / a) if a.startswith("ref/") else a for a in args)
    code, _, err = cli("merge", "--base", base, "--out", tmp_path / "m", *args)
    _one_line(code, err)
    assert message in err, err
    if message != "merge needs at least one --adapter":
        assert "needs at least one --adapter" not in err
    assert not (tmp_path / "m").exists()


def test_megatron_bridge_runs_keep_their_weights_in_huggingface(built, runs, tmp_path, cli):
    """verl with Megatron-Bridge: dist_ckpt/ holds only training state, huggingface/ the model in safetensors."""
    import torch.distributed.checkpoint as dcp

    actor = tmp_path / "global_step_7/actor"
    dcp.save({"optimizer.state.exp_avg": torch.ones(8)}, checkpoint_id=str(actor / "dist_ckpt"), no_dist=True)
    shutil.copytree(built / LLAMA, actor / "huggingface")
    code, out, err = cli("merge", "--base", tmp_path / "global_step_7", "--out", tmp_path / "m")
    assert code == 0, err
    assert "hold no model" in out
    _same_as(tmp_path / "m", built / LLAMA)


def test_inspect_names_the_layout_and_the_step(built, runs, cli):
    code, out, err = cli("inspect", runs / "verl_mcore_v2", "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    assert info["layout"] == "Megatron torch_dist (Megatron-Core names)" and info["tensors"] == 39
    assert any("global_step_5 taken" in n for n in info["notes"])
    code, out, err = cli("inspect", runs / "titan/checkpoint", "--json", "--config", built / LLAMA)
    assert code == 0 and json.loads(out)["details"]["layout"] == "torchtitan DCP", err


def test_push_from_a_verl_megatron_run(built, runs, tmp_path):
    """`converter push --base <run>`: the latest step's actor found, merged and uploaded."""
    from converter.testing.hub import HubServer, client_env

    token = "hf_fake_alice_0123456789"
    hub = HubServer(tmp_path / "server").start()
    try:
        hub.add_user("alice", token)
        proc = subprocess.run(
            [sys.executable, "-m", "converter", "push", "--repo", "alice/rl", "--base", str(runs / "verl_mcore_v1")],
            capture_output=True, text=True, env=client_env(hub, token, None), timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        from safetensors.torch import load

        pushed = load(hub.read_file("alice/rl", "model.safetensors"))
        expected = read_tensors(built / LLAMA)
        assert set(pushed) == set(expected) and all(_bytes_equal(pushed[k], expected[k]) for k in expected)
    finally:
        hub.stop()


def _rotary(x: torch.Tensor, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(halves, pairs): the same rotation applied to each head's dims as transformers (rotate_half over the two
    halves) and torchtitan's Llama (complex multiplication of adjacent pairs) do it; x is (tokens, heads, dim)."""
    t, _, d = x.shape
    freqs = torch.outer(
        torch.arange(t, dtype=torch.float64), theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    )
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
    halves = x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin
    pairs = torch.view_as_real(torch.view_as_complex(x.reshape(t, -1, d // 2, 2)) * torch.polar(
        torch.ones_like(freqs), freqs)[:, None]).reshape(x.shape)  # fmt: skip
    return halves, pairs


def test_torchtitan_rope_rows_are_reordered_the_way_attention_needs(built):
    """Independent of the name mapping: torchtitan's wq/wk with its pairwise RoPE give the same attention scores
    as the transformers q_proj/k_proj we write with transformers' half-split RoPE; unreordered rows do not."""
    from converter.engine.base_reader import open_base

    ckpt = open_base(built / "titan/step-20", config=built / LLAMA)
    raw = {k: ckpt.source.inner.read(k) for k in ("layers.0.attention.qkv_linear.wq.weight",
                                                  "layers.0.attention.qkv_linear.wk.weight")}  # fmt: skip
    heads, kv, d = 4, 2, 8
    x = torch.randn(6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def scores(wq, wk, rope):
        q, k = (x @ wq.double().T).view(6, heads, d), (x @ wk.double().T).view(6, kv, d)
        q, k = rope(q), rope(k).repeat_interleave(heads // kv, dim=1)
        return torch.einsum("thd,shd->hts", q, k)

    titan = scores(raw["layers.0.attention.qkv_linear.wq.weight"], raw["layers.0.attention.qkv_linear.wk.weight"],
                   lambda t: _rotary(t)[1])  # fmt: skip
    q, k = (ckpt.read(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qk")
    ours = scores(q, k, lambda t: _rotary(t)[0])
    torch.testing.assert_close(ours, titan, rtol=1e-9, atol=1e-9)
    unordered = scores(raw["layers.0.attention.qkv_linear.wq.weight"], raw["layers.0.attention.qkv_linear.wk.weight"],
                       lambda t: _rotary(t)[0])  # fmt: skip
    assert not torch.allclose(unordered, titan, atol=1e-3)


def _gptoss_merged(built, tmp_path, cli, verify: bool = False):
    run = cli("merge", "--base", built / "gptoss", "--out", tmp_path / "m", verify=verify)
    assert run[0] == 0, run[2]
    assert "fused into 6 weights (4 of them fused MoE expert tensors)" in run[1]
    ids = torch.randint(3, 67, (2, 10), generator=torch.Generator().manual_seed(0))
    peft = logits(reference_model(built / "ref/gptoss/base", [built / "ref/gptoss/adapter"]), ids)
    bare = logits(load_merged(built / "ref/gptoss/base"), ids)
    return logits(load_merged(tmp_path / "m"), ids), peft, bare, run


def test_expert_lora_on_experts_stored_in_out_matches_peft(built, tmp_path, cli):
    """GPT-OSS keeps gate_up_proj (E, H, 2I) and down_proj (E, I, H): PEFT's ΔW[e] is (B_e A_e)ᵀ there; the merge
    agrees with PEFT's forward, and verification (PEFT on the unmerged export) passes."""
    merged, peft, bare, run = _gptoss_merged(built, tmp_path, cli, verify=True)
    torch.testing.assert_close(merged, peft, atol=1e-5, rtol=1e-5)
    assert (bare - peft).abs().max() > 100 * (merged - peft).abs().max()
    assert_proven(run)


def test_square_experts_in_the_wrong_orientation_fail_the_oracle(built, tmp_path, cli, monkeypatch):
    """down_proj is square (I = H): only the model type tells (E, in, out) from (E, out, in). Undoing the transpose
    for square deltas (the shape-only guess) is caught by PEFT's forward, and by the tensor proof (PEFT's own
    merge of the target_parameters LoRA) naming the expert tensor."""
    from converter.formats import patches

    real = patches.expert_delta

    def square_untransposed(a, b, experts):
        d = real(a, b, experts)
        return d.transpose(1, 2) if d.shape[1] == d.shape[2] else d

    monkeypatch.setattr(patches, "expert_delta", square_untransposed)
    merged, peft, _, _ = _gptoss_merged(built, tmp_path, cli)
    assert not torch.allclose(merged, peft, atol=1e-4, rtol=1e-4)
    code, out, err = cli("verify", tmp_path / "m", "--proof", "tensors")
    assert code == 3 and "mlp.experts.down_proj" in out + err, out + err
    assert "mlp.experts.gate_up_proj" not in err  # not square: its orientation was never guessed


# --- legacy Megatron (mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt): written here with torch.save, as Megatron-LM does


def _per_layer(built, ref: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Megatron-Core's per-layer (legacy) names: the stacked torch_dist tensors of the builder, unstacked."""
    from converter.testing.training_layouts import to_mcore

    config = json.loads((built / ref / "config.json").read_text())
    out = {}
    for key, (t, _) in to_mcore(read_tensors(built / ref), config).items():
        if not key.startswith("decoder.layers."):
            out[key] = t[: config["vocab_size"]] if key.startswith(("embedding", "output")) else t
            continue
        rest = key.removeprefix("decoder.layers.")
        for n, layer in enumerate(t):
            if ".experts." in rest:
                for e, expert in enumerate(layer):
                    out[f"decoder.layers.{n}.{rest}{e}"] = expert
            else:
                out[f"decoder.layers.{n}.{rest}"] = layer
    return out, config


def _legacy(mcore, config, folder, *, tp=1, pp=1, vpp=1, ep=1, sequential=False, args=True) -> None:
    """mp_rank files: chunk v of stage p holds the (v·pp + p)-th run of layers, numbered from 0 (`model{v}` with
    virtual stages); expert rank e holds experts e·E/ep... numbered from 0; tensor-parallel shards as Megatron cuts
    them (column on dim 0, row-parallel linear_proj / linear_fc2 on dim 1, gate/up halves cut separately, vocab
    padded to a multiple of tp)."""
    layers, experts = config["num_hidden_layers"], config.get("num_local_experts") or 0
    per_chunk, local_experts = layers // (pp * vpp), max(experts // ep, 1)
    padded = -(-config["vocab_size"] // tp) * tp

    def shard(key, t, r):
        if key.startswith(("embedding.", "output_layer.")):
            return torch.cat([t, torch.zeros(padded - t.shape[0], t.shape[1])]).chunk(tp)[r]
        if re.search(r"linear_(proj|fc2)\.weight", key):
            return t.chunk(tp, dim=1)[r]
        if re.search(r"linear_fc1\.weight", key):
            half = t.shape[0] // 2
            return torch.cat([t[:half].chunk(tp)[r], t[half:].chunk(tp)[r]])
        if key.endswith("linear_qkv.weight"):
            return t.chunk(tp)[r]
        return t

    for p in range(pp):
        for e in range(ep):
            for r in range(tp):
                chunks = []
                for v in range(vpp):
                    first = (v * pp + p) * per_chunk
                    state = {}
                    for key, t in mcore.items():
                        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", key)
                        if m:
                            n, rest = int(m.group(1)), m.group(2)
                            if not first <= n < first + per_chunk:
                                continue
                            if x := re.fullmatch(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)", rest):
                                g = int(x.group(2))
                                if g // local_experts != e:
                                    continue
                                i = g % local_experts
                                rest = (f"mlp.experts.local_experts.{i}.{x.group(1)}.weight" if sequential
                                        else f"mlp.experts.{x.group(1)}.weight{i}")  # fmt: skip
                            local = f"decoder.layers.{n - first}.{rest}"
                        elif (p, v) != ((0, 0) if key.startswith("embedding.") else (pp - 1, vpp - 1)):
                            continue
                        else:
                            local = key
                        state[local] = shard(key, t, r).clone()
                        state[local.rsplit(".", 1)[0] + "._extra_state"] = None
                    chunks.append(state)
                name = f"mp_rank_{r:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                (folder / name).mkdir(parents=True)
                saved = {"iteration": 5, "checkpoint_version": 3.0}
                saved.update({f"model{v}": c for v, c in enumerate(chunks)} if vpp > 1 else {"model": chunks[0]})
                if args:
                    saved["args"] = argparse.Namespace(
                        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                    )  # fmt: skip
                torch.save(saved, folder / name / "model_optim_rng.pt")


@pytest.mark.parametrize(
    ("ref", "layout", "files"),
    [
        (LLAMA, dict(tp=2, pp=2, vpp=2), "mp_rank_01_001"),
        ("ref/moe/base", dict(ep=2), "mp_rank_00_001"),
        ("ref/moe/base", dict(tp=2, pp=2, ep=2, sequential=True), "mp_rank_01_001_001"),
    ],
)
def test_legacy_virtual_stages_and_expert_ranks_are_renumbered(built, tmp_path, cli, ref, layout, files):
    """Virtual pipeline stages (`model0`, `model1` in each file) and expert-parallel ranks (`_ZZZ`, or `_YYY` when
    there is no pipeline parallelism: the files' args tell) give back the model before sharding, bit for bit."""
    mcore, config = _per_layer(built, ref)
    run = tmp_path / "run"
    _legacy(mcore, config, run / "iter_0000005", **layout)
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    assert (run / "iter_0000005" / files / "model_optim_rng.pt").is_file()
    code, out, err = cli("merge", "--base", run, "--out", tmp_path / "m", "--config", built / ref)
    assert code == 0, err
    assert "Megatron mp_rank (Megatron-Core names)" in out and "iter_0000005 taken" in out
    _same_as(tmp_path / "m", built / ref)


def test_legacy_expert_ranks_without_args_are_refused(built, tmp_path, cli):
    """`mp_rank_00_001` without the args that say it is an expert rank reads as a pipeline stage: the layers then
    clash, which is refused in one line (no silent merge of a misread checkpoint)."""
    mcore, config = _per_layer(built, "ref/moe/base")
    _legacy(mcore, config, tmp_path / "iter", ep=2, args=False)
    code, _, err = cli(
        "merge", "--base", tmp_path / "iter", "--out", tmp_path / "m", "--config", built / "ref/moe/base"
    )
    assert "held by two pipeline or expert ranks" in _one_line(code, err)
