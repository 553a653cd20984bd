"""`converter convert` proves its output: ΔW read back equals the source's, a wrong write fails with exit 3 and
leaves nothing; what it writes (a multi-component PEFT folder) it reads back, for convert and merge."""

from __future__ import annotations

import pytest
import torch
from diffusion_helpers import TE_TARGETS, UNET_TARGETS, kohya_lora, kohya_modules, make_pipeline, read_component, save
from safetensors import safe_open
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    root = tmp_path_factory.mktemp("proof")
    models = make_pipeline(root / "base", "sd15")
    mods = kohya_modules(models["unet"], "lora_unet", UNET_TARGETS, convs=True)
    mods.update(kohya_modules(models["text_encoder"], "lora_te", TE_TARGETS))
    save(kohya_lora(mods, rank=4, conv_rank=2), root / "lora.safetensors")  # alphas differ per module
    return root


def test_kohya_to_multi_component_peft_and_back_to_the_same_kohya_file(sd15, tmp_path, cli):
    src = sd15 / "lora.safetensors"
    code, out, err = cli("convert", "--adapter", src, "--to", "peft", "--out", tmp_path / "p", "--base", sd15 / "base")
    assert code == 0, err
    n = len([k for k in load_file(src) if k.endswith(".lora_down.weight")])
    assert f"ΔW identical on {n} modules" in out
    assert {p.name for p in (tmp_path / "p").iterdir()} == {"unet", "text_encoder"}
    code, out, err = cli("convert", "--adapter", tmp_path / "p", "--to", "kohya", "--out", tmp_path / "k.safetensors")
    assert code == 0, err
    assert f"ΔW identical on {n} modules" in out
    original, back = load_file(src), load_file(tmp_path / "k.safetensors")
    assert set(original) == set(back)
    for k, v in original.items():
        assert torch.equal(v.float(), back[k].float()), k


def test_multi_component_peft_folder_merges_like_the_kohya_file(sd15, tmp_path, cli):
    code, _, err = cli("convert", "--adapter", sd15 / "lora.safetensors", "--to", "peft", "--out", tmp_path / "p",
                       "--base", sd15 / "base")  # fmt: skip
    assert code == 0, err
    for adapter, out in ((sd15 / "lora.safetensors", "a"), (tmp_path / "p", "b")):
        code, _, err = cli("merge", "--base", sd15 / "base", "--adapter", adapter, "--out", tmp_path / out)
        assert code == 0, err
    changed = 0
    for component in ("unet", "text_encoder"):
        a, b = read_component(tmp_path / "a", component), read_component(tmp_path / "b", component)
        before = read_component(sd15 / "base", component)
        assert set(a) == set(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
            changed += not torch.equal(a[k], before[k])
    assert changed > 0


def corrupting_write(monkeypatch):
    """The real writer, then one lora_up tensor of the output scaled by 1.5 (a writer bug)."""
    import converter.conversion.core as core

    real = core.write

    def write(modules, to, out, **kw):
        files = real(modules, to, out, **kw)
        f = out if out.suffix == ".safetensors" else next(out.rglob("*.safetensors"))
        with safe_open(f, "pt") as fh:
            metadata = fh.metadata()  # diffusers keeps its per-module alphas there
        tensors = load_file(f)
        name = sorted(k for k in tensors if "proj_in" in k and k.endswith(("lora_up.weight", "lora_B.weight")))[0]
        tensors[name] = tensors[name] * 1.5
        save_file(tensors, f, metadata=metadata)
        return files

    monkeypatch.setattr(core, "write", write)


@pytest.mark.parametrize("to, out", [("kohya", "k.safetensors"), ("diffusers", "d")])
def test_a_wrong_output_fails_with_exit_3_names_the_module_and_is_removed(sd15, tmp_path, cli, monkeypatch, to, out):
    corrupting_write(monkeypatch)
    code, stdout, err = cli("convert", "--adapter", sd15 / "lora.safetensors", "--to", to, "--out", tmp_path / out,
                            "--base", sd15 / "base")  # fmt: skip
    assert code == 3, stdout + err
    assert "proj_in" in err and "ΔW differs" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / out).exists() and "ΔW identical" not in stdout


def test_no_verify_skips_the_check(sd15, tmp_path, cli, monkeypatch):
    corrupting_write(monkeypatch)
    code, stdout, err = cli("convert", "--adapter", sd15 / "lora.safetensors", "--to", "kohya", "--out",
                            tmp_path / "k.safetensors", "--no-verify")  # fmt: skip
    assert code == 0 and (tmp_path / "k.safetensors").is_file(), err
    assert "ΔW" not in stdout
