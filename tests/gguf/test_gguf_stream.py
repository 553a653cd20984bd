"""`merge --gguf` writes the GGUF files as the merge streams (converter.gguf.stream).

Oracle: the writer that reads the merged folder back (`converter gguf`'s, itself checked against llama.cpp's own
converter in test_gguf.py): the files written during the merge, whose tensors arrive in the base's order and a MoE
layer's experts one by one, must be the same bytes. A merge that fails part-way leaves no GGUF behind.
"""

from __future__ import annotations

import pytest
from model_helpers import make_adapter
from test_gguf import TINY, needs_llama

from converter.engine.merging import merge
from converter.engine.recipe import AdapterSpec, Recipe
from converter.errors import BadInputError
from converter.gguf import arch, export, fileio, proof, write
from converter.gguf.source import Source
from converter.gguf.stream import GGUFTee

# Mixtral's LoRA on attention, the router and the fused experts
LORA = {"mixtral": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate"],
                    "target_parameters": ["gate_up_proj", "down_proj"]}}  # fmt: skip


# Q/K rows reordered (llama), experts stacked from separate tensors (mixtral), Conv1D transposed and a tied head
# left out (gpt2), norms shifted and a SentencePiece vocabulary (gemma2)
@pytest.mark.parametrize("model_type", ["llama", "mixtral", "gpt2", "gemma2"])
def test_the_files_written_during_the_merge_are_those_written_from_the_merged_folder(model_type, tmp_path, cli):
    base = TINY[model_type](tmp_path / model_type)
    adapter = make_adapter(base, tmp_path / "lora", r=2, **LORA.get(model_type, {}))
    code, out, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m",
                         "--gguf", "F32,Q8_0")  # fmt: skip
    assert code == 0, err
    assert "m-Q8_0.gguf: writing as the merge streams" in out and "m-Q8_0.gguf: writing\n" not in out
    src = export.open_source(tmp_path / "m")
    family = arch.family_of(src.config, tmp_path / "m")
    for type_name in ("F32", "Q8_0"):
        again = write.write_gguf(src, family, type_name, tmp_path / f"again-{type_name}.gguf", name="m")
        assert again, type_name
        streamed = (tmp_path / "m-GGUF" / f"m-{type_name}.gguf").read_bytes()
        assert streamed == (tmp_path / f"again-{type_name}.gguf").read_bytes(), type_name


def test_a_bf16_merge_streams_the_files_written_from_its_folder(tmp_path, cli):
    """The usual case, a bf16 model: the tee widens the merge's bf16 chunks itself (GGUFTee._float32), one chunk at a
    time; the files must be those written from the merged folder, which source.decode reads."""
    import torch
    from test_gguf import tiny

    base = tiny(tmp_path / "llama", "llama", dtype=torch.bfloat16)
    adapter = make_adapter(base, tmp_path / "lora", r=2)
    code, _, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", "--no-verify",
                       "--gguf", "F32,Q8_0")  # fmt: skip
    assert code == 0, err
    src = export.open_source(tmp_path / "m")
    assert {e.dtype for e in src.tensors.values()} == {"BF16"}
    family = arch.family_of(src.config, tmp_path / "m")
    for type_name in ("F32", "Q8_0"):
        write.write_gguf(src, family, type_name, tmp_path / f"again-{type_name}.gguf", name="m")
        streamed = (tmp_path / "m-GGUF" / f"m-{type_name}.gguf").read_bytes()
        assert streamed == (tmp_path / f"again-{type_name}.gguf").read_bytes(), type_name


def test_a_merge_that_fails_while_streaming_leaves_no_gguf_behind(tmp_path, monkeypatch):
    base = TINY["llama"](tmp_path / "llama")
    adapter = make_adapter(base, tmp_path / "lora", r=2)
    real, calls = write.GGUFFile.put, []

    def failing(self, hf_name, data):
        calls.append(hf_name)
        if len(calls) == 5:
            raise BadInputError("disk full (simulated)")
        real(self, hf_name, data)

    monkeypatch.setattr(write.GGUFFile, "put", failing)
    tee = GGUFTee(["Q8_0"], tmp_path / "m-GGUF", "m", log=lambda _: None)
    recipe = Recipe(base=str(base), adapters=[AdapterSpec(str(adapter))], out=str(tmp_path / "m"))
    with pytest.raises(BadInputError, match="disk full"):
        try:
            merge(recipe, log=lambda _: None, tee=tee)
            tee.finish()
        finally:
            tee.discard()
    assert len(calls) == 5
    assert not (tmp_path / "m-GGUF").exists() and not (tmp_path / "m").exists()


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_the_tensor_proof_reads_the_file_against_the_writers_digests_not_the_source_again(model_type, tmp_path,
                                                                                         monkeypatch):  # fmt: skip
    """Written once, proven without reading the source again (Q/K rows reordered, experts stacked: every tensor's
    digest is found in Hugging Face order); one changed byte still fails, and is then named from the source."""
    folder = TINY[model_type](tmp_path / model_type)
    src = export.open_source(folder)
    family = arch.family_of(src.config, folder)
    types = ["F32", "BF16", "Q8_0"]
    digests: dict = {}
    write.write_ggufs(src, family, {t: tmp_path / f"m-{t}.gguf" for t in types}, name="m", digests=digests)
    real_read = Source.read

    def no_read(self, name):
        raise AssertionError(f"{name} read again")

    monkeypatch.setattr(Source, "read", no_read)
    for t in types:
        written = write.Written(tmp_path / f"m-{t}.gguf", digests[t])
        assert proof.prove_tensors(fileio.Reader(written.path), src, family, t, written).passed, t
    path = tmp_path / "m-Q8_0.gguf"
    q = next(t for t in fileio.Reader(path).tensors if t.name == "blk.1.attn_q.weight")
    data = bytearray(path.read_bytes())
    data[int(q.data_offset) + 3 * q.data.shape[-1] + 7] ^= 0x40  # row 3: one quant
    path.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="q_proj.weight read again"):
        proof.prove_tensors(fileio.Reader(path), src, family, "Q8_0", written)
    monkeypatch.setattr(Source, "read", real_read)
    part = proof.prove_tensors(fileio.Reader(path), src, family, "Q8_0", written)
    assert not part.passed
    assert part.detail.startswith("blk.1.attn_q.weight (model.layers.1.self_attn.q_proj.weight): 1 values differ")


def test_the_writers_quantization_is_ggufs_reference_byte_for_byte():
    """quantize.stored computes gguf's Q8_0 and BF16 with torch, slice by slice: the bytes must be
    gguf.quants.quantize's on ties of both signs, zero blocks, tiny and subnormal values (whose Q8_0 scales overflow
    their reciprocal: gguf's own code then), NaN and infinities, scales that round in float16, several slices with
    an uneven last one, a 3-D stack and a single row."""
    import gguf
    import numpy as np

    from converter.gguf import quantize

    rng = np.random.default_rng(0)
    big = rng.standard_normal((600, 1024)).astype(np.float32)  # 2.3 slices of quantize.SLICE values
    assert big.size > 2 * quantize.SLICE
    big[3, :32] = 0
    big[5] = (rng.integers(-508, 508, size=1024) / 4).astype(np.float32)  # x.25 / x.5 / x.75: exact ties at scale 1
    big[5, ::32] = 127
    big[6] = -big[5]
    big[7] *= np.float32(1e-30)
    big[8] = rng.standard_normal(1024).astype(np.float32) * np.float32(65504 * 127 * 0.999)  # scales near f16's max
    big[9, :32] = np.float32(2**-140)  # subnormal values (BF16 keeps them)
    cases = {"finite": big, "3-D": rng.standard_normal((3, 70, 96)).astype(np.float32),
             "one row": rng.standard_normal((1, 64)).astype(np.float32)}  # fmt: skip
    for bad, value in (("tiny scale", 1e-38), ("NaN", np.nan), ("infinity", -np.inf)):
        cases[bad] = big.copy()
        cases[bad][300, 32:64] = value
    for what, data in cases.items():
        for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16):
            with np.errstate(all="ignore"):  # gguf's own code on NaN and infinities
                ours, ref = quantize.stored(data, qtype), gguf.quants.quantize(data, qtype)
            assert ours.shape == ref.shape and ours.tobytes() == ref.tobytes(), (what, qtype.name)


@needs_llama
def test_a_verified_merge_hands_its_logits_of_the_merged_model_to_the_behaviour_proof(tmp_path, cli, monkeypatch):
    """The verification has run the merged model in float32 on the behaviour proof's inputs: the GGUF proof takes
    those logits instead of running it again; they are the logits its own forward gives (to float32 summation
    order: the verification packs the inputs into one sequence, the proof pads them), and the file passes on them."""
    import numpy as np
    import torch
    from test_gguf import tiny

    base = tiny(tmp_path / "llama", "llama", dtype=torch.bfloat16)
    adapter = make_adapter(base, tmp_path / "lora", r=2)
    references, forwards = [], []
    real_reference, real_forward = proof.reference, proof._float32_logits
    monkeypatch.setattr(proof, "reference", lambda *a, **k: references.append(real_reference(*a, **k)) or
                        references[-1])  # fmt: skip
    monkeypatch.setattr(proof, "_float32_logits", lambda *a, **k: forwards.append(a) or real_forward(*a, **k))
    code, out, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", "--gguf", "F32",
                         verify=True)  # fmt: skip
    assert code == 0, err
    assert forwards == [] and "behaviour: ok" in out
    (ref,) = references
    own, _ = real_forward(export.open_source(tmp_path / "m"), ref.inputs, 0)
    for shared, mine in zip(ref.logits, own, strict=True):
        assert np.linalg.norm(shared - mine) <= 1e-5 * np.linalg.norm(mine)


def test_the_tees_thread_runs_torch_alone_and_no_other_thread_does():
    """quantize.on_this_thread_alone: one thread for torch's work on the calling thread; the main thread and a
    thread that starts using torch afterwards keep torch's own count (torch.set_num_threads would change theirs)."""
    import threading

    import torch

    from converter.gguf.quantize import on_this_thread_alone

    before, seen = torch.get_num_threads(), {}

    def tee():
        on_this_thread_alone()
        seen["tee"] = torch.get_num_threads()

    def later():
        seen["later"] = torch.get_num_threads()

    for fn in (tee, later):
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join()
    assert seen == {"tee": 1, "later": before} and torch.get_num_threads() == before
