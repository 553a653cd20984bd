"""`converter inspect` for models and adapters, and `converter demo` (what `make run` runs)."""

from __future__ import annotations

import json

import torch
from model_helpers import make_adapter, make_base


def test_inspect_adapter(tmp_path, cli):
    base = make_base(tmp_path / "base", "qwen2")
    adapter = make_adapter(
        base,
        tmp_path / "lora",
        r=4,
        lora_alpha=16,
        use_dora=True,
        use_rslora=True,
        target_modules=["q_proj", "v_proj"],
        rank_pattern={"v_proj": 2},
    )
    code, out, err = cli("inspect", adapter, "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    assert info["kind"] == "adapter" and info["format"] == "peft" and info["peft_type"] == "LORA"
    assert info["ranks"] == [2, 4] and info["lora_alpha"] == 16 and info["use_dora"] and info["use_rslora"]
    assert info["module_names"] == ["q_proj", "v_proj"] and info["modules"] == 4
    assert info["base_model"] == str(base) and info["patches"] == {"DoRA": 4}
    code, text, _ = cli("inspect", adapter)
    assert code == 0 and "peft_type: LORA" in text and "DoRA: 4" in text


def test_inspect_model(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama", dtype=torch.bfloat16)
    code, out, err = cli("inspect", base, "--json")
    assert code == 0, err
    info = json.loads(out)["details"]
    from safetensors.torch import load_file

    tensors = load_file(base / "model.safetensors")
    assert info["architecture"] == "LlamaForCausalLM" and info["keymap"] == "generic"
    assert info["parameters"] == sum(t.numel() for t in tensors.values())
    assert info["tensor_dtypes"] == {"BF16": info["parameters"]} and info["shards"] == ["model.safetensors"]


def test_demo_runs_offline(tmp_path, capsys):
    from converter.jobs.demo import run_demo

    run_demo(str(tmp_path / "demo"))
    out = capsys.readouterr().out
    assert "**Passed**" in out and "merged model:" in out
    assert (tmp_path / "demo" / "merged" / "model.safetensors").is_file()
    assert (tmp_path / "demo" / "merged" / "README.md").is_file()
