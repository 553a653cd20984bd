"""Bad input: a one-line message naming the file/tensor, exit code 2, and nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from model_helpers import make_adapter, make_base


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("llama") / "base", "llama")


@pytest.fixture(scope="module")
def lora(llama, tmp_path_factory):
    return make_adapter(llama, tmp_path_factory.mktemp("lora") / "lora", r=4, lora_alpha=8)


def assert_fails(cli, tmp_path, *args, message: str):
    out = tmp_path / "merged"
    code, stdout, err = cli("merge", *args, "--out", out)
    assert code == 2, (stdout, err)
    assert message in err, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() or not any(out.iterdir())
    assert not list(tmp_path.glob(".merged.*")), "a temp folder was left behind"
    return err


def test_adapter_for_another_architecture(llama, tmp_path, cli):
    gpt2 = make_base(tmp_path / "gpt2", "gpt2")
    adapter = make_adapter(gpt2, tmp_path / "gpt2-lora", r=4, lora_alpha=8, target_modules=["c_attn"])
    err = assert_fails(cli, tmp_path, "--base", llama, "--adapter", adapter, message="land on no base tensor")
    assert "transformer.h.0.attn.c_attn.lora_A.weight" in err and "--allow-unmatched" in err


def test_allow_unmatched_merges_the_rest(llama, tmp_path, cli):
    from safetensors.torch import load_file, save_file

    adapter = make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    f = adapter / "adapter_model.safetensors"
    tensors = load_file(f)
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, 4)
    save_file(tensors, f)
    assert_fails(cli, tmp_path, "--base", llama, "--adapter", adapter, message="2 adapter tensors land on no base")
    code, out, err = cli("merge", "--base", llama, "--adapter", adapter, "--out", tmp_path / "m", "--allow-unmatched")
    assert code == 0, err
    assert "2 unmatched adapter tensors ignored" in out


def test_adapter_trained_on_another_size(llama, tmp_path, cli):
    bigger = make_base(tmp_path / "big", "llama", hidden_size=96)
    adapter = make_adapter(bigger, tmp_path / "big-lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    err = assert_fails(cli, tmp_path, "--base", llama, "--adapter", adapter, message="different model size")
    assert "[96, 96]" in err and "[64, 64]" in err and "q_proj" in err


def test_nan_in_adapter(llama, tmp_path, cli):
    from safetensors.torch import load_file, save_file

    adapter = make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    f = adapter / "adapter_model.safetensors"
    tensors = load_file(f)
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    tensors[name][3, 1] = float("nan")
    save_file(tensors, f)
    assert_fails(cli, tmp_path, "--base", llama, "--adapter", adapter, message=f"tensor {name} contains NaN")


def test_overflow_in_output_dtype(tmp_path, cli):
    base = make_base(tmp_path / "base", "llama", dtype=torch.float16)
    adapter = make_adapter(base, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["o_proj"])
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 1e9
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    assert_fails(cli, tmp_path, "--base", base, "--adapter", adapter, message="o_proj.weight has NaN/Inf values in F16")


def test_base_is_not_a_model_folder(lora, tmp_path, cli):
    (tmp_path / "empty").mkdir()
    assert_fails(cli, tmp_path, "--base", tmp_path / "empty", "--adapter", lora, message="no config.json")


def test_truncated_base(llama, lora, tmp_path, cli):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) - 1000])
    err = assert_fails(cli, tmp_path, "--base", broken, "--adapter", lora, message="truncated")
    assert "model.safetensors" in err


def test_corrupt_header(llama, lora, tmp_path, cli):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama, broken)
    data = bytearray((broken / "model.safetensors").read_bytes())
    data[8:20] = b"not json at!"
    (broken / "model.safetensors").write_bytes(bytes(data))
    assert_fails(cli, tmp_path, "--base", broken, "--adapter", lora, message="not valid JSON")


def test_existing_output_needs_force(llama, lora, tmp_path, cli):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = cli("merge", "--base", llama, "--adapter", lora, "--out", out)
    assert code == 2 and "--force" in err and (out / "keep.txt").read_text() == "mine"
    code, _, err = cli("merge", "--base", llama, "--adapter", lora, "--out", out, "--force")
    assert code == 0, err
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_bias_delta_on_a_base_without_bias(llama, tmp_path, cli):
    adapter = make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj"])
    assert_fails(cli, tmp_path, "--base", llama, "--adapter", adapter, message="has no bias")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--adapter", "./nowhere/at-all"], "no such file or folder"),
        (["--adapter", "some-org/some-lora"], "HF_HUB_OFFLINE is set"),
        (["--adapter", "not a path or an id"], "neither a local path nor a Hub id"),
        (["--adapter", "{lora}", "--weight", "0.5", "--weight", "0.5"], "give one per adapter"),
        (["--adapter", "{lora}", "--dtype", "int4"], "unknown dtype"),
        (["--adapter", "{lora}", "--max-shard-size", "lots"], "cannot read size"),
    ],
)
def test_usage_errors(args, message, llama, lora, tmp_path, cli):
    assert_fails(cli, tmp_path, "--base", llama, *[a.format(lora=lora) for a in args], message=message)


def test_missing_half_of_a_pair(llama, tmp_path, cli):
    from safetensors.torch import load_file, save_file

    adapter = make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    f = adapter / "adapter_model.safetensors"
    tensors = load_file(f)
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, f)
    assert_fails(cli, tmp_path, "--base", llama, "--adapter", adapter, message="lora_B is missing")


def test_warns_when_trained_on_another_base(llama, tmp_path, cli):
    adapter = make_adapter(llama, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "someone/Other-Model-7B"
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    code, out, err = cli("merge", "--base", llama, "--adapter", adapter, "--out", tmp_path / "m", "--dry-run")
    assert code == 0 and "trained on 'someone/Other-Model-7B'" in out


def test_python_dash_m_and_no_heavy_imports(llama, lora, tmp_path):
    """`python -m converter` works, exits 2 on bad input, and merging never imports transformers or peft; a plain
    LoRA merge without verification does not import torch either (converter.engine.npmerge; torch costs ~1 s), nor
    does a verified merge refused for its input (verification's imports start once the inputs are planned)."""
    bad = subprocess.run(
        [sys.executable, "-m", "converter", "merge", "--base", str(tmp_path)], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")
    code = (
        "import sys; from converter.cli import main; "
        f"rc = main(['merge', '--base', {str(llama)!r}, '--adapter', {str(lora)!r}, "
        f"'--out', {str(tmp_path / 'm')!r}, '--no-verify']); "
        "heavy = [m for m in ('transformers', 'peft', 'accelerate', 'torch') if m in sys.modules]; "
        "print('heavy:', heavy); sys.exit(rc or (3 if heavy else 0))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "heavy: []" in run.stdout
    # a verified merge of an adapter whose base is not there is refused before verification's imports begin
    code = code.replace(str(llama), str(tmp_path / "no-base")).replace(", '--no-verify'", "")
    code = code.replace(repr(str(tmp_path / "m")), repr(str(tmp_path / "m2")))
    code = code.replace("sys.exit(rc or (3 if heavy else 0))", "sys.exit(3 if heavy else rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 2 and "heavy: []" in run.stdout, run.stdout + run.stderr
    assert f"error: {tmp_path / 'no-base'}: no such file or folder" in run.stderr


def test_typed_errors_carry_what_went_wrong(lora, tmp_path):
    """Python callers catch the narrow class and read the file / tensor / repo from it; all are ConverterErrors
    (exit 2, verification 3), so `except ConverterError` still catches everything."""
    import shutil

    from huggingface_hub.errors import OfflineModeIsEnabled
    from safetensors.torch import load_file, save_file

    from converter.engine.recipe import Recipe
    from converter.errors import (
        AdapterFormatError,
        BadInputError,
        ConverterError,
        HubError,
        RecipeError,
        UsageError,
        VerificationFailed,
    )
    from converter.formats import load_adapter
    from converter.hub import client as hub
    from converter.hub.sources import _check_names, parse_source

    broken = tmp_path / "broken"
    shutil.copytree(lora, broken)
    f = broken / "adapter_model.safetensors"
    tensors = load_file(f)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[name] = torch.zeros(64, 3)
    save_file(tensors, f)
    with pytest.raises(AdapterFormatError) as caught:
        load_adapter(broken)
    assert isinstance(caught.value, BadInputError) and caught.value.exit_code == 2
    assert caught.value.file == str(f) and caught.value.tensor == name

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {lora}\nadapters: [{lora}]\nmax_shard: 1GB\n")
    with pytest.raises(RecipeError, match="unknown key 'max_shard'") as caught:
        Recipe.load(recipe)
    assert caught.value.file == str(recipe) and caught.value.tensor is None

    with pytest.raises(HubError) as caught:
        _check_names("org/name@main", "org/name", "main", ["config.json", "../../etc/x"])
    assert (caught.value.repo_id, caught.value.revision) == ("org/name", "main")
    error = hub.explain("org/name@v1", OfflineModeIsEnabled("offline"), repo_id="org/name", revision="v1")
    assert isinstance(error, HubError) and (error.repo_id, error.revision) == ("org/name", "v1")

    with pytest.raises(UsageError):
        parse_source("not a path or an id")
    assert issubclass(VerificationFailed, ConverterError) and VerificationFailed.exit_code == 3


def test_merge_and_push_errors_are_typed(llama, lora, tmp_path):
    """The merge's own refusals carry the adapter and tensor concerned; options that cannot work are UsageErrors."""
    import shutil

    from safetensors.torch import load_file, save_file

    from converter.engine.merging import merge
    from converter.engine.recipe import AdapterSpec, Recipe
    from converter.errors import BadInputError, UsageError
    from converter.jobs.pipeline import push

    with pytest.raises(UsageError, match="no output folder"):
        merge(Recipe(base=str(llama), adapters=[AdapterSpec(str(lora))]))
    with pytest.raises(UsageError, match="push needs either --from FOLDER"):
        push("org/name")

    extra = tmp_path / "extra"
    shutil.copytree(lora, extra)
    tensors = load_file(extra / "adapter_model.safetensors")
    stray = {f"base_model.model.model.layers.7.self_attn.q_proj.lora_{x}.weight" for x in "AB"}
    tensors.update({n: torch.zeros(4, 64) if n.endswith("A.weight") else torch.zeros(64, 4) for n in stray})
    save_file(tensors, extra / "adapter_model.safetensors")
    with pytest.raises(BadInputError, match="2 adapter tensors land on no base tensor") as caught:
        merge(Recipe(base=str(llama), adapters=[AdapterSpec(str(extra))], out=str(tmp_path / "m1")))
    assert caught.value.file == str(extra) and caught.value.tensor in stray

    nan = tmp_path / "nan"
    shutil.copytree(lora, nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("lora_B.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    with pytest.raises(BadInputError, match="contains NaN") as caught:
        merge(Recipe(base=str(llama), adapters=[AdapterSpec(str(nan))], out=str(tmp_path / "m2")))
    assert caught.value.file == str(nan) and caught.value.tensor == name


def test_every_command_has_a_handler():
    """The CLI dispatches through its table of commands: every subcommand the parser knows has its handler."""
    import argparse

    from converter.cli.commands import COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)


def test_hub_errors_carry_repo_revision_status_and_request_id(lora, tmp_path):
    """A missing repo, revision or file, a gated repo and a refused token against the local Hub (the real client,
    the real API): the HubError says which repo and revision, the HTTP status and the server's request id."""
    from converter.testing.hub import HubServer, run_client

    server = HubServer(tmp_path / "server").start()
    try:
        server.add_user("alice", "hf_fake_alice_0123456789")
        server.add_user("bob", "hf_fake_bob_0123456789")
        server.seed_folder("alice/lora", lora)
        server.create_repo("alice/gated", gated="auto")
        server.seed_folder("alice/gated", lora)
        code = """
import json
from converter.errors import HubError
from converter.hub.sources import fetch
found = {}
tokens = {"alice/gated": "hf_fake_bob_0123456789", "alice/lora@v0": "hf_not_a_token_0123456789"}
for spec in ("alice/missing", "alice/lora@nope", "alice/lora@main/nothing.safetensors", "alice/gated", "alice/lora@v0"):
    try:
        fetch(spec, "adapter", token=tokens.get(spec))
    except HubError as e:
        found[spec] = [type(e).__name__, e.repo_id, e.revision, e.status, e.request_id, e.reason, e.transient]
print("RESULT " + json.dumps(found))
"""
        proc = run_client(server, code, token="hf_fake_alice_0123456789", home=tmp_path / "home")
    finally:
        server.stop()
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))
    name, repo, revision, status, request_id, reason, transient = found["alice/missing"]
    assert (name, repo, revision, status, reason, transient) == ("HubError", "alice/missing", "main", 404,
                                                                 "repo-not-found", False)  # fmt: skip
    assert request_id and request_id.startswith("fake-")
    assert found["alice/lora@nope"][1:4] == ["alice/lora", "nope", 404]
    assert found["alice/lora@nope"][5] == "revision-not-found"
    assert found["alice/lora@main/nothing.safetensors"][1:3] == ["alice/lora", "main"]
    assert found["alice/lora@main/nothing.safetensors"][5] == "file-not-found"
    assert found["alice/gated"][1] == "alice/gated" and found["alice/gated"][5] == "gated"
    assert found["alice/lora@v0"][1:4] == ["alice/lora", "v0", 401] and found["alice/lora@v0"][5] == "unauthorized"


def test_hub_error_reasons_without_a_server():
    """Offline, a 429 and a 5xx after the retries: `reason` and `transient` say what a caller may retry."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    from converter.hub import client as hub

    error = hub.explain("org/name@v1", OfflineModeIsEnabled("offline"), repo_id="org/name", revision="v1")
    assert (error.reason, error.status, error.transient) == ("offline", None, False)
    for status, reason in ((429, "rate-limited"), (408, "timeout"), (503, "server"), (409, "conflict"), (418, "http")):
        request = httpx.Request("GET", "https://hub.example/api/models/org/name")
        response = httpx.Response(status, request=request, headers={"x-request-id": f"req-{status}"})
        error = hub.explain("org/name", HfHubHTTPError("refused", response=response), repo_id="org/name")
        assert (error.repo_id, error.revision, error.status, error.request_id) == ("org/name", None, status,
                                                                                   f"req-{status}")  # fmt: skip
        assert error.reason == reason and error.transient == (status in (408, 429, 503))
        assert f"Hub error {status}" in str(error)


def test_unreadable_files_name_the_file_and_tensor(llama, lora, tmp_path):
    """A safetensors header entry that is wrong, and a tensor two files of a model both hold: BadInputError /
    CheckpointError with `file` and `tensor` set."""
    import shutil

    from safetensors.torch import save_file

    from converter.engine.checkpoint import Checkpoint
    from converter.errors import BadInputError, CheckpointError, OutputError
    from converter.formats import load_adapter
    from converter.io.safetensors_header import encode_header, entry

    broken = tmp_path / "broken"
    shutil.copytree(lora, broken)
    f = broken / "adapter_model.safetensors"
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    f.write_bytes(encode_header({name: entry("F99", [2], 0, 8)}) + bytes(8))
    with pytest.raises(BadInputError) as caught:
        load_adapter(broken)
    assert caught.value.file == str(f) and caught.value.tensor == name and caught.value.exit_code == 2

    model = tmp_path / "model"
    shutil.copytree(llama, model)
    shard = next(model.glob("*.safetensors"))
    save_file({"model.norm.weight": torch.ones(4)}, model / "extra.safetensors")
    with pytest.raises(CheckpointError) as caught:
        Checkpoint(model)
    assert caught.value.tensor == "model.norm.weight"
    assert caught.value.file in (str(model / "extra.safetensors"), str(shard))

    from converter import AdapterSpec, Recipe, merge

    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputError) as caught:
        merge(Recipe(base=str(llama), adapters=[AdapterSpec(str(lora))], out=str(out)), log=lambda _line: None)
    assert caught.value.path == str(out) and (out / "keep.txt").read_text() == "mine"


def test_a_failed_verification_carries_its_report(llama, lora, tmp_path):
    """The proof finds a sabotaged tensor: VerificationFailed.report is the VerificationReport naming it."""
    from safetensors.torch import load_file, save_file

    from converter import AdapterSpec, Recipe, merge, verify
    from converter.errors import VerificationFailed

    out = tmp_path / "merged"
    recipe = Recipe(base=str(llama), adapters=[AdapterSpec(str(lora))], out=str(out))
    merge(recipe, log=lambda _line: None)
    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.q_proj.weight"
    base = load_file(next(llama.glob("*.safetensors")))[name]
    tensors[name] = (2 * base.double() - tensors[name].double()).to(tensors[name].dtype)  # the delta negated
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(VerificationFailed) as caught:
        verify(out, recipe, log=lambda _line: None)
    from converter.verification.report import VerificationReport

    report = caught.value.report
    assert caught.value.exit_code == 3 and isinstance(report, VerificationReport) and report.verdict == "fail"
    assert name in str(caught.value)


def test_gguf_of_a_diffusion_base_is_refused_before_the_merge_where_it_cannot_be_made(lora, tmp_path, cli):
    """A diffusers pipeline as the base of `merge --gguf` (ComfyUI-GGUF and diffusers' GGUF loader read the
    original single file) and a K-quant for a single file (not made exactly here) are one line, exit 2, before
    anything is merged; the GGUF of a single file itself is tests/gguf/test_gguf_diffusion.py's."""
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text("{}")
    single = tmp_path / "flux1-dev.safetensors"
    single.write_bytes(b"")
    err = assert_fails(cli, tmp_path, "--base", pipeline, "--adapter", lora, "--gguf", "Q8_0",
                       message="read the original single-file layout")  # fmt: skip
    assert str(pipeline) in err
    err = assert_fails(cli, tmp_path, "--base", single, "--adapter", lora, "--gguf", "Q4_K_M", message="K-quants")
    assert str(single) in err
