"""MLX out: folders written by `merge --mlx` / `push --mlx`, proven by mlx-lm, and checked against mlx-lm itself.

Oracles: `mlx_lm.convert` of the same merged folder must write the same tensors (names, dtypes, bytes), the same
config.json, index and tokenizer files as we do; `mlx_lm.load` must run every folder, its logits within the type's
limit of the merged model's (torch, float32). A sabotaged tensor must fail the proof, naming it, and leave nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from model_helpers import make_adapter, make_base, run_cli

from converter.errors import VerificationFailed
from converter.mlx import export, layout, proof
from converter.mlx.types import TYPES

mx = pytest.importorskip("mlx.core", reason="mlx (converter[mlx]) not installed")
mlx_lm = pytest.importorskip("mlx_lm")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from build_fixtures import cache_dir, is_complete  # noqa: E402

SMOLLM2 = cache_dir() / "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def merged(root: Path, arch: str, dtype=torch.bfloat16, **overrides) -> Path:
    """A tiny `arch` base with SmolLM2's tokenizer (mlx-lm loads one), merged with a random LoRA on every linear."""
    if not is_complete(SMOLLM2):
        pytest.fail(f"SmolLM2 fixture missing at {SMOLLM2}: run `make fixtures` (make test does it first)")
    extra = {"query_pre_attn_scalar": 16} if arch.startswith("gemma") else {}
    base = make_base(root / "base", arch, dtype=dtype, vocab_size=49152, **extra, **overrides)
    for name in TOKENIZER_FILES:
        shutil.copy(SMOLLM2 / name, base / name)
    adapter = make_adapter(base, root / "adapter")
    assert run_cli("merge", "--base", base, "--adapter", adapter, "--out", root / "m", "--no-verify") == 0
    return root / "m"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return merged(tmp_path_factory.mktemp("mlx-llama"), "llama")


def mlx_lm_convert(src: Path, out: Path, type_name: str) -> Path:
    t = TYPES[type_name]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if t.bits:
            mlx_lm.convert(str(src), mlx_path=str(out), quantize=True, q_bits=t.bits, q_group_size=t.group_size)
        else:
            mlx_lm.convert(str(src), mlx_path=str(out), dtype=t.dtype)
    return out


def tensors(folder: Path) -> dict:
    found = {}
    for path in folder.glob("*.safetensors"):
        found.update(mx.load(str(path)))
    return found


def assert_same_as_mlx_lm(ours: Path, theirs: Path) -> None:
    a, b = tensors(theirs), tensors(ours)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and mx.array_equal(a[name], b[name]).item(), name
    for name in ("config.json", "model.safetensors.index.json", *TOKENIZER_FILES, "generation_config.json"):
        assert json.loads((ours / name).read_text()) == json.loads((theirs / name).read_text()) if name.endswith(
            ".json") else (ours / name).read_bytes() == (theirs / name).read_bytes(), name  # fmt: skip
    assert mx.load(str(ours / "model.safetensors"), return_metadata=True)[1] == {"format": "mlx"}


def test_merge_with_mlx_writes_what_mlx_lm_writes_proven(llama, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(llama, out)
    result = export.export(out, list(TYPES.values()), {t: export.folder_for(out, TYPES[t]) for t in TYPES},
                           base_model="alice/tiny", log=lambda s: None)  # fmt: skip
    assert [p.type for p in result.proofs] == ["4bit", "8bit", "bf16"] and all(p.passed for p in result.proofs)
    for t in TYPES:
        folder = tmp_path / f"m-{t}"
        assert_same_as_mlx_lm(folder, mlx_lm_convert(out, tmp_path / f"ref-{t}", t))
        saved = json.loads((folder / export.PROOF_FILE).read_text())
        assert saved["passed"] and [p["name"] for p in saved["parts"]] == ["config", "tensors", "behaviour"]
        card = (folder / "README.md").read_text()
        assert "library_name: mlx\n" in card and "- mlx\n" in card and "base_model: alice/tiny\n" in card
        assert f'load("m-{t}")' in card
    summary = result.as_proofs().mlx
    assert [s.parts["behaviour"] for s in summary] == ["ok"] * 3


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma2", "phi3"])
def test_other_architectures_as_mlx_lm_writes_them_and_proven(arch, tmp_path):
    src = merged(tmp_path, arch, dtype=torch.float32)
    targets = {"4bit": tmp_path / "out-4bit"}
    result = export.export(src, [TYPES["4bit"]], targets, log=lambda s: None)
    assert result.proofs[0].passed
    assert_same_as_mlx_lm(targets["4bit"], mlx_lm_convert(src, tmp_path / "ref", "4bit"))


def sabotage(folder: Path, name: str, how) -> None:
    """Rewrite one tensor of the folder's model.safetensors in place."""
    from converter.io.safetensors_file import SafetensorsFile

    f = SafetensorsFile(folder / "model.safetensors")
    info = f.tensors[name]
    raw = f.read_bytes(name)
    with open(f.path, "r+b") as out:
        out.seek(info.start)
        out.write(how(raw).tobytes())


def test_one_sabotaged_tensor_fails_the_tensor_proof_naming_it(llama, tmp_path):
    out = tmp_path / "m-4bit"
    export.export(llama, [TYPES["4bit"]], {"4bit": out}, log=lambda s: None)
    lay = layout.plan(llama, TYPES["4bit"])
    assert proof.prove_tensors(out, lay).passed
    name = "model.layers.1.mlp.down_proj.scales"
    sabotage(out, name, lambda raw: raw.view(np.uint16) ^ np.uint16(1))  # one bf16 ulp on every scale
    part = proof.prove_tensors(out, lay)
    assert not part.passed and part.detail.startswith(f"{name}: its bytes are not mx.quantize's")


def test_a_sabotaged_tensor_fails_the_behaviour_proof_of_mlx_lm(llama, tmp_path):
    """What mlx-lm computes from the folder is judged on its own: one tensor of a bf16 folder scaled fails it."""
    out = tmp_path / "m-bf16"
    export.export(llama, [TYPES["bf16"]], {"bf16": out}, log=lambda s: None)
    ids = proof.seeded_ids(49152)
    reference = proof.reference_logits(llama, ids)
    assert proof.prove_behaviour(out, ids, reference, "bf16").passed
    bf16 = mx.bfloat16

    def scaled(raw):
        w = mx.array(raw.view(np.uint16)).view(bf16) * 4
        return np.array(w.view(mx.uint16))

    sabotage(out, "model.layers.0.mlp.down_proj.weight", scaled)
    part = proof.prove_behaviour(out, ids, reference, "bf16")
    assert not part.passed and "relative RMS" in part.detail


def test_the_reference_is_built_without_weights_and_gives_a_float32_load_s_logits(llama, monkeypatch):
    """The merged model's reference logits come from a model built empty, each weight read as its layer runs (no
    whole load: transformers' from_pretrained is not called), equal to the logits of the model loaded in float32."""
    import transformers

    ids = proof.seeded_ids(49152)[:2]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    with torch.no_grad():
        want = loaded(input_ids=torch.tensor(ids)).logits.numpy()

    def refused(*_a, **_k):
        raise AssertionError("the reference loaded the whole model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refused)
    got = proof.reference_logits(llama, ids)
    assert proof.relative_rms(got, want) < 1e-5


def test_a_failed_proof_leaves_nothing(llama, tmp_path, monkeypatch):
    monkeypatch.setitem(proof.BEHAVIOUR_LIMIT, "8bit", 0.0)
    targets = {t: tmp_path / f"m-{t}" for t in ("4bit", "8bit")}
    with pytest.raises(VerificationFailed, match="m-8bit: MLX behaviour proof failed: .*nothing was written") as e:
        export.export(llama, [TYPES["4bit"], TYPES["8bit"]], targets, log=lambda s: None)
    assert e.value.report.as_proofs().mlx[0].parts["behaviour"] == "FAILED"
    assert list(tmp_path.iterdir()) == []


def test_merge_mlx_from_the_command_line(tmp_path, llama, capsys):
    base, adapter = llama.parent / "base", llama.parent / "adapter"
    code = run_cli("--json", "merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", "--no-verify",
                   "--mlx", "8bit")  # fmt: skip
    assert code == 0
    outcome = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(p["file"], p["type"], p["passed"]) for p in outcome["proofs"]["mlx"]] == [("m-8bit", "8bit", True)]
    assert str(tmp_path / "m-8bit") in outcome["files"]
    assert (tmp_path / "m-8bit" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--mlx", "3bit"], "--mlx: unknown type '3bit'; choose from 4bit, 8bit, bf16"),
        (["--mlx", ","], "name at least one of 4bit, 8bit, bf16"),
    ],
)
def test_bad_mlx_values_are_one_line_usage_errors(tmp_path, llama, capsys, args, said):
    base, adapter = llama.parent / "base", llama.parent / "adapter"
    assert run_cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "m", *args) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1 and not (tmp_path / "m").exists()


def test_an_architecture_mlx_lm_does_not_know_is_refused_before_the_merge(tmp_path, llama, capsys):
    base = tmp_path / "base"
    shutil.copytree(llama.parent / "base", base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "model_type": "not_a_model"}))
    assert run_cli("merge", "--base", base, "--adapter", llama.parent / "adapter", "--out", tmp_path / "m",
                   "--mlx", "4bit") == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "mlx-lm does not know the architecture 'not_a_model'" in err and len(err.splitlines()) == 1


def test_a_diffusion_base_is_refused(tmp_path, capsys):
    base = tmp_path / "pipe"
    base.mkdir()
    (base / "model_index.json").write_text("{}")
    (tmp_path / "lora.safetensors").write_bytes(b"")
    assert run_cli("merge", "--base", base, "--adapter", tmp_path / "lora.safetensors", "--out", tmp_path / "m",
                   "--mlx", "4bit") == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "is a diffusion model; MLX export is for the language models mlx-lm runs" in err


@pytest.fixture
def hub_cli(tmp_path):
    from converter.testing.hub import HubServer, client_env

    token = "hf_fake_alice_mlx_0123456789"
    server = HubServer(tmp_path / "hub").start()
    server.add_user("alice", token)
    env = client_env(server, token)

    def converter(*args):
        return subprocess.run([sys.executable, "-m", "converter", *map(str, args)], capture_output=True, text=True,
                              env=env, timeout=600)  # fmt: skip

    converter.server = server
    yield converter
    server.stop()


def test_push_mlx_publishes_repo_4bit_as_mlx_community_names_it(llama, hub_cli):
    proc = hub_cli("push", "--repo", "alice/tiny", "--from", llama, "--no-verify", "--mlx", "4bit")
    assert proc.returncode == 0, proc.stderr
    server = hub_cli.server
    files = set(server.files("alice/tiny-4bit"))
    assert {"README.md", "config.json", "model.safetensors", export.PROOF_FILE, "tokenizer.json"} <= files
    readme = server.read_file("alice/tiny-4bit", "README.md").decode()
    assert "library_name: mlx\n" in readme and "base_model: alice/tiny\n" in readme
    assert 'load("alice/tiny-4bit")' in readme
    assert "config.json" in server.files("alice/tiny")
