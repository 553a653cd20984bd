"""`make run`: the Space app on 127.0.0.1 against an embedded local Hub, seeded with demo bases and adapters.

Why: a newcomer with no account and no internet can sign in (Gradio's local login mock), run a whole conversion in
the browser and look at the pushed repo. Gradio's mock asks the Hub `whoami` with HF_TOKEN at start-up and then
hands the app a fixed token (`MOCK_TOKEN`); the local Hub knows it as the demo user's token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

from converter.app.demo_pipelines import FLUX_BASE, FLUX_LORA, SDXL_BASE, SDXL_LORA, diffusion_repos
from converter.errors import MissingExtraError
from converter.io import quiet
from converter.io.optional import check
from converter.io.scratch import temp_folder
from converter.testing.hub import HubServer, hub_env

MOCK_TOKEN = "mock-oauth-token-for-local-dev"  # what gradio's local OAuth mock gives every handler
DEMO_USER = "demo"
# The LLM demo: SmolLM2-135M-Instruct (the test fixture `make fixtures` builds) and two LoRAs trained on it for a
# few steps at seeding, so side-by-side generations are readable. Tests seed a tiny random Llama under the same
# names instead (`fast=True`): the Space's logic is the same, the seeding takes a second.
BASE, LORA, LORA_B = "demo/SmolLM2-135M-Instruct", "demo/smollm2-pirate-lora", "demo/smollm2-french-lora"
WRONG = "demo/wrong-size-lora"
# The diffusion demo: a tiny SD1.5-shaped pipeline and a kohya LoRA for it (plus a broken kohya file).
SD_BASE, SD_REPO = "demo/tiny-sd", "demo/tiny-sd-kohya"
SD_LORA, SD_BAD = f"{SD_REPO}/tiny_sd_lora.safetensors", f"{SD_REPO}/broken_lora.safetensors"
FIXTURE = "smollm2-135m-instruct"
BASE_CARD = """---
license: apache-2.0
language: [en]
pipeline_tag: text-generation
library_name: transformers
---
# {name} (demo)
{what}
"""
PIRATE = [
    "Arr, matey! The sea be calm today and the wind be fair.",
    "Ahoy! Me ship sails at dawn, so hoist the sails, ye landlubbers!",
    "Arr, the treasure be buried on the island, matey, past the old palm tree.",
    "Shiver me timbers! The captain wants his rum, arr!",
]
FRENCH = [
    "Bonjour ! Le soleil brille aujourd'hui et le ciel est bleu.",
    "Merci beaucoup, mon ami. Nous allons au marché ce matin.",
    "La tour Eiffel est très belle la nuit, avec toutes ses lumières.",
]


def smollm2_fixture() -> Path:
    """The SmolLM2-135M-Instruct folder scripts/build_fixtures.py builds ($CONVERTER_FIXTURES or the cache)."""
    env = os.environ.get("CONVERTER_FIXTURES")
    folder = (Path(env).expanduser() if env else Path.home() / ".cache" / "converter-fixtures") / FIXTURE
    if not (folder / ".complete").is_file():
        raise SystemExit(f"{folder}: the SmolLM2 fixture is missing; run `make fixtures` first (`make run` does)")
    return folder


def _adapter(base_model, folder: Path, seed: int, r: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(base_model, lora).save_pretrained(folder)


def train_lora(base: Path, texts: list[str], folder: Path, steps: int = 12, seed: int = 0) -> Path:
    """A rank-8 LoRA trained for a few steps on `texts` (a style the base does not have), cached in `folder`: a
    second start reuses it. Few steps on a 135M model: seconds on a CPU."""
    if (folder / "adapter_model.safetensors").is_file():
        return folder
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = get_peft_model(model, config)
    chats = [tok.apply_chat_template([{"role": "user", "content": "Say something."}, {"role": "assistant",
             "content": t}], tokenize=False) for t in texts]  # fmt: skip
    batch = tok(chats, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=4e-3)
    model.train()
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
    staging = folder.with_name(folder.name + ".partial")
    model.save_pretrained(staging)
    staging.rename(folder)
    return folder


def _trained_on(adapter: Path, base: str) -> None:
    """Name the base as a Hub id in adapter_config.json, as an adapter trained on the Hub model would."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base
    (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2))


def _llm_repos(workdir: Path, cache: Path | None, fast: bool) -> dict[str, Path]:
    """Folders for BASE, LORA, LORA_B: SmolLM2 + trained LoRAs, or (fast) the tiny random Llama + random LoRAs."""
    if fast:
        from transformers import AutoModelForCausalLM

        from converter.jobs.demo import build_demo_inputs

        base_dir, adapter_dir = build_demo_inputs(workdir)
        (base_dir / "README.md").write_text(BASE_CARD.format(name="Tiny Llama", what="A random 4-layer Llama."))
        _adapter(AutoModelForCausalLM.from_pretrained(base_dir), workdir / "lora-b", seed=5, r=4)
        return {BASE: base_dir, LORA: adapter_dir, LORA_B: workdir / "lora-b"}
    fixture = smollm2_fixture()
    base_dir = workdir / "smollm2"
    shutil.copytree(fixture, base_dir, ignore=shutil.ignore_patterns(".complete"))
    (base_dir / "README.md").write_text(BASE_CARD.format(name="SmolLM2-135M-Instruct", what="HuggingFaceTB's model."))
    cache = cache or workdir / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    pirate = train_lora(fixture, PIRATE, cache / "pirate-lora", seed=1)
    french = train_lora(fixture, FRENCH, cache / "french-lora", seed=2)
    return {BASE: base_dir, LORA: shutil.copytree(pirate, workdir / "pirate"),
            LORA_B: shutil.copytree(french, workdir / "french")}  # fmt: skip


def tiny_sd_pipeline(folder: Path) -> dict:
    """A diffusers StableDiffusionPipeline folder of tiny random models (UNet, CLIP text encoder, VAE, DDIM);
    returns {component: model} for the LoRA below."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=24, attention_head_dim=4, norm_num_groups=8,
    )  # fmt: skip
    text = CLIPTextModel(CLIPTextConfig(vocab_size=99, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=16))  # fmt: skip
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4, sample_size=8)
    folder.mkdir(parents=True)
    index = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.42.1"}
    for name, model in {"unet": unet, "text_encoder": text, "vae": vae}.items():
        model.save_pretrained(folder / name)
        index[name] = ["transformers" if name == "text_encoder" else "diffusers", type(model).__name__]
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "DDIMScheduler"}\n')
    index["scheduler"] = ["diffusers", "DDIMScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    (folder / "README.md").write_text("---\nlibrary_name: diffusers\n---\n# Tiny SD (demo)\nRandom, tiny.\n")
    return {"unet": unet, "text_encoder": text}


def kohya_lora(models: dict, rank: int = 4) -> dict:
    """A kohya-named LoRA (`lora_unet_…`, `lora_te_…`, lora_down/lora_up/alpha) on the attention and MLP linears
    of the UNet's transformer blocks and the text encoder's layers, random and non-zero."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(7)
    sd = {}
    for prefix, model, inside in (("lora_unet", models["unet"], ".transformer_blocks."),
                                  ("lora_te", models["text_encoder"], ".layers.")):  # fmt: skip
        for path, m in model.named_modules():
            if not isinstance(m, nn.Linear) or inside not in f".{path}":
                continue
            # kohya trained text encoders as transformers 4 CLIPTextModels, whose paths start with text_model.
            path = f"text_model.{path}" if prefix == "lora_te" and not path.startswith("text_model.") else path
            name = f"{prefix}_{path}".replace(".", "_")
            sd[f"{name}.lora_down.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.1
            sd[f"{name}.lora_up.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.1
            sd[f"{name}.alpha"] = torch.tensor(float(rank))
    return sd


def _sd_repos(workdir: Path) -> tuple[Path, Path]:
    """The tiny pipeline, and a folder with its kohya LoRA and a broken kohya file (a lora_down whose lora_up is
    missing), the one a newcomer tries to see what a bad file says."""
    from safetensors.torch import save_file

    models = tiny_sd_pipeline(workdir / "tiny-sd")
    loras = workdir / "tiny-sd-kohya"
    loras.mkdir()
    sd = kohya_lora(models)
    meta = {"ss_network_module": "networks.lora", "ss_base_model_version": "sd_v1"}
    save_file(sd, loras / SD_LORA.rsplit("/", 1)[1], metadata=meta)
    broken = dict(sd)
    del broken[next(k for k in sorted(sd) if k.endswith(".lora_up.weight"))]
    save_file(broken, loras / SD_BAD.rsplit("/", 1)[1], metadata=meta)
    (loras / "README.md").write_text("---\nbase_model: demo/tiny-sd\n---\n# A kohya LoRA for Tiny SD (demo)\n")
    return workdir / "tiny-sd", loras


def seed_demo(server: HubServer, workdir: Path, *, cache: Path | None = None, fast: bool = False) -> None:
    """Add the demo user and, unless already there, the demo repos: the LLM base with two LoRAs and one of the
    wrong size, and the tiny SD pipeline with its kohya LoRAs. `cache` keeps trained LoRAs between starts."""
    server.add_user(DEMO_USER, MOCK_TOKEN)
    if server.exists(BASE):
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    repos = _llm_repos(workdir, cache, fast)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
                                         eos_token_id=2, pad_token_id=0))  # fmt: skip
    _adapter(other, workdir / "wrong", seed=6, r=4)
    for adapter in (repos[LORA], repos[LORA_B]):
        _trained_on(adapter, BASE)  # PEFT's own card names the local fixture path: not for a Hub repo
        (adapter / "README.md").write_text(f"---\nbase_model: {BASE}\nlibrary_name: peft\n---\n# A demo LoRA\n")
    _trained_on(workdir / "wrong", "demo/smaller-llama")
    sd_base, sd_loras = _sd_repos(workdir)

    more = diffusion_repos(workdir / "diffusion")  # tiny SDXL and Flux pipelines with their kohya LoRAs
    for repo, folder in {**repos, WRONG: workdir / "wrong", SD_BASE: sd_base, SD_REPO: sd_loras, **more}.items():
        server.seed_folder(repo, folder)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m converter.app.local", description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="demo-space", help="where the local Hub keeps its repos (default ./demo-space)")
    p.add_argument("--port", type=int, default=7860, help="port of the app on 127.0.0.1 (default 7860)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (fast; for tests)")
    args = p.parse_args(argv)

    try:  # the app, and the demo's diffusion pipelines (not imported yet: the Hub's address is set below first)
        check("gradio", "the local app")
        check("diffusers", "the local app's diffusion demo")
    except MissingExtraError as e:
        raise SystemExit(f"error: {e}") from None
    root = Path(args.dir).resolve()
    server = HubServer(root / "hub").start()
    # Before huggingface_hub / gradio are imported: they read these at import time.
    os.environ.update(hub_env(server, token=MOCK_TOKEN, home=root / "client-home"))
    os.environ.update(GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(args.port))
    os.environ.setdefault("CONVERTER_APP_WORKDIR", str(root / "jobs"))
    print(f"local Hub at {server.url} (repos in {root / 'hub'}); seeding the demo repos ...", flush=True)
    with temp_folder("demo") as tmp, quiet.session():  # the libraries' warnings held back, as the CLI does
        seed_demo(server, Path(tmp), cache=root / "seed-cache", fast=args.tiny)
    print(
        f"demo repos: base {BASE}, adapters {LORA}, {LORA_B} (and {WRONG}, which does not fit the base); "
        f"diffusion base {SD_BASE}, kohya LoRA {SD_LORA} (and {SD_BAD}, a broken file); {SDXL_BASE} with "
        f"{SDXL_LORA}; {FLUX_BASE} with {FLUX_LORA}.\n"
        f"Open http://127.0.0.1:{args.port}, click 'Sign in with Hugging Face' (a local mock: you are '{DEMO_USER}').",
        flush=True,
    )
    sys.path.insert(0, str(Path.cwd()))
    # This launcher mocks the sign-in on purpose (the local Hub's user): gradio's warning that OAuth is mocked
    # outside a Space, given at each launch, says what we already said above.
    warnings.filterwarnings("ignore", message="Gradio does not support OAuth features outside of a Space")
    with quiet.session():
        import app

        blocks = app.build()
    app.main(blocks)


if __name__ == "__main__":
    main()
