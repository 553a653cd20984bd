"""A catalogue of malformed inputs across merge / convert / verify / push: every one is refused with ONE line on
stderr (`error: ...`, no traceback), exit code 2, and nothing written (no output, the folder around it unchanged).

Cases already in tests/cli/test_errors.py (truncated base, corrupt header JSON, NaN, wrong-size adapter, half a pair,
...) are not repeated; these extend them. Each case builds its broken input in its own folder and returns the
command line. Hub cases run in one subprocess against the local Hub server (tests/hub/test_hub_pipeline.py's way).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from model_helpers import make_adapter, make_base
from safetensors.torch import load_file, save_file

from converter.testing.hub import HubServer, run_client

Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("malformed")
    base = make_base(root / "base", "llama")
    lora = make_adapter(base, root / "lora", r=4, lora_alpha=8, target_modules=["q_proj"])
    return {"base": base, "lora": lora, "root": root}


def st_file(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    """A .safetensors file written byte by byte, so its header can lie."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def lora_copy(w, d: Path, edit: Callable[[dict], None] | None = None, config: Callable[[dict], None] | None = None):
    """A copy of the good PEFT adapter with its tensors and/or adapter_config.json edited."""
    out = d / "lora"
    shutil.copytree(w["lora"], out)
    if edit:
        tensors = load_file(out / "adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, out / "adapter_model.safetensors")
    if config:
        cfg = json.loads((out / "adapter_config.json").read_text())
        config(cfg)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def base_copy(w, d: Path, edit: Callable[[bytes], bytes]) -> Path:
    out = d / "base"
    shutil.copytree(w["base"], out)
    f = out / "model.safetensors"
    f.write_bytes(edit(f.read_bytes()))
    return out


def with_header(data: bytes, change: Callable[[dict], None], pad: bool = True) -> bytes:
    """The same file with its JSON header edited (and the data kept where it was when `pad`)."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    change(header)
    raw = json.dumps(header).encode()
    if pad and len(raw) <= n:
        raw = raw + b" " * (n - len(raw))
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def merge(w, d, base=None, adapter=None, *extra) -> list:
    return ["merge", "--base", base or w["base"], "--adapter", adapter or w["lora"], *extra]


def community(d: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> Path:
    f = d / "lora.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, f, metadata=metadata)
    return f


def kohya(stem: str = "lora_unet_down_blocks_0_attentions_0_proj_in", rank: int = 4) -> dict[str, torch.Tensor]:
    return {f"{stem}.lora_down.weight": torch.randn(rank, 8), f"{stem}.lora_up.weight": torch.randn(8, rank)}


def recipe(d: Path, text: str) -> list:
    f = d / "recipe.yaml"
    f.write_text(text)
    return ["merge", "--recipe", f]


def _set(path: list, value):
    def change(h):
        target = h[first_tensor(h)]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


# name -> (builder(world, dir) -> argv, text the one line must contain)
CASES: dict[str, tuple[Callable, str]] = {
    # --- the base's safetensors headers ---------------------------------------------------------------------------
    "base: empty file": (lambda w, d: merge(w, d, base_copy(w, d, lambda b: b""), None), "shorter than a safetensors"),
    "base: header length past the end": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: struct.pack("<Q", len(b)) + b[8:])),
        "header length is larger than the file",
    ),
    "base: header length 2**63": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: struct.pack("<Q", 2**63) + b[8:])),
        "header length is larger than the file",
    ),
    "base: header is a JSON list": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: struct.pack("<Q", 2) + b"[]" + b[8:])),
        "header is not a JSON object",
    ),
    "base: header not UTF-8": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: b[:8] + b"\xff\xfe" + b[10:])),
        "not valid JSON",
    ),
    "base: a tensor named twice in the header": (
        lambda w, d: merge(w, d, base_copy(w, d, _duplicate_first)),
        "header names 'lm_head.weight' twice",
    ),
    "base: dtype lie (F64 for F32 bytes)": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: with_header(b, _set(["dtype"], "F64")))),
        "byte range does not match its shape",
    ),
    "base: unknown dtype": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: with_header(b, _set(["dtype"], "Q4_K")))),
        "unsupported dtype",
    ),
    "base: dtype is a list": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: with_header(b, _set(["dtype"], ["F32"])))),
        "unsupported dtype",
    ),
    "base: shape lie": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: with_header(b, _set(["shape"], [3, 3])))),
        "byte range does not match its shape",
    ),
    "base: shape of strings": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: with_header(b, _set(["shape"], ["64", "64"])))),
        "non-negative integers",
    ),
    "base: negative offsets": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: with_header(b, _set(["data_offsets"], [-4, 0])))),
        "non-negative integers",
    ),
    "base: missing data_offsets": (
        lambda w, d: merge(
            w, d, base_copy(w, d, lambda b: with_header(b, lambda h: h[first_tensor(h)].pop("data_offsets")))
        ),
        "malformed header entry",
    ),
    "base: overlapping byte ranges": (
        lambda w, d: merge(
            w,
            d,
            base_copy(
                w,
                d,
                lambda b: with_header(
                    b,
                    lambda h: [
                        h[k].__setitem__("data_offsets", [0, h[k]["data_offsets"][1] - h[k]["data_offsets"][0]])
                        for k in list(h)[1:3]
                        if k != "__metadata__"
                    ],
                ),
            ),
        ),
        "share bytes",
    ),
    "base: offsets past the end of the file": (
        lambda w, d: merge(w, d, base_copy(w, d, lambda b: b[: len(b) - 4])),
        "truncated",
    ),
    "base: __metadata__ not strings": (
        lambda w, d: merge(
            w, d, base_copy(w, d, lambda b: with_header(b, lambda h: h.__setitem__("__metadata__", {"format": 1})))
        ),
        "__metadata__ must map names to strings",
    ),
    # --- PEFT adapters ----------------------------------------------------------------------------------------------
    "adapter: truncated weights": (
        lambda w, d: merge(w, d, None, _truncate(lora_copy(w, d))),
        "truncated",
    ),
    "adapter: Inf in lora_A": (
        lambda w, d: merge(
            w, d, None, lora_copy(w, d, lambda t: t[f"{Q}.lora_A.weight"].__setitem__((0, 0), float("inf")))
        ),
        "contains",
    ),
    "adapter: A and B ranks disagree": (
        lambda w, d: merge(
            w, d, None, lora_copy(w, d, lambda t: t.__setitem__(f"{Q}.lora_B.weight", torch.randn(64, 3)))
        ),
        "ranks (lora_B dim 1, lora_A dim 0) must agree",
    ),
    "adapter: rank differs from config r": (
        lambda w, d: merge(w, d, None, lora_copy(w, d, config=lambda c: c.__setitem__("r", 16))),
        "says r=16",
    ),
    "adapter: duplicate keys after name mapping": (
        lambda w, d: merge(
            w,
            d,
            None,
            lora_copy(w, d, lambda t: t.__setitem__(f"{Q}.lora_A.default.weight", t[f"{Q}.lora_A.weight"].clone())),
        ),
        "same tensor after name mapping",
    ),
    "adapter: config not JSON": (
        lambda w, d: merge(w, d, None, _write(lora_copy(w, d) / "adapter_config.json", "{'r': 4,}")),
        "invalid JSON",
    ),
    "adapter: config is a list": (
        lambda w, d: merge(w, d, None, _write(lora_copy(w, d) / "adapter_config.json", "[1, 2]")),
        "expected a JSON object",
    ),
    "adapter: config not UTF-8": (
        lambda w, d: merge(w, d, None, _write(lora_copy(w, d) / "adapter_config.json", b"\xff\xfe{}")),
        "not UTF-8",
    ),
    "adapter: lora_alpha a string": (
        lambda w, d: merge(w, d, None, lora_copy(w, d, config=lambda c: c.__setitem__("lora_alpha", "16"))),
        "must be a number",
    ),
    "adapter: alpha_pattern bad regex": (
        lambda w, d: merge(
            w, d, None, lora_copy(w, d, config=lambda c: c.__setitem__("alpha_pattern", {"q_proj(": 4}))
        ),
        "not a valid regex",
    ),
    "adapter: rank_pattern not an object": (
        lambda w, d: merge(w, d, None, lora_copy(w, d, config=lambda c: c.__setitem__("rank_pattern", [4]))),
        "must be a JSON object",
    ),
    "adapter: unsupported PEFT type": (
        lambda w, d: merge(w, d, None, lora_copy(w, d, config=lambda c: c.__setitem__("peft_type", "IA3"))),
        "not supported yet",
    ),
    "adapter: config without weights": (
        lambda w, d: merge(w, d, None, _unlink(lora_copy(w, d), "adapter_model.safetensors")),
        "no adapter_model.safetensors",
    ),
    "adapter: PEFT weights without config": (
        lambda w, d: merge(w, d, None, _unlink(lora_copy(w, d), "adapter_config.json")),
        "adapter_config.json",
    ),
    "adapter: --lora-alpha contradicts the config": (
        lambda w, d: merge(w, d, None, None, "--lora-alpha", "4"),
        "lora_alpha=8",
    ),
    "adapter: two --lora-alpha for one adapter": (
        lambda w, d: merge(w, d, None, None, "--lora-alpha", "8", "--lora-alpha", "8"),
        "give one per adapter",
    ),
    "adapter: pickle without --allow-pickle": (
        lambda w, d: merge(w, d, None, _pickled(lora_copy(w, d))),
        "--allow-pickle",
    ),
    "adapter: an empty folder": (lambda w, d: merge(w, d, None, _mkdir(d / "empty")), "not a recognised adapter"),
    # --- community files --------------------------------------------------------------------------------------------
    "community: unknown tensor names": (
        lambda w, d: merge(w, d, None, community(d, {**kohya(), "foo.bar": torch.zeros(1), "foo.baz": torch.zeros(1)})),
        "not a recognised adapter (keys like foo.bar",
    ),
    "community: doubled prefix": (
        lambda w, d: merge(w, d, None, community(d, kohya("lora_unet_lora_unet_down_blocks_0_proj_in"))),
        "doubled prefix",
    ),
    "community: LyCORIS OFT": (
        lambda w, d: merge(w, d, None, community(d, {**kohya(), "lora_unet_x.oft_blocks": torch.zeros(2, 2)})),
        "OFT",
    ),
    "community: alpha not a scalar": (
        lambda w, d: merge(
            w, d, None, community(d, {**kohya(), "lora_unet_down_blocks_0_attentions_0_proj_in.alpha": torch.ones(2)})
        ),
        "single number",
    ),
    "community: alpha without weights": (
        lambda w, d: merge(w, d, None, community(d, {**kohya(), "lora_unet_mid.alpha": torch.tensor(1.0)})),
        "no weights to merge",
    ),
    "community: LoHa factors that do not multiply": (
        lambda w, d: merge(
            w,
            d,
            None,
            community(
                d,
                {
                    "lora_unet_x.hada_w1_a": torch.ones(4, 2),
                    "lora_unet_x.hada_w1_b": torch.ones(3, 5),
                    "lora_unet_x.hada_w2_a": torch.ones(4, 2),
                    "lora_unet_x.hada_w2_b": torch.ones(2, 5),
                },
            ),
        ),
        "factor shapes do not fit together",
    ),
    "community: LoKr factor with no axes": (
        lambda w, d: merge(
            w, d, None, community(d, {"lora_unet_x.lokr_w1": torch.ones(()), "lora_unet_x.lokr_w2": torch.ones(2, 2)})
        ),
        "must be a matrix",
    ),
    "community: up without down": (
        lambda w, d: merge(w, d, None, community(d, {"lora_unet_x.lora_up.weight": torch.zeros(8, 4)})),
        "lora_down",
    ),
    "community: lora_adapter_metadata not JSON": (
        lambda w, d: merge(
            w,
            d,
            None,
            community(
                d,
                {"unet.x.lora_A.weight": torch.zeros(4, 8), "unet.x.lora_B.weight": torch.zeros(8, 4)},
                {"lora_adapter_metadata": "{nope"},
            ),
        ),
        "lora_adapter_metadata",
    ),
    "community: lora_adapter_metadata alpha a string": (
        lambda w, d: merge(
            w,
            d,
            None,
            community(
                d,
                {"unet.x.lora_A.weight": torch.zeros(4, 8), "unet.x.lora_B.weight": torch.zeros(8, 4)},
                {"lora_adapter_metadata": json.dumps({"lora_alpha": "x"})},
            ),
        ),
        "must be a number",
    ),
    "community: --lora-alpha where the file has alphas": (
        lambda w, d: merge(
            w,
            d,
            None,
            community(d, {**kohya(), "lora_unet_down_blocks_0_attentions_0_proj_in.alpha": torch.tensor(2.0)}),
            "--lora-alpha",
            "4",
        ),
        "drop lora_alpha",
    ),
    # --- recipes ----------------------------------------------------------------------------------------------------
    "recipe: YAML syntax error": (lambda w, d: recipe(d, "base: [unclosed\nadapters: -"), "not valid YAML"),
    "recipe: a YAML list": (lambda w, d: recipe(d, "- a\n- b\n"), "needs a 'base'"),
    "recipe: unknown top-level key": (
        lambda w, d: recipe(d, yaml.safe_dump({"base": str(w["base"]), "adapters": [str(w["lora"])], "dtpye": "x"})),
        "unknown key 'dtpye'",
    ),
    "recipe: unknown adapter key": (
        lambda w, d: recipe(
            d, yaml.safe_dump({"base": str(w["base"]), "adapters": [{"source": str(w["lora"]), "wieght": 1}]})
        ),
        "unknown key 'wieght'",
    ),
    "recipe: weight a string": (
        lambda w, d: recipe(
            d, yaml.safe_dump({"base": str(w["base"]), "adapters": [{"source": str(w["lora"]), "weight": "half"}]})
        ),
        "weight is 'half'",
    ),
    "recipe: include not a list": (
        lambda w, d: recipe(
            d, yaml.safe_dump({"base": str(w["base"]), "adapters": [{"source": str(w["lora"]), "include": "q_proj"}]})
        ),
        "a list of strings",
    ),
    "recipe: adapters a mapping": (
        lambda w, d: recipe(d, yaml.safe_dump({"base": str(w["base"]), "adapters": {"source": str(w["lora"])}})),
        "must be a list",
    ),
    "recipe: adapter without source": (
        lambda w, d: recipe(d, yaml.safe_dump({"base": str(w["base"]), "adapters": [{"weight": 1}]})),
        "needs a 'source'",
    ),
    "recipe: lora_alpha a string": (
        lambda w, d: recipe(
            d, yaml.safe_dump({"base": str(w["base"]), "adapters": [{"source": str(w["lora"]), "lora_alpha": "x"}]})
        ),
        "lora_alpha is 'x'",
    ),
    "recipe: bad include regex": (
        lambda w, d: recipe(
            d, yaml.safe_dump({"base": str(w["base"]), "adapters": [{"source": str(w["lora"]), "include": ["("]}]})
        ),
        "bad include/exclude regex",
    ),
    "recipe: allow_pickle a string": (
        lambda w, d: recipe(
            d, yaml.safe_dump({"base": str(w["base"]), "adapters": [str(w["lora"])], "allow_pickle": "yes"})
        ),
        "allow_pickle is 'yes'",
    ),
    "recipe: not UTF-8": (lambda w, d: ["merge", "--recipe", _write(d / "r.yaml", b"base: \xff\xfe")], "not UTF-8"),
    "recipe: a folder": (lambda w, d: ["merge", "--recipe", _mkdir(d / "r")], "is a folder"),
    # --- convert / verify / push usage ------------------------------------------------------------------------------
    "convert: kohya to PEFT without --base": (
        lambda w, d: ["convert", "--adapter", community(d, kohya()), "--to", "peft"],
        "give --base",
    ),
    "convert: --rank 0": (
        lambda w, d: ["convert", "--adapter", w["lora"], "--to", "kohya", "--rank", "0"],
        "positive rank",
    ),
    "convert: corrupt adapter": (
        lambda w, d: ["convert", "--adapter", st_file(d / "x.safetensors", b"{nope"), "--to", "peft"],
        "not valid JSON",
    ),
    "verify: folder without a recipe": (lambda w, d: ["verify", _mkdir(d / "plain")], "no converter_recipe.yaml"),
    "verify: --adapter without --base": (lambda w, d: ["verify", _mkdir(d / "m"), "--adapter", w["lora"]], "--base"),
    "verify: prompts file missing": (
        lambda w, d: [
            "verify",
            _mkdir(d / "m"),
            "--base",
            w["base"],
            "--adapter",
            w["lora"],
            "--prompts",
            d / "none.txt",
        ],
        "cannot read prompts",
    ),
    "push: repo id with ..": (
        lambda w, d: ["push", "--repo", "../evil", "--from", _mkdir(d / "m")],
        "not a valid repo id",
    ),
}


def _write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path.parent if path.name == "adapter_config.json" else path


def _duplicate_first(data: bytes) -> bytes:
    """The header with its first tensor's entry written twice (JSON parsers keep the last one silently)."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = first_tensor(header)
    raw = b"{" + json.dumps(name).encode() + b": " + json.dumps(header[name]).encode() + b", " + data[9 : 8 + n]
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _unlink(folder: Path, name: str) -> Path:
    (folder / name).unlink()
    return folder


def _truncate(folder: Path) -> Path:
    f = folder / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    return folder


def _pickled(folder: Path) -> Path:
    torch.save(load_file(folder / "adapter_model.safetensors"), folder / "adapter_model.bin")
    (folder / "adapter_model.safetensors").unlink()
    return folder


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_the_catalogue_is_large_enough():
    assert len(CASES) + len(HUB_CASES) >= 40, len(CASES) + len(HUB_CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_input_is_one_line_exit_2_and_writes_nothing(name, world, tmp_path, cli):
    build, message = CASES[name]
    case = tmp_path / "case"
    case.mkdir()
    argv = [str(a) for a in build(world, case)]
    parent = tmp_path / "outputs"
    parent.mkdir()
    (parent / "keep.txt").write_text("mine")
    out = parent / ("result.safetensors" if "kohya" in argv else "result")
    if argv[0] in ("merge", "convert"):
        argv += ["--out", str(out)]
    before, inputs = _listing(parent), _listing(case)
    code, stdout, err = cli(*argv)
    assert code == 2, (name, stdout, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (name, err)
    assert message in lines[0], (name, lines[0])
    assert not out.exists() and _listing(parent) == before, name
    assert _listing(case) == inputs, f"{name}: an input folder was written to"


# --- the Hub: one subprocess against the local Hub server -----------------------------------------------------------

HUB_CASES = {
    "hub: revision not found": (["merge", "--base", "t/base@no-such-branch", "--adapter", "t/lora"], "revision"),
    "hub: repo not found": (["merge", "--base", "t/base", "--adapter", "t/missing-lora"], "repo not found"),
    "hub: file not in repo": (["merge", "--base", "t/base", "--adapter", "t/lora@main/nope.safetensors"], "not found"),
    "hub: adapter given as base": (["merge", "--base", "t/lora", "--adapter", "t/lora"], "adapter"),
    "hub: model given as adapter": (["merge", "--base", "t/base", "--adapter", "t/base"], "adapter_config.json"),
    "hub: hostile file name from the server": (["merge", "--base", "t/base", "--adapter", "t/lora"], "../"),
}


def test_hub_malformed_inputs_in_one_batch(world, tmp_path):
    server = HubServer(tmp_path / "server").start()
    try:
        server.add_user("t", "hf_t_token_for_tests")
        for repo, folder in (("t/base", world["base"]), ("t/lora", world["lora"])):
            server.create_repo(repo)
            server.commit_files(repo, {p.name: p for p in Path(folder).iterdir() if p.is_file()})
        out = tmp_path / "outputs"
        code = f"""
import contextlib, io, json, sys
from pathlib import Path
import huggingface_hub
from converter.cli import main
cases = {json.dumps({k: v[0] for k, v in HUB_CASES.items()})}
real = huggingface_hub.HfApi.model_info
def hostile(self, repo_id, **kw):
    info = real(self, repo_id, **kw)
    if repo_id == "t/lora":
        info.siblings.append(type(info.siblings[0])(rfilename="../outside.safetensors"))
    return info
results = {{}}
for name, argv in cases.items():
    huggingface_hub.HfApi.model_info = hostile if "hostile" in name else real
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv + ["--out", {str(out / "result")!r}, "--no-verify"])
    results[name] = (rc, err.getvalue())
print("RESULT " + json.dumps(results))
"""
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        proc = run_client(server, code, token="hf_t_token_for_tests", home=tmp_path / "home", timeout=300)
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        results = json.loads(line.removeprefix("RESULT "))
    finally:
        server.stop()
    for name, (_, message) in HUB_CASES.items():
        rc, err = results[name]
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, err)
        assert message in lines[0], (name, lines[0])
        assert "hf_t_token_for_tests" not in err
    assert _listing(out) == {"keep.txt": 4}
