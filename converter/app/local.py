"""`make run`: the Space app on 127.0.0.1 against an embedded local Hub, seeded with a demo base and adapters.

Why: a newcomer with no account and no internet can sign in (Gradio's local login mock), run a whole conversion in
the browser and look at the pushed repo. Gradio's mock asks the Hub `whoami` with HF_TOKEN at start-up and then
hands the app a fixed token (`MOCK_TOKEN`); the local Hub knows it as the demo user's token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from converter.scratch import temp_folder
from converter.testing.hub import HubServer, hub_env

MOCK_TOKEN = "mock-oauth-token-for-local-dev"  # what gradio's local OAuth mock gives every handler
DEMO_USER = "demo"
BASE, LORA, LORA_B, WRONG = "demo/tiny-llama", "demo/tiny-llama-lora", "demo/tiny-llama-lora-b", "demo/wrong-size-lora"
BASE_CARD = """---
license: apache-2.0
language: [en]
pipeline_tag: text-generation
library_name: transformers
---
# Tiny Llama (demo)
A randomly initialised 4-layer Llama built offline for the converter demo.
"""


def _adapter(base_model, folder: Path, seed: int, r: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(base_model, lora).save_pretrained(folder)


def _trained_on(adapter: Path, base: str) -> None:
    """Name the base as a Hub id in adapter_config.json, as an adapter trained on the Hub model would."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base
    (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2))


def seed_demo(server: HubServer, workdir: Path) -> None:
    """Add the demo user and, unless already there, the demo repos (a base, two adapters, one of the wrong size)."""
    server.add_user(DEMO_USER, MOCK_TOKEN)
    if server.exists(BASE):
        return
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from converter.demo import build_demo_inputs

    base_dir, adapter_dir = build_demo_inputs(workdir)
    (base_dir / "README.md").write_text(BASE_CARD)
    _adapter(AutoModelForCausalLM.from_pretrained(base_dir), workdir / "lora-b", seed=5, r=4)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
                                         eos_token_id=2, pad_token_id=0))  # fmt: skip
    _adapter(other, workdir / "wrong", seed=6, r=4)
    _trained_on(adapter_dir, BASE)
    _trained_on(workdir / "lora-b", BASE)
    _trained_on(workdir / "wrong", "demo/smaller-llama")
    server.seed_folder(BASE, base_dir)
    server.seed_folder(LORA, adapter_dir)
    server.seed_folder(LORA_B, workdir / "lora-b")
    server.seed_folder(WRONG, workdir / "wrong")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m converter.app.local", description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="demo-space", help="where the local Hub keeps its repos (default ./demo-space)")
    p.add_argument("--port", type=int, default=7860, help="port of the app on 127.0.0.1 (default 7860)")
    args = p.parse_args(argv)
    root = Path(args.dir).resolve()
    server = HubServer(root / "hub").start()
    # Before huggingface_hub / gradio are imported: they read these at import time.
    os.environ.update(hub_env(server, token=MOCK_TOKEN, home=root / "client-home"))
    os.environ.update(GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(args.port))
    os.environ.setdefault("CONVERTER_APP_WORKDIR", str(root / "jobs"))
    with temp_folder("demo") as tmp:
        print(f"local Hub at {server.url} (repos in {root / 'hub'}); seeding the demo repos ...", flush=True)
        seed_demo(server, Path(tmp))
    print(
        f"demo repos: base {BASE}, adapters {LORA}, {LORA_B} (and {WRONG}, which does not fit the base).\n"
        f"Open http://127.0.0.1:{args.port}, click 'Sign in with Hugging Face' (a local mock: you are '{DEMO_USER}').",
        flush=True,
    )
    sys.path.insert(0, str(Path.cwd()))
    import app

    app.main()


if __name__ == "__main__":
    main()
