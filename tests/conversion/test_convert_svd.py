"""LoHa / LoKr / full deltas have no exact LoRA form: refused without --rank, approximated by an SVD with it, and
the reported reconstruction error must equal a recomputation from the files (our patch math on both)."""

from __future__ import annotations

import json

import torch
from convert_helpers import deltas
from diffusion_helpers import save, tiny_clip
from safetensors import safe_open

from converter.engine.keymap import flatten

D = 24  # the tiny CLIP's width


def lycoris_file(tmp_path):
    g = torch.Generator().manual_seed(11)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    q, fc1, v = (
        f"lora_te_text_model_encoder_layers_{n}" for n in ("0_self_attn_q_proj", "1_mlp_fc1", "1_self_attn_v_proj")
    )
    return save(
        {
            f"{q}.hada_w1_a": rnd(D, 3), f"{q}.hada_w1_b": rnd(3, D), f"{q}.hada_w2_a": rnd(D, 3),
            f"{q}.hada_w2_b": rnd(3, D), f"{q}.alpha": torch.tensor(2.0),
            f"{fc1}.lokr_w1": rnd(4, 2), f"{fc1}.lokr_w2_a": rnd(12, 2), f"{fc1}.lokr_w2_b": rnd(2, 12),
            f"{fc1}.alpha": torch.tensor(1.0),
            f"{v}.diff": rnd(D, D),
        },
        tmp_path / "lycoris.safetensors",
    )  # fmt: skip


def test_lycoris_needs_rank_then_reports_the_true_svd_error(tmp_path, cli):
    clip = tiny_clip(D)
    clip.save_pretrained(tmp_path / "clip")
    src = lycoris_file(tmp_path)
    code, _, err = cli("convert", "--adapter", src, "--to", "kohya", "--out", tmp_path / "k.safetensors")
    assert code == 2 and "--rank" in err and "LoHa" in err and not (tmp_path / "k.safetensors").exists()

    code, out, err = cli(
        "convert", "--adapter", src, "--to", "kohya", "--out", tmp_path / "k.safetensors", "--rank", "4"
    )
    assert code == 0, err
    assert "3 modules (LoHa/LoKr/full/Tucker) approximated by SVD at rank 4" in out
    with safe_open(tmp_path / "k.safetensors", "pt") as f:
        reported = json.loads(f.metadata()["converter"])["svd_relative_errors"]
        downs = [f.get_tensor(k) for k in f.keys() if k.endswith("lora_down.weight")]  # noqa: SIM118
    assert len(downs) == 3 and all(d.shape[0] == 4 for d in downs)
    original, approx = deltas(src, tmp_path / "clip"), deltas(tmp_path / "k.safetensors", tmp_path / "clip")
    assert original.keys() == approx.keys() and len(original) == 3
    for key, delta in original.items():
        stem = next(n for n in reported if n.endswith(flatten(key[: -len(".weight")])))
        error = float(torch.linalg.norm(delta.double() - approx[key].double()) / torch.linalg.norm(delta.double()))
        assert abs(error - reported[stem]) <= 1e-6 + 1e-4 * error, (key, error, reported[stem])
        # the best rank-4 approximation: the error is what the dropped singular values say (Eckart–Young)
        s = torch.linalg.svdvals(delta.double().flatten(1))
        assert abs(error - float(s[4:].norm() / s.norm())) <= 1e-5
    assert max(reported.values()) > 0.01  # a real approximation (rank 4 of a rank-9+ delta), not a no-op
    printed = float(out.split("max ")[1].split(" ")[0])
    assert abs(printed - max(reported.values())) <= 1e-3 * printed

    args = ("--to", "peft", "--out", tmp_path / "p", "--base", tmp_path / "clip", "--rank", "24")
    code, _, err = cli("convert", "--adapter", src, *args)
    assert code == 0, err  # full rank: exact up to float32 rounding
    for key, delta in deltas(tmp_path / "p", tmp_path / "clip").items():
        torch.testing.assert_close(delta, original[key], atol=1e-5, rtol=1e-4)
