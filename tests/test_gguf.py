"""GGUF out: files written by `converter gguf` / `merge --gguf`, proven, and checked against llama.cpp itself.

Oracles: llama.cpp's own converter (`convert_hf_to_gguf.py` from the llama-cpp-python source distribution, which
`make test` downloads) must write the same keys and the same tensor bytes as we do; llama.cpp (llama-cpp-python)
must load, tokenize and run every file. Sabotaged files (Q/K rows not reordered, a wrong rope base, a wrong
pre-tokenizer, a dropped tensor) must each fail the proof, naming what is wrong, with nothing left in the output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from model_helpers import make_adapter, make_base, run_cli

from converter.errors import BadInputError, MissingExtraError, VerificationFailed
from converter.gguf import arch, export, llama, proof, write

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from build_fixtures import cache_dir, is_complete  # noqa: E402

SMOLLM2 = cache_dir() / "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SDIST = Path(os.environ.get("CONVERTER_LLAMA_SDIST", Path.home() / ".cache" / "converter-llama-sdist"
                            / "llama_cpp_python-0.3.36.tar.gz"))  # fmt: skip
# general.* is descriptive (name, basename, finetune, size label; tags, licence and base models read from README.md)
# except these, which llama.cpp reads: the rest of general.* is compared for these only
GENERAL_READ = {"general.architecture", "general.type", "general.file_type", "general.quantization_version"}
# we always write these as transformers' tokenizer behaves; llama.cpp's converter only when tokenizer_config.json
# says (absent, llama.cpp's loader falls back to a default per tokenizer type)
ADD_FLAGS = {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"}

needs_llama = pytest.mark.skipif(not llama.available(), reason="llama-cpp-python (converter[gguf]) not installed")


def smollm2() -> Path:
    if not is_complete(SMOLLM2):
        pytest.fail(f"SmolLM2 fixture missing at {SMOLLM2}: run `make fixtures` (make test does it first)")
    return SMOLLM2


def tiny(folder: Path, model_type: str, **overrides) -> Path:
    """A tiny model of `model_type` with SmolLM2's tokenizer (so its vocab is a real BPE one llama.cpp knows)."""
    make_base(folder, model_type, vocab_size=49152, **overrides)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2() / name, folder / name)
    return folder


# gguf's reader parses the whole vocabulary when it opens a file (seconds for SmolLM2's 49152 tokens): one reader
# per file, for its keys and its tensors.


def fields(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensor_bytes(reader: gguf.GGUFReader) -> dict[str, tuple[str, tuple, bytes]]:
    return {t.name: (t.tensor_type.name, tuple(t.shape), np.asarray(t.data).tobytes())
            for t in reader.tensors}  # fmt: skip


@pytest.fixture(scope="module")
def llama_converter(tmp_path_factory) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (with its conversion/ and gguf-py/), unpacked from the sdist."""
    if not SDIST.is_file():
        pytest.fail(f"llama-cpp-python's sdist missing at {SDIST}: `make test` downloads it (or set "
                    "CONVERTER_LLAMA_SDIST)")  # fmt: skip
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece (converter[gguf])")
    root = tmp_path_factory.mktemp("llama.cpp")
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(SDIST) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                   and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(wanted)]  # fmt: skip
        tar.extractall(root, members=members, filter="data")
    return next(root.glob("*/vendor/llama.cpp"))


RUN_CONVERTER = """
import runpy, sys
for outtype, out, folder in zip(*[iter(sys.argv[1:])] * 3):
    sys.argv = ["convert_hf_to_gguf.py", "--outtype", outtype, "--outfile", out, folder]
    try:
        runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
"""


def their_ggufs(converter: Path, jobs: list[tuple[str, Path, Path]]) -> None:
    """llama.cpp's converter on each (outtype, out file, model folder), in one process (its imports cost ~15 s)."""
    args = [str(x) for job in jobs for x in job]
    proc = subprocess.run([sys.executable, "-c", RUN_CONVERTER, *args], cwd=converter, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_same_file(ours: Path, theirs: Path) -> None:
    """Key by key (descriptive general.* aside) and tensor by tensor, bytes included."""
    mine, other = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    a, b = fields(mine), fields(other)
    keys = {k for k in set(a) | set(b) if not k.startswith("general.") or k in GENERAL_READ}
    keys = {k for k in keys if not (k in ADD_FLAGS and k not in b)}
    assert {k: a.get(k) for k in keys if a.get(k) != b.get(k)} == {k: b.get(k) for k in keys if a.get(k) != b.get(k)}
    ta, tb = tensor_bytes(mine), tensor_bytes(other)
    assert sorted(ta) == sorted(tb)
    assert [n for n in ta if ta[n] != tb[n]] == []


# The real model: SmolLM2 merged with a LoRA, to every type we write and one K-quant, in one export.


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("smol-gguf")
    adapter = make_adapter(smollm2(), root / "lora", r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "down_proj"])  # fmt: skip
    assert run_cli("merge", "--base", smollm2(), "--adapter", adapter, "--out", root / "merged", "--no-verify") == 0
    return root / "merged"


@pytest.fixture(scope="module")
def exported(merged, tmp_path_factory):
    lines: list[str] = []
    out = tmp_path_factory.mktemp("smol-out") / "gguf"
    types = ["F32", "F16", "BF16", "Q8_0", "Q4_K_M"] if llama.available() else ["F32", "F16", "BF16", "Q8_0"]
    result = export.export(merged, types, out, name="smol-merged", log=lines.append)
    return result, lines


def test_merged_smollm2_to_each_type_is_proven(exported):
    result, lines = exported
    parts = ["metadata", "tensors", "tokenizer", "behaviour"] if llama.available() else ["metadata", "tensors"]
    assert [p.type for p in result.proofs] == [p.name.rsplit("-", 1)[1][:-5] for p in result.files]
    for fp in result.proofs:
        assert fp.passed and [p.name for p in fp.parts] == parts, fp.to_json()
    assert sorted(p.name for p in result.out.iterdir()) == sorted([export.PROOF_FILE, *(p.name for p in result.files)])
    q8 = gguf.GGUFReader(result.out / "smol-merged-Q8_0.gguf")
    types = {t.name: t.tensor_type.name for t in q8.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" not in types  # tied to token_embd, as llama.cpp expects
    assert any(line.startswith("  behaviour: ok") for line in lines) == llama.available()


@needs_llama
def test_the_q4_k_m_file_is_llama_cpps_quantization(exported):
    """The K-quant file was made by llama.cpp's quantizer (its file type, its K-quant tensors) and proven above."""
    result, _ = exported
    path = result.out / "smol-merged-Q4_K_M.gguf"
    reader = gguf.GGUFReader(path)
    assert fields(reader)["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q4_K", "Q6_K"}


TINY_TYPES = ["llama", "mistral", "qwen3"]


@pytest.fixture(scope="module")
def theirs(merged, llama_converter, tmp_path_factory) -> dict[str, Path]:
    """llama.cpp's files: the merged SmolLM2 as Q8_0, and a tiny model of each architecture as F32."""
    root = tmp_path_factory.mktemp("theirs")
    jobs = [("q8_0", root / "smol-Q8_0.gguf", merged)]
    jobs += [("f32", root / f"{t}-F32.gguf", tiny(root / t, t)) for t in TINY_TYPES]
    their_ggufs(llama_converter, jobs)
    return {path.name.rsplit("-", 1)[0]: path for _, path, _ in jobs} | {f"{t}-model": root / t for t in TINY_TYPES}


@needs_llama
def test_llama_cpp_prints_nothing_of_its_own(exported, capfd):
    """llama.cpp logs at the C level (model load, context, every decode); the CLI must stay quiet without -v."""
    result, _ = exported
    capfd.readouterr()
    llama.logits(result.out / "smol-merged-Q4_K_M.gguf", [[1, 2, 3]])
    llama.tokenizer(result.out / "smol-merged-Q8_0.gguf").close()
    assert capfd.readouterr() == ("", "")


def test_our_q8_0_is_llama_cpps_own_conversion(exported, theirs):
    """llama.cpp's convert_hf_to_gguf.py on the same merged folder writes the same keys and tensor bytes."""
    result, _ = exported
    assert_same_file(result.out / "smol-merged-Q8_0.gguf", theirs["smol"])


# Tiny models of each architecture: written, proven by llama.cpp, and identical to llama.cpp's converter's file.


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_tiny_architectures_match_llama_cpps_converter(model_type, theirs, tmp_path):
    result = export.export(theirs[f"{model_type}-model"], ["F32"], tmp_path / "out", log=lambda _: None)
    assert result.proofs[0].passed
    assert_same_file(result.files[0], theirs[model_type])


def test_the_proofs_reader_reads_what_ggufs_own_reader_reads(theirs):
    """The proof opens files with proof.Reader (gguf's parser on a plain view of the mapping: 3x faster to open):
    on llama.cpp's own file it must give every key and every tensor's bytes as gguf's reader does."""
    plain, fast = gguf.GGUFReader(theirs["llama"]), proof.Reader(theirs["llama"])
    assert fields(fast) == fields(plain) and len(fields(plain)["tokenizer.ggml.tokens"]) == 49152
    assert tensor_bytes(fast) == tensor_bytes(plain)


def test_qwen2_with_a_tokenizer_llama_cpp_does_not_know_is_refused_and_its_weights_run(tmp_path):
    """transformers reads SmolLM2's vocabulary in a Qwen2 model with Qwen2's own pre-tokenizer, a combination
    llama.cpp has no name for: refused before writing. Forced to a name, the file's weights still prove and run."""
    folder = tiny(tmp_path / "model", "qwen2")
    with pytest.raises(BadInputError, match="llama.cpp does not know this BPE tokenizer's pre-tokenizer"):
        export.export(folder, ["F32"], tmp_path / "out", log=lambda _: None)
    assert list((tmp_path / "out").iterdir()) == []
    src, family = export.open_source(folder), arch.FAMILIES["qwen2"]
    path = tmp_path / "forced.gguf"
    write.write_gguf(src, family, "Q8_0", path, name="forced", pre="qwen2")
    reader = gguf.GGUFReader(path)
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= {t.name for t in reader.tensors}
    assert proof.prove_metadata(reader, src, family).passed and proof.prove_tensors(reader, src, family, "Q8_0").passed
    if llama.available():
        assert proof.prove_behaviour(path, proof.reference(src, with_logits=True), "Q8_0").passed


# Sabotage: each kind of wrong file fails its proof, says what is wrong, and leaves nothing in --out.


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def failed_export(folder: Path, out: Path, **kwargs) -> str:
    with pytest.raises(VerificationFailed) as caught:
        export.export(folder, ["F32"], out, log=lambda _: None, **kwargs)
    assert list(out.iterdir()) == []  # the staging folder is gone, nothing was moved in
    return str(caught.value)


def test_unpermuted_q_k_rows_fail_the_tensor_proof(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(arch, "permute", lambda w, n: w)  # the writer forgets; the proof's unpermute stays
    message = failed_export(tiny_llama, tmp_path / "out")
    assert "tensors proof failed: blk.0.attn_k.weight (model.layers.0.self_attn.k_proj.weight)" in message


def test_a_wrong_rope_base_fails_the_metadata_proof(tiny_llama, tmp_path, monkeypatch):
    real = arch.add_model_metadata

    def wrong_rope(w, config, family):
        real(w, {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, family)

    monkeypatch.setattr(arch, "add_model_metadata", wrong_rope)
    message = failed_export(tiny_llama, tmp_path / "out")
    assert "metadata proof failed: llama.rope.freq_base is 500000.0, config.json says 10000.0" in message


@needs_llama
def test_a_wrong_pre_tokenizer_fails_the_tokenizer_proof(tiny_llama, tmp_path):
    message = failed_export(tiny_llama, tmp_path / "out", pre="llama-bpe")
    assert "tokenizer proof failed: digits and spaces: token" in message and "in llama.cpp" in message


def test_a_dropped_tensor_fails_the_tensor_proof(tiny_llama, tmp_path, monkeypatch):
    real = write.plan
    monkeypatch.setattr(write, "plan", lambda *a: [p for p in real(*a) if p.name != "blk.1.ffn_up.weight"])
    message = failed_export(tiny_llama, tmp_path / "out")
    assert "blk.1.ffn_up.weight (model.layers.1.mlp.up_proj.weight) is missing from the file" in message


@needs_llama
def test_unpermuted_rows_also_fail_the_behaviour_proof(merged, tmp_path, monkeypatch):
    """Even if the tensors were read back the same wrong way, llama.cpp's logits show it (on SmolLM2: a tiny random
    model's attention is too weak for its rope to matter)."""
    src = export.open_source(merged)
    ref = proof.reference(src, with_logits=True)
    monkeypatch.setattr(arch, "permute", lambda w, n: w)
    monkeypatch.setattr(arch, "unpermute", lambda w, n: w)  # the tensors read back the same wrong way: they pass
    path = tmp_path / "bad.gguf"
    family = arch.family_of(src.config, merged)
    write.write_gguf(src, family, "F16", path, name="bad")
    assert proof.prove_tensors(gguf.GGUFReader(path), src, family, "F16").passed
    part = proof.prove_behaviour(path, ref, "F16")
    assert not part.passed and "limit 0.01 for F16" in part.detail


# The command line: refusals before anything is written.


def test_an_unsupported_architecture_is_one_line_before_anything_is_written(tmp_path, cli):
    folder = make_base(tmp_path / "gpt2", "gpt2")
    code, out, err = cli("gguf", folder, "--type", "Q8_0", "--out", tmp_path / "out")
    assert code == 2 and out == ""
    assert err == (f"error: {folder}: GGUF export does not support model_type 'gpt2' yet "
                   "(supported: llama, mistral, qwen2, qwen3)\n")  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_an_unknown_type_is_a_usage_error(tmp_path, cli):
    code, _, err = cli("gguf", tmp_path, "--type", "Q9_X", "--out", tmp_path / "out")
    assert code == 2 and err.startswith("error: GGUF type 'Q9_X' is not one we make: F32, F16, BF16, Q8_0, ")


def test_without_llama_cpp_k_quants_name_the_extra_and_f16_is_still_written(tiny_llama, tmp_path, cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setattr(llama, "available", lambda: False)
    llama._llama_cpp.cache_clear()
    try:
        code, out, err = cli("gguf", tiny_llama, "--type", "F16,Q4_K_M", "--out", tmp_path / "out")
        assert code == 2 and out == "" and not (tmp_path / "out").exists()
        assert err == ("error: GGUF type Q4_K_M needs llama-cpp-python, which is not installed: "
                       "pip install 'converter[gguf]'\n")  # fmt: skip
        with pytest.raises(MissingExtraError):
            llama.tokenizer(tmp_path / "x.gguf")
        code, out, err = cli("gguf", tiny_llama, "--type", "F16", "--out", tmp_path / "out")
        assert code == 0, err
        assert out.splitlines()[0] == ("llama.cpp's proof (tokenizer, behaviour) needs llama-cpp-python: "
                                       "pip install 'converter[gguf]'")  # fmt: skip
        assert (tmp_path / "out" / "llama-F16.gguf").is_file()
    finally:
        llama._llama_cpp.cache_clear()


def test_merge_with_gguf_writes_proven_files_beside_the_merge(tiny_llama, tmp_path, cli):
    adapter = make_adapter(tiny_llama, tmp_path / "lora", r=2)
    code, out, err = cli("merge", "--base", tiny_llama, "--adapter", adapter, "--out", tmp_path / "m", "--gguf", "Q8_0")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "m-GGUF").iterdir()) == ["gguf-proof.json", "m-Q8_0.gguf"]
    assert "  tensors: ok: " in out and f"GGUF: m-Q8_0.gguf in {tmp_path / 'm-GGUF'}" in out
    merged = export.open_source(tmp_path / "m")
    reader = gguf.GGUFReader(tmp_path / "m-GGUF" / "m-Q8_0.gguf")
    assert proof.prove_tensors(reader, merged, arch.FAMILIES["llama"], "Q8_0").passed  # the merge's, not the base's
    assert not proof.prove_tensors(reader, export.open_source(tiny_llama), arch.FAMILIES["llama"], "Q8_0").passed


def test_merge_with_gguf_refuses_an_unsupported_base_before_merging(tmp_path, cli):
    base = make_base(tmp_path / "gpt2", "gpt2")
    adapter = make_adapter(base, tmp_path / "lora", r=2, target_modules=["c_attn"])
    code, _, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", "--gguf", "F16")
    assert code == 2 and "GGUF export does not support model_type 'gpt2'" in err
    assert not (tmp_path / "m").exists() and not (tmp_path / "m-GGUF").exists()


def test_a_hub_model_to_gguf_from_the_command_line_prints_only_its_own_lines(tiny_llama, tmp_path):
    """`converter gguf org/name`: fetched from the (local) Hub, written, proven; a real process, so anything
    llama.cpp, transformers or gguf printed at any level would show in its output."""
    from converter.testing.hub import HubServer, client_env

    server = HubServer(tmp_path / "hub").start()
    try:
        server.add_user("alice", "hf_fake_alice_gguf_0123456789")
        server.seed_folder("alice/tiny-llama", tiny_llama)
        proc = subprocess.run(
            [sys.executable, "-m", "converter", "gguf", "alice/tiny-llama", "--type", "Q8_0", "--out", tmp_path / "o"],
            capture_output=True, text=True, env=client_env(server, "hf_fake_alice_gguf_0123456789"), timeout=600,
        )  # fmt: skip
    finally:
        server.stop()
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert all(line.startswith(("tiny-llama-", "  ", "wrote ", "proof: ")) for line in proc.stdout.splitlines())
    assert f"wrote {tmp_path / 'o' / 'tiny-llama-Q8_0.gguf'}" in proc.stdout


def test_push_with_gguf_publishes_proven_files_to_repo_gguf_in_one_commit(tiny_llama, tmp_path):
    from converter.testing.hub import HubServer, client_env

    token = "hf_fake_alice_gguf_0123456789"
    server = HubServer(tmp_path / "hub").start()
    try:
        server.add_user("alice", token)
        env = client_env(server, token)

        def converter(*args):
            return subprocess.run([sys.executable, "-m", "converter", *map(str, args)], capture_output=True, text=True,
                                  env=env, timeout=600)  # fmt: skip

        refused = converter("push", "--repo", "alice/tiny", "--base", tiny_llama, "--adapter", "x", "--gguf", "Q8_0")
        assert refused.returncode == 2 and "push --gguf needs --from FOLDER" in refused.stderr
        proc = converter("push", "--repo", "alice/tiny", "--from", tiny_llama, "--no-verify", "--gguf", "Q8_0")
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert "GGUF: pushed: " in proc.stdout
        assert set(server.files("alice/tiny-GGUF")) - {".gitattributes"} == {"README.md", "gguf-proof.json",
                                                                              "tiny-Q8_0.gguf"}  # fmt: skip
        readme = server.read_file("alice/tiny-GGUF", "README.md").decode()
        assert "base_model: alice/tiny\n" in readme and "- gguf\n" in readme
        assert "llama-cli -hf alice/tiny-GGUF:Q8_0" in readme
        assert "| `tiny-Q8_0.gguf` | Q8_0 |" in readme and "behaviour: llama.cpp's logits differ" in readme
        assert "config.json" in server.files("alice/tiny")  # the safetensors repo as a push makes it
        titles = [c.title for c in server.repo("alice/tiny-GGUF").commits.values()]
        assert titles.count("Upload GGUF files (converter)") == 1 and len(titles) <= 2  # (+ the Hub's initial commit)
    finally:
        server.stop()
