"""GGUF out for diffusion models: a merged single file written as the GGUF files ComfyUI-GGUF and diffusers read.

Oracles: gguf's reference quantizers (the bytes of each tensor), diffusers' GGUF loader (`from_single_file(...,
quantization_config=GGUFQuantizationConfig(...))`, run under the tiny model's own config, not the proof's), and
ComfyUI-GGUF's conventions as its loader reads them (architecture name, `comfy.gguf.orig_shape` as an INT32 array,
the tensors kept F32). A sabotaged tensor must fail the proof, naming it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from converter.errors import BadInputError, UsageError, VerificationFailed
from converter.gguf import diffusion, diffusion_arch, diffusion_export, diffusion_proof, diffusion_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from family_cases import CASES, keymap, make_bases, make_lora, original_layout, tiny, write_spelling  # noqa: E402

# wide enough that Q8_0 applies (tensors of more than 1024 values, rows a multiple of 32)
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
           text_dim=64, freq_dim=64, ffn_dim=128, num_layers=2)  # fmt: skip
TYPES = ["F16", "BF16", "Q8_0"]


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A tiny bf16 Wan as its original single file, and a kohya LoRA on its attention and feed-forward layers."""
    root = tmp_path_factory.mktemp("wan")
    case = dataclasses.replace(CASES["wan"], config=WAN)
    model = tiny(case).to(torch.bfloat16)
    folder, single = make_bases(case, model, root)
    lora = write_spelling(make_lora(case, model), "kohya/original", root)
    return folder, single, lora


@pytest.fixture(scope="module")
def merged(wan, tmp_path_factory):
    """`merge --gguf F16,BF16,Q8_0` of the LoRA into the single file: the merged folder and its GGUF folder."""
    from model_helpers import run_cli

    _, single, lora = wan
    out = tmp_path_factory.mktemp("merged") / "wan-merged"
    assert run_cli("merge", "--base", single, "--adapter", lora, "--out", out, "--no-verify", "--gguf",
                   ",".join(TYPES)) == 0  # fmt: skip
    return out, out.with_name("wan-merged-GGUF")


def diffusers_output(path: Path, config_folder: Path, is_gguf: bool) -> torch.Tensor:
    """diffusers' own reading of a file under the tiny model's real config, on seeded inputs."""
    from diffusers import GGUFQuantizationConfig, WanTransformer3DModel

    kwargs = {"quantization_config": GGUFQuantizationConfig(compute_dtype=torch.float32)} if is_gguf else \
        {"torch_dtype": torch.float32}  # fmt: skip
    model = WanTransformer3DModel.from_single_file(str(path), config=str(config_folder), **kwargs)
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(1, 4, 2, 4, 4, generator=g), torch.randn(1, 6, 64, generator=g)
    with torch.no_grad():
        return model(x, torch.tensor([300.0]), text, return_dict=False)[0]


def test_merge_gguf_writes_files_diffusers_runs_like_the_merged_file(wan, merged):
    folder, single, _ = wan
    out, gguf_dir = merged
    merged_file = out / single.name
    files = {t: gguf_dir / f"wan-merged-{t}.gguf" for t in TYPES}
    assert all(p.is_file() for p in files.values())
    proof = json.loads((gguf_dir / "gguf-proof.json").read_text())
    assert proof["architecture"] == "wan" and all(f["passed"] for f in proof["files"])
    assert [p["name"] for p in proof["files"][2]["parts"]] == ["metadata", "tensors", "behaviour"]
    assert all(p["judged"] for f in proof["files"] for p in f["parts"])
    want = diffusers_output(merged_file, folder / "transformer", is_gguf=False)
    base = diffusers_output(single, folder / "transformer", is_gguf=False)
    for t, limit in {"F16": 1e-6, "BF16": 1e-6, "Q8_0": 1e-2}.items():  # a bf16 source: F16 and BF16 hold it
        got = diffusers_output(files[t], folder / "transformer", is_gguf=True)
        rel = float((got - want).norm() / want.norm())
        assert rel <= limit, (t, rel)
        assert float((got - base).norm() / base.norm()) > 10 * max(rel, 1e-3)  # the merge's, not the base's


def test_tensors_are_stored_as_comfyui_gguf_stores_them(wan, merged):
    """Same names as the single file (prefix removed); the modulation parameters, 1-D and small tensors F32, the
    5-D patch embedding F32 (what ComfyUI-GGUF's fix step puts back), the rest Q8_0 with gguf's own bytes."""
    _, single, _ = wan
    out, gguf_dir = merged
    source = load_file(out / single.name)
    reader = gguf.GGUFReader(gguf_dir / "wan-merged-Q8_0.gguf")
    assert reader.get_field("general.architecture").contents() == "wan"
    found = {t.name: t for t in reader.tensors}
    assert set(found) == {k.removeprefix("model.diffusion_model.") for k in source}
    kinds = {n: t.tensor_type.name for n, t in found.items()}
    assert kinds["blocks.0.modulation"] == kinds["head.modulation"] == "F32"
    assert kinds["patch_embedding.weight"] == "F32" and len(found["patch_embedding.weight"].shape) == 5
    assert kinds["blocks.0.norm3.weight"] == "F32"  # 1-D
    name = "blocks.1.ffn.0.weight"
    assert kinds[name] == "Q8_0"
    want = gguf.quants.quantize(source[f"model.diffusion_model.{name}"].float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(np.asarray(found[name].data).view(np.uint8).ravel(), want.view(np.uint8).ravel())


def _negate(path: Path, name: str) -> None:
    """One tensor of an F16 file negated in place."""
    reader = gguf.GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == name)
    t.data[...] = -t.data
    reader.data.flush()


def test_a_sabotaged_tensor_fails_both_the_tensors_and_the_behaviour_proof(wan, merged, tmp_path):
    _, single, _ = wan
    out, gguf_dir = merged
    bad = tmp_path / "bad-F16.gguf"
    bad.write_bytes((gguf_dir / "wan-merged-F16.gguf").read_bytes())
    name = "blocks.0.self_attn.q.weight"
    _negate(bad, name)
    src = diffusion.open_source(out / single.name)
    ref = diffusion_proof.Reference(src)
    try:
        fp = diffusion_proof.prove(bad, src, "F16", ref)
        assert not fp.passed and fp.parts[-1].name == "tensors" and name in fp.parts[-1].detail
        behaviour = diffusion_proof.prove_behaviour(bad, ref, "F16")  # the runtime alone also sees it
        assert not behaviour.passed and behaviour.judged, behaviour.detail
        assert diffusion_proof.prove_behaviour(gguf_dir / "wan-merged-F16.gguf", ref, "F16").passed
    finally:
        ref.close()


def test_a_denoiser_too_large_for_memory_is_not_run_and_says_so(wan, merged, tmp_path, monkeypatch):
    """diffusers holds the denoiser in float32 beside its source tensors: where that does not fit, the behaviour
    part is not judged, naming both sizes, instead of the run ending the job; the tensors part still decides."""
    from converter.io import memory

    out, _ = merged
    _, single, _ = wan
    src = diffusion.open_source(out / single.name)
    elements = sum(int(np.prod(s)) for s in src.shapes.values())
    monkeypatch.setattr(memory, "available_memory", lambda: 4 * elements)  # the float32 model alone
    result = diffusion_export.export(out / single.name, ["Q8_0"], tmp_path / "out", log=lambda _: None)
    fp = result.proofs[0]
    behaviour = fp.parts[-1]
    assert fp.passed and [p.name for p in fp.parts] == ["metadata", "tensors", "behaviour"]
    assert not behaviour.judged and "GiB of memory" in behaviour.detail and "tensors part" in behaviour.detail
    monkeypatch.setattr(memory, "available_memory", lambda: 8 * elements)  # source and model fit: it runs
    assert diffusion_export.export(out / single.name, ["Q8_0"], tmp_path / "again").proofs[0].parts[-1].judged


def test_a_failed_proof_leaves_no_file(wan, tmp_path, monkeypatch):
    _, single, _ = wan
    real = diffusion.encode
    monkeypatch.setattr(diffusion, "encode", lambda data, p: real(data * 1.01 if p.name == "head.head.weight"
                                                                  else data, p))  # fmt: skip
    with pytest.raises(VerificationFailed, match="head.head.weight"):
        diffusion_export.export(single, ["Q8_0"], tmp_path / "out")
    assert not any(p.suffix == ".gguf" for p in (tmp_path / "out").rglob("*"))


def _sd1_file(path: Path) -> Path:
    """A made-up SD1 UNet checkpoint (ldm keys, with a VAE key a full checkpoint has): enough for the rules."""
    g = torch.Generator().manual_seed(0)
    sd = {f"model.diffusion_model.{k}": torch.randn(*s, generator=g) for k, s in {
        "input_blocks.0.0.weight": (320, 4, 3, 3), "input_blocks.0.0.bias": (320,),
        "time_embed.0.weight": (1280, 320), "time_embed.2.weight": (1280, 1280), "out.2.weight": (4, 320, 3, 3),
        "input_blocks.1.1.proj_in.weight": (320, 320, 1, 1)}.items()}  # fmt: skip
    sd["first_stage_model.decoder.conv_in.weight"] = torch.randn(8, 4, 3, 3, generator=g)
    save_file(sd, path)
    return path


def test_unet_tensors_are_reshaped_with_their_original_shape(tmp_path):
    """ComfyUI-GGUF's UNet rule: last dimension no multiple of 256 -> rows of 256, the shape as an INT32 array its
    loader reads back; the VAE's key is left out; the behaviour proof says why it did not run."""
    src_file = _sd1_file(tmp_path / "sd15.safetensors")
    result = diffusion_export.export(src_file, ["Q8_0"], tmp_path / "out")
    reader = gguf.GGUFReader(result.files[0])
    assert reader.get_field("general.architecture").contents() == "sd1"
    found = {t.name: t for t in reader.tensors}
    assert "decoder.conv_in.weight" not in found and len(found) == 6
    field = reader.get_field("comfy.gguf.orig_shape.input_blocks.0.0.weight")
    assert field.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32] and field.contents() == [320, 4, 3, 3]
    assert tuple(reversed(found["input_blocks.0.0.weight"].shape.tolist())) == (320 * 4 * 9 // 256, 256)
    assert reader.get_field("comfy.gguf.orig_shape.time_embed.0.weight").contents() == [1280, 320]
    assert reader.get_field("comfy.gguf.orig_shape.time_embed.2.weight") is None  # rows of 1280: a multiple of 256
    assert found["time_embed.2.weight"].tensor_type.name == "Q8_0"
    back = gguf.quants.dequantize(found["input_blocks.0.0.weight"].data, found["input_blocks.0.0.weight"].tensor_type)
    source = load_file(src_file)["model.diffusion_model.input_blocks.0.0.weight"].numpy()
    assert np.abs(back.reshape(320, 4, 3, 3) - source).max() < 0.02 * np.abs(source).max()
    behaviour = result.proofs[0].parts[-1]
    assert behaviour.name == "behaviour" and not behaviour.judged and "sd1" in behaviour.detail


def test_flux_config_read_from_bfl_shapes_is_the_model_s():
    """The proof's diffusers config for a BFL Flux file, read from its shapes, is the model's own."""
    case = CASES["flux"]
    model = tiny(case)
    shapes = {k: tuple(v.shape) for k, v in original_layout(model.state_dict(), keymap("flux")).items()}
    # (the helper's layout keeps the q/k norms under diffusers' names; BFL's own name for the first)
    shapes["double_blocks.0.img_attn.norm.query_norm.scale"] = shapes["transformer_blocks.0.attn.norm_q.weight"]
    made = diffusion_run._flux1(shapes)
    for key in ("in_channels", "num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
                "joint_attention_dim", "pooled_projection_dim", "guidance_embeds"):  # fmt: skip
        assert made[key] == model.config[key], key
    assert sum(made["axes_dims_rope"]) == model.config["attention_head_dim"]


def test_diffusers_layout_and_k_quants_are_refused_in_one_line(wan, tmp_path, cli):
    folder, single, lora = wan
    with pytest.raises(UsageError, match="diffusers pipeline folder"):
        diffusion_export.export(folder, ["Q8_0"], tmp_path / "a")
    with pytest.raises(UsageError, match="K-quants"):
        diffusion_export.export(single, ["Q4_K_M"], tmp_path / "b")
    code, _, err = cli("merge", "--base", folder, "--adapter", lora, "--out", tmp_path / "m", "--gguf", "Q8_0")
    assert code == 2 and "original single-file layout" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m").exists()
    code, _, err = cli("merge", "--base", single, "--adapter", lora, "--out", tmp_path / "m", "--gguf", "Q6_K")
    assert code == 2 and "K-quants" in err and not (tmp_path / "m").exists()
    flux_diffusers = tmp_path / "flux.safetensors"
    save_file({"transformer_blocks.0.attn.norm_added_k.weight": torch.ones(4)}, flux_diffusers)
    with pytest.raises(BadInputError, match="diffusers' layout"):
        diffusion.open_source(flux_diffusers)


def test_rules_of_stored_types():
    a = {x.name: x for x in diffusion_arch.ARCHES}
    q8 = gguf.GGMLQuantizationType.Q8_0
    assert diffusion_arch.stored_type("x.weight", (64, 64), a["flux"], q8) == q8
    assert diffusion_arch.stored_type("x.weight", (32, 32), a["flux"], q8).name == "F32"  # 1024 values
    assert diffusion_arch.stored_type("x.weight", (64, 48), a["flux"], q8).name == "F16"  # no whole block
    assert diffusion_arch.stored_type("blocks.0.modulation", (1, 6, 5120), a["wan"], q8).name == "F32"
    assert diffusion_arch.stored_type("transformer_blocks.0.scale_shift_table", (6, 2048), a["ltxv"], q8).name == "F32"
    assert diffusion_arch.stored_shape((640, 320, 3, 3), a["flux"]) == (640, 320, 3, 3)  # never for transformers


def test_push_from_a_merged_single_file_publishes_repo_gguf_with_the_comfyui_node(merged, tmp_path):
    import subprocess

    from converter.testing.hub import HubServer, client_env

    out, _ = merged
    token = "hf_fake_alice_gguf_0123456789"
    server = HubServer(tmp_path / "hub").start()
    try:
        server.add_user("alice", token)
        proc = subprocess.run([sys.executable, "-m", "converter", "push", "--repo", "alice/wan", "--from", str(out),
                               "--no-verify", "--gguf", "Q8_0"], capture_output=True, text=True,
                              env=client_env(server, token), timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        files = set(server.files("alice/wan-GGUF")) - {".gitattributes"}
        assert files == {"README.md", "gguf-proof.json", "wan-Q8_0.gguf"}
        readme = server.read_file("alice/wan-GGUF", "README.md").decode()
        assert "base_model: alice/wan\n" in readme and "UnetLoaderGGUF" in readme
        assert "| `wan-Q8_0.gguf` | Q8_0 |" in readme and "WanTransformer3DModel.from_single_file" in readme
    finally:
        server.stop()
