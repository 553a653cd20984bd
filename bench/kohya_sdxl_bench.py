"""Benchmark: a kohya SDXL LoRA merged into an SDXL-layout UNet, `converter merge` vs diffusers.

Why: community LoRAs (kohya sd-scripts naming) are mostly merged today with diffusers' `load_lora_weights` +
`fuse_lora` + `save_pretrained`. This measures wall time and peak memory of both, side by side in one run, on a
synthetic UNet with SDXL's real block layout (3 levels, transformer depths 1/2/10, linear projections, text_time
embedding) at half SDXL's width (643 M parameters, fp16), and checks that both give the same weights.

    python bench/kohya_sdxl_bench.py [--workdir DIR] [--small] [--no-record]

Runs, each in its own subprocess under GNU time (peak RSS of that process):
  (a) converter into the SGM/LDM single file (model.diffusion_model.*), the layout kohya trains on
  (b) converter into the diffusers folder (unet/diffusion_pytorch_model.safetensors)
  (c) diffusers: UNet2DConditionModel.from_pretrained + StableDiffusionXLLoraLoaderMixin.lora_state_dict +
      load_lora_into_unet + fuse_lora + unload_lora + save_pretrained (what pipe.load_lora_weights/fuse_lora/
      save_pretrained do for the UNet)
  (d) (b) with its default verification: diffusers' unmerged loader as the referee, the UNet run at 3 timesteps
      (base folder holds the UNet only, so no images)
  (e) (a) with its default verification, offline: diffusers' from_single_file cannot fetch its config, so the
      published formula in float64 referees every touched tensor (and checks the untouched ones are the base's)
Results are appended to bench/RESULTS.md (not with --small). Inputs are built once and cached in the workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT))

WIDTH = {"full": (160, 320, 640), "small": (32, 64, 128)}
HEADS = {"full": (5, 10, 20), "small": (1, 2, 4)}
RANK, ALPHA = 16, 8.0

DIFFUSERS_SCRIPT = textwrap.dedent(
    """
    import sys, time
    t0 = time.perf_counter()
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.lora_pipeline import StableDiffusionXLLoraLoaderMixin as L
    t1 = time.perf_counter()
    base, lora, out = sys.argv[1:4]
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", torch_dtype=torch.float16)
    t2 = time.perf_counter()
    sd, alphas = L.lora_state_dict(lora, unet_config=unet.config)
    L.load_lora_into_unet(sd, alphas, unet)
    t3 = time.perf_counter()
    unet.fuse_lora()
    unet.unload_lora()
    t4 = time.perf_counter()
    unet.save_pretrained(out)
    t5 = time.perf_counter()
    print(f"phases: import {t1-t0:.1f}s, load base {t2-t1:.1f}s, load lora {t3-t2:.1f}s, fuse {t4-t3:.1f}s, "
          f"save {t5-t4:.1f}s", flush=True)
    """
)


def unet_config(size: str) -> dict:
    """SDXL's UNet layout (diffusers config of stabilityai/stable-diffusion-xl-base-1.0) at a reduced width."""
    width, heads = WIDTH[size], HEADS[size]
    return dict(
        sample_size=128, in_channels=4, out_channels=4, block_out_channels=width, layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), cross_attention_dim=1024 if size == "full" else 64,
        attention_head_dim=heads, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=256 if size == "full" else 8,
        projection_class_embeddings_input_dim=(640 + 6 * 256) if size == "full" else (32 + 6 * 8),
        norm_num_groups=32 if size == "full" else 8,
    )  # fmt: skip


def build(work: Path, size: str) -> tuple[Path, Path, Path]:
    """Once: random fp16 UNet weights saved as a diffusers folder and as an SGM single file; a kohya LoRA on
    every Transformer2DModel linear with sd-scripts' SDXL naming (lora_unet_<LDM key path>)."""
    folder, single, lora = work / "sdxl-diffusers", work / "sdxl_unet.safetensors", work / "kohya_sdxl_lora.safetensors"
    marker = work / f".complete-{size}"
    if marker.is_file():
        return folder, single, lora
    import torch
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file

    from converter.engine.keymap import DiffusionResolver, all_keymaps

    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    config = unet_config(size)
    with torch.device("meta"):
        model = UNet2DConditionModel(**config)
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(v.shape, generator=g) * 0.02).half() for k, v in model.state_dict().items()}
    (folder / "unet").mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "unet" / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    (folder / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel", **config}))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    # The SGM names of every key, from the sdxl keymap (tests check them against diffusers' own converter).
    km = {k.name: k for k in all_keymaps()}["sdxl"]
    resolver = DiffusionResolver(km, {"unet": ("", {"layers_per_block": 2})}, {k: (1,) for k in state})
    ldm = {}
    for alias, places in resolver.dotted["unet"].items():
        (place,) = places
        if alias != place.key and not re.match(
            r"(down_blocks|mid_block|up_blocks|conv_|time_embedding|add_emb)", alias
        ):
            if ".conv." in alias and alias.startswith("output_blocks") and ".1.conv." in alias:
                block = int(place.key.split(".")[1])
                if any(k.startswith(f"up_blocks.{block}.attentions.") for k in state):
                    continue
            if ".2.conv." in alias and alias.startswith("output_blocks"):
                block = int(place.key.split(".")[1])
                if not any(k.startswith(f"up_blocks.{block}.attentions.") for k in state):
                    continue
            ldm[place.key] = alias
    assert set(ldm) == set(state), set(state) - set(ldm)
    save_file({f"model.diffusion_model.{ldm[k]}": v for k, v in state.items()}, single, metadata={"format": "pt"})
    lora_sd = {}
    for key, shape in ((k, v.shape) for k, v in state.items()):
        if ".attentions." not in key or not key.endswith(".weight") or len(shape) != 2 or "norm" in key:
            continue
        name = "lora_unet_" + ldm[key][: -len(".weight")].replace(".", "_")
        lora_sd[f"{name}.lora_down.weight"] = (torch.randn(RANK, shape[1], generator=g) * 0.05).half()
        lora_sd[f"{name}.lora_up.weight"] = (torch.randn(shape[0], RANK, generator=g) * 0.05).half()
        lora_sd[f"{name}.alpha"] = torch.tensor(ALPHA).half()
    save_file(lora_sd, lora, metadata={"ss_network_module": "networks.lora", "ss_base_model_version": "sdxl_base_v1-0"})
    marker.write_text(size)
    params = sum(v.numel() for v in state.values())
    print(
        f"built {params / 1e6:.0f} M-parameter UNet + {len(lora_sd) // 3}-module LoRA "
        f"in {time.perf_counter() - t0:.0f}s"
    )
    return folder, single, lora


def measure(name: str, cmd: list[str], log: Path, env: dict | None = None) -> dict:
    if os.geteuid() == 0:  # cold page cache for every run, as merge_bench.py does
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    rusage = log.with_suffix(".time")
    t0 = time.perf_counter()
    rc = subprocess.call(
        ["/usr/bin/time", "-v", "-o", str(rusage), *cmd],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    wall = time.perf_counter() - t0
    text = rusage.read_text() if rusage.is_file() else ""
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    result = {"name": name, "rc": rc, "wall_s": wall, "peak_rss_mib": int(rss.group(1)) / 1024 if rss else float("nan")}
    print(f"{name}: rc {rc}, {wall:.1f} s, peak RSS {result['peak_rss_mib']:.0f} MiB", flush=True)
    return result


def compare(ours: Path, theirs: Path) -> tuple[int, int, float]:
    """Tensors compared, bit-identical count, max |difference| (fp16) between two diffusers UNet files."""
    from safetensors import safe_open

    identical, worst, n = 0, 0.0, 0
    with safe_open(ours, "pt") as a, safe_open(theirs, "pt") as b:
        for key in a.keys():  # noqa: SIM118 - safe_open has no __iter__
            x, y = a.get_tensor(key), b.get_tensor(key)
            n += 1
            identical += bool((x == y).all())
            worst = max(worst, float((x.float() - y.float()).abs().max()))
    return n, identical, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=str(BENCH_DIR / "work" / "kohya-sdxl"))
    parser.add_argument("--small", action="store_true", help="tiny widths: a smoke run, nothing recorded")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--no-verify-runs", action="store_true", help="skip (d) and (e), the verification runs")
    args = parser.parse_args()
    size = "small" if args.small else "full"
    work = Path(args.workdir) / size
    folder, single, lora = build(work, size)
    py = sys.executable
    conv = [py, "-m", "converter", "merge", "--adapter", str(lora), "--no-verify", "--force"]
    diffusers = [py, "-c", DIFFUSERS_SCRIPT, str(folder), str(lora), str(work / "out-c")]
    runs = [
        measure(
            "(a) converter, SGM single file",
            [*conv, "--base", str(single), "--out", str(work / "out-a")],
            work / "a.log",
        ),
        measure(
            "(b) converter, diffusers folder",
            [*conv, "--base", str(folder), "--out", str(work / "out-b")],
            work / "b.log",
        ),
        measure("(c) diffusers load_lora + fuse_lora + save", diffusers, work / "c.log"),
    ]
    verified = [] if args.no_verify_runs else [
        measure(
            "(d) = (b) + verification (diffusers' unmerged loader, UNet at 3 timesteps)",
            [*conv[:-2], "--force", "--base", str(folder), "--out", str(work / "out-d")],
            work / "d.log",
        ),
        measure(
            "(e) = (a) + verification (published formula, float64)",
            [*conv[:-2], "--force", "--base", str(single), "--out", str(work / "out-e")],
            work / "e.log",
            env={"HF_HUB_OFFLINE": "1"},
        ),
    ]  # fmt: skip
    runs += verified
    if any(r["rc"] != 0 for r in runs):
        for r, log in zip(runs, "abcde", strict=False):
            if r["rc"]:
                print((work / f"{log}.log").read_text()[-3000:])
        return 1
    n, identical, worst = compare(work / "out-b" / "unet" / "diffusion_pytorch_model.safetensors",
                                  work / "out-c" / "diffusion_pytorch_model.safetensors")  # fmt: skip
    phases = re.search(r"phases: .*", (work / "c.log").read_text())
    a, b, c = runs[:3]
    notes = []
    for r, merged, merge_only in zip(verified, ("out-d", "out-e"), (b, a), strict=True):
        report = json.loads((work / merged / "verification.json").read_text())
        notes.append(
            f"- {r['name'][:3]} verdict **{report['verdict']}** ({report.get('reference', '')}); verification "
            f"{r['wall_s'] - merge_only['wall_s']:.1f} s on top of the {merge_only['wall_s']:.1f} s merge "
            f"({r['wall_s'] / merge_only['wall_s']:.1f}x the merge alone), peak RSS {r['peak_rss_mib']:.0f} MiB; "
            f"its own phases: {report.get('phase_seconds') or report.get('seconds')}"
        )
    lines = [
        f"\n## kohya SDXL LoRA into an SDXL-layout UNet ({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC)\n",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{'page cache dropped before each run' if os.geteuid() == 0 else 'warm page cache'}. "
        f"UNet: SDXL block layout at widths {WIDTH[size]}, fp16, {single.stat().st_size / 2**30:.2f} GiB; "
        f"LoRA: rank {RANK}, alpha {ALPHA}, every attention linear, sd-scripts SDXL (SGM) names. "
        "Command: `python bench/kohya_sdxl_bench.py`.\n",
        "| run | wall s | peak RSS MiB | diffusers / this |",
        "|---|---|---|---|",
        *[
            f"| {r['name']} | {r['wall_s']:.1f} | {r['peak_rss_mib']:.0f} | {c['wall_s'] / r['wall_s']:.2f}x |"
            for r in runs
        ],
        "",
        f"- Same weights: {identical}/{n} tensors of (b) bit-identical to diffusers' fused UNet; max |Δ| {worst:.3g} "
        "(fp16; diffusers fuses in fp16, converter computes in fp32 and rounds once).",
        f"- diffusers {phases.group(0) if phases else ''}",
        f"- Peak memory ratio diffusers / converter: {c['peak_rss_mib'] / a['peak_rss_mib']:.1f}x (single file), "
        f"{c['peak_rss_mib'] / b['peak_rss_mib']:.1f}x (folder).",
        *notes,
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.small and not args.no_record:
        with (BENCH_DIR / "RESULTS.md").open("a") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
