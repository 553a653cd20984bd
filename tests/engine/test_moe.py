"""MoE adapters given with --adapter: per-expert LoRAs and PEFT target_parameters LoRAs on fused expert tensors,
onto bases that store experts per expert (what save_pretrained writes) or fused (E, out, in) (saved from memory).

The oracle is PEFT's own unmerged forward: PEFT 0.21 loads both kinds of adapter onto transformers 5's fused
experts (it converts per-expert files itself), whichever layout the base has on disk.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from model_helpers import assert_proven, load_merged, logits, read_tensors, reference_model
from safetensors.torch import load_file, save_file

E, R, ALPHA = 4, 2, 6

ARCHS = {
    "mixtral": dict(
        expert="block_sparse_moe.experts.{e}.{p}", parts=("w1", "w2", "w3"), router="block_sparse_moe.gate",
        targets=["q_proj", "w1", "w2", "w3", "gate"],
    ),
    "qwen3_moe": dict(
        expert="mlp.experts.{e}.{p}", parts=("gate_proj", "up_proj", "down_proj"), router="mlp.gate",
        targets=["q_proj", "gate_proj", "up_proj", "down_proj", "gate"],
    ),
    "olmoe": dict(
        expert="mlp.experts.{e}.{p}", parts=("gate_proj", "up_proj", "down_proj"), router="mlp.gate",
        targets=["q_proj", "gate_proj", "up_proj", "down_proj", "gate"],
    ),
}  # fmt: skip


def _config(arch: str):
    common = dict(
        vocab_size=67, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(intermediate_size=24, num_local_experts=E, **common)
    if arch == "olmoe":
        from transformers import OlmoeConfig

        return OlmoeConfig(intermediate_size=24, num_experts=E, **{k: v for k, v in common.items() if k != "head_dim"})
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=E, **common)


def _per_expert_adapter(folder, arch: str, state: dict[str, torch.Tensor], seed: int) -> None:
    """A per-expert LoRA as PEFT saved them before transformers 5 fused experts (target_modules on w1/w2/w3 or
    gate/up/down_proj of every expert, plus the router and q_proj), written by hand from the base's shapes."""
    spec, g = ARCHS[arch], torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        modules = [f"{prefix}self_attn.q_proj", f"{prefix}{spec['router']}"]
        modules += [f"{prefix}{spec['expert'].format(e=e, p=p)}" for e in range(E) for p in spec["parts"]]
        for m in modules:
            out, inp = state[f"{m}.weight"].shape
            tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(R, inp, generator=g) * 0.3
            tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(out, R, generator=g) * 0.3
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = dict(peft_type="LORA", r=R, lora_alpha=ALPHA, target_modules=spec["targets"], task_type="CAUSAL_LM")
    (folder / "adapter_config.json").write_text(json.dumps(config))


def _parameter_adapter(folder, base, seed: int) -> None:
    """A transformers 5 LoRA: PEFT target_parameters on the fused expert tensors (+ q_proj), trained weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    targets = dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, init_lora_weights=False, **targets))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Per architecture: the base saved both ways and both kinds of adapter."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    for i, arch in enumerate(ARCHS):
        torch.manual_seed(10 + i)
        model = AutoModelForCausalLM.from_config(_config(arch))
        with torch.no_grad():  # routers and experts far from their init, so every expert gets tokens
            for name, p in model.named_parameters():
                if "gate" in name or "experts" in name:
                    p.normal_(0, 0.5)
        model.save_pretrained(root / arch / "per_expert")
        model.save_pretrained(root / arch / "fused", save_original_format=False)
        state = load_file(root / arch / "per_expert/model.safetensors")
        _per_expert_adapter(root / arch / "lora_per_expert", arch, state, 20 + i)
        _parameter_adapter(root / arch / "lora_parameters", root / arch / "fused", 30 + i)
    return root


IDS = torch.randint(3, 67, (3, 12), generator=torch.Generator().manual_seed(0))


def _merge(moe, cli, tmp_path, arch, layout, kind, *extra, verify=False):
    out = tmp_path / f"{arch}-{layout}-{kind}"
    run = cli(
        "merge", "--base", moe / arch / layout, "--adapter", moe / arch / f"lora_{kind}", "--out", out, *extra,
        verify=verify,
    )  # fmt: skip
    assert run[0] == 0, run[2]
    return out, run


@pytest.mark.parametrize("kind", ["per_expert", "parameters"])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_moe_adapter_matches_peft_forward(moe, cli, tmp_path, arch, layout, kind):
    out, _ = _merge(moe, cli, tmp_path, arch, layout, kind)
    base, written = read_tensors(moe / arch / layout), read_tensors(out)
    assert set(written) == set(base)  # the base's own layout is kept
    assert all(written[k].shape == base[k].shape for k in base)
    experts = [k for k in base if "experts" in k]
    assert experts and all(not torch.equal(written[k], base[k]) for k in experts)  # every expert tensor changed
    peft = logits(reference_model(moe / arch / layout, [moe / arch / f"lora_{kind}"]), IDS)
    merged, bare = logits(load_merged(out), IDS), logits(load_merged(moe / arch / layout), IDS)
    torch.testing.assert_close(merged, peft, atol=1e-5, rtol=1e-5)
    assert (bare - peft).abs().max() > 100 * (merged - peft).abs().max()


def _rank_major(a, b, experts):
    """Unsloth's misreading: A's rows taken rank-major (all experts' first rank row, then the second ...)."""
    r = a.shape[0] // experts
    return b.reshape(b.shape[0], r, experts).permute(2, 0, 1), a.reshape(r, experts, a.shape[1]).transpose(0, 1)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_rank_major_misreading_fails_the_oracle(moe, cli, tmp_path, monkeypatch, layout):
    from converter.formats import patches

    monkeypatch.setattr(patches, "expert_factors", _rank_major)
    out, _ = _merge(moe, cli, tmp_path, "qwen3_moe", layout, "parameters")
    peft = logits(reference_model(moe / "qwen3_moe" / layout, [moe / "qwen3_moe/lora_parameters"]), IDS)
    assert not torch.allclose(logits(load_merged(out), IDS), peft, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", ["per_expert", "parameters"])
def test_moe_merges_are_verified_and_sabotage_fails(moe, cli, tmp_path, kind):
    """`converter verify` proves these merges (the card says Passed); one expert's delta dropped, or two experts'
    deltas swapped, fails it (exit 3)."""
    out, run = _merge(moe, cli, tmp_path, "mixtral", "fused", kind, verify=True)
    assert_proven(run)
    base = read_tensors(moe / "mixtral/fused")
    for sabotage in ("dropped", "swapped"):
        tensors = read_tensors(out)
        key = "model.layers.0.mlp.experts.gate_up_proj"
        delta = tensors[key] - base[key]
        if sabotage == "dropped":  # expert 1 left as the base had it
            tensors[key] = base[key].clone()
            tensors[key][[0, 2, 3]] += delta[[0, 2, 3]]
        else:
            tensors[key] = base[key] + delta[[1, 0, 2, 3]]
        bad = tmp_path / f"bad-{kind}-{sabotage}"
        bad.mkdir()
        for f in out.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                (bad / f.name).write_bytes(f.read_bytes())
        save_file({k: v.contiguous() for k, v in tensors.items()}, bad / "model.safetensors", {"format": "pt"})
        code, report, err = cli("verify", bad)
        assert code == 3, (sabotage, report, err)


def test_an_adapter_for_another_expert_count_is_a_one_line_error(moe, cli, tmp_path):
    """LoRAs trained on 4 experts onto a base with 8: A (r·4, in) fits no fused tensor, the router's B has 4 rows;
    one line naming the tensor, nothing written."""
    from transformers import AutoModelForCausalLM

    config = _config("qwen3_moe")
    config.num_experts = 8
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "eight")
    for kind, message in (("parameters", "expert count"), ("per_expert", "mlp.gate.weight has shape [8, 32]")):
        code, _, err = cli("merge", "--base", tmp_path / "eight", "--adapter", moe / f"qwen3_moe/lora_{kind}",
                           "--out", tmp_path / "m")  # fmt: skip
        assert code == 2 and message in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "m").exists()


def test_expert_rules_are_checked_as_data():
    import yaml

    from converter.engine.keymap import load_keymap
    from converter.engine.keymap_schema import KeymapError

    rule = {"fused": "{layer}.e.gate_up", "split": ["{layer}.e.{expert}.w"]}
    good = {"name": "x", "model_types": [], "experts": [rule]}
    assert load_keymap("keymaps/x.yaml", yaml.safe_dump(good)).experts[0].split == ["{layer}.e.{expert}.w"]
    bad = {**good, "experts": [{"fused": "{layer}.e.gate_up", "split": ["{layer}.e.{exprt}.w"]}]}
    with pytest.raises(KeymapError, match=r"experts\[0\]\.split\[0\]: expected a template naming \{layer\}"):
        load_keymap("keymaps/x.yaml", yaml.safe_dump(bad))
    with pytest.raises(KeymapError, match=r"spellings\[0\]\[0\]: not a valid regular expression"):
        load_keymap("keymaps/x.yaml", yaml.safe_dump({**good, "spellings": [["(", "x"]]}))


def test_qwen2_moe_shared_experts_the_peft_reference_cannot_apply_is_proven_by_its_tensors(tmp_path, cli):
    """Qwen2-MoE's shared expert has the experts' leaf names (`shared_expert.gate_proj`): PEFT 0.21 wraps it and
    drops the per-expert LoRAs, so its reference is not the adapter. The tensors are proven by the published formula
    and the behaviour is not compared (said, never a failed right merge); either layout gives the same model."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(
        vocab_size=67, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_experts=E, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "per_expert")
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    state, g = load_file(tmp_path / "per_expert/model.safetensors"), torch.Generator().manual_seed(4)
    tensors = {}
    for key, w in state.items():
        if re.search(r"mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj\.weight$", key):
            m = key.removesuffix(".weight")
            tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(R, w.shape[1], generator=g) * 0.3
            tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(w.shape[0], R, generator=g) * 0.3
    (tmp_path / "lora").mkdir()
    save_file(tensors, tmp_path / "lora/adapter_model.safetensors")
    targets = ["gate_proj", "up_proj", "down_proj"]
    (tmp_path / "lora/adapter_config.json").write_text(
        json.dumps(dict(peft_type="LORA", r=R, lora_alpha=ALPHA, target_modules=targets, task_type="CAUSAL_LM"))
    )
    outs = []
    for layout in ("per_expert", "fused"):
        code, out, err = cli("merge", "--base", tmp_path / layout, "--adapter", tmp_path / "lora", "--out",
                             tmp_path / f"m-{layout}", verify=layout == "fused")  # fmt: skip
        assert code == 0, err
        outs.append(logits(load_merged(tmp_path / f"m-{layout}"), IDS))
    # tensors proven by the published formula (expert slices placed by the keymap); PEFT's forward is no reference
    assert "**Passed** (one proof)" in out and "PEFT does not apply lora as trained: it ignores" in out
    assert "referee: published formula" in out
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outs[0], logits(load_merged(tmp_path / "per_expert"), IDS), atol=1e-3)


def test_rslora_per_expert_lora_that_peft_rescales_is_proven_by_its_tensors(moe, cli, tmp_path):
    """With use_rslora, PEFT's fusion of per-expert gate/up LoRAs (rank and alpha doubled) scales them by sqrt(2),
    so its forward is no reference: the tensors alone prove the merge, never a failed right merge. A
    target_parameters LoRA with rsLoRA, which PEFT takes as saved, is verified both ways."""
    import shutil

    outs = []
    for kind in ("per_expert", "parameters"):
        shutil.copytree(moe / f"mixtral/lora_{kind}", tmp_path / f"rs_{kind}")
        config = json.loads((tmp_path / f"rs_{kind}/adapter_config.json").read_text())
        (tmp_path / f"rs_{kind}/adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    for layout in ("per_expert", "fused"):
        code, out, err = cli("merge", "--base", moe / "mixtral" / layout, "--adapter", tmp_path / "rs_per_expert",
                             "--out", tmp_path / f"m-{layout}", verify=layout == "fused")  # fmt: skip
        assert code == 0, err
        outs.append(logits(load_merged(tmp_path / f"m-{layout}"), IDS))
    assert "**Passed** (one proof)" in out and "under use_rslora scales them by sqrt(2)" in out
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert_proven(cli("merge", "--base", moe / "mixtral/fused", "--adapter", tmp_path / "rs_parameters",
                      "--out", tmp_path / "m-parameters", verify=True))  # fmt: skip
