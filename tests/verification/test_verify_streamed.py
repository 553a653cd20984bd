"""The behavioural comparison with both models hollow (converter.verification.streamed): its gates hold each file
exactly until the forward's last read of it and hold the merge back while too many output shards wait; the
comparison agrees with loading the models whole, number for number, passes a right merge and fails each sabotage
while the shards arrive one by one, and says why where it cannot run this way.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from model_helpers import make_adapter, make_base

from converter.engine.checkpoint import Checkpoint
from converter.engine.precision import FileTensor
from converter.engine.recipe import recorded_recipe
from converter.engine.writer import OutSpec, Shard
from converter.verification import sources
from converter.verification.llm import LLMCheck, Settings
from converter.verification.report import Clock
from converter.verification.streamed import BaseGate, OutputGate, prepare_streamed


def shard(path: Path) -> Shard:
    return Shard(path, path.name, "", 0, b"", ())


def test_base_gate_lets_each_tensor_go_after_its_last_read_and_unread_ones_at_once(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    gone, waited, over = [], [], []
    spans = {a: [(8, 16), (16, 32), (32, 40)], b: [(8, 24)]}
    gate = BaseGate(spans, lambda path, end: waited.append((path, end)), lambda *key: gone.append(key),
                    lambda: over.append(True))  # fmt: skip
    tied = FileTensor(a, 8, 16, "F32")
    reads = [tied, FileTensor(b, 8, 24, "F32"), FileTensor(a, 16, 32, "F32"), tied]  # a tied weight read twice
    gate.expect(reads)
    assert gone == [(a, 32, 40)]  # nothing reads it: it goes now
    for src in reads:
        assert gate.ready(src) is src
        gate.done(src)
    assert gone == [(a, 32, 40), (b, 8, 24), (a, 16, 32), (a, 8, 16)]  # the tied one after its second read
    assert waited == [(a, 16), (b, 24), (a, 32), (a, 16)] and not over
    gate.open()
    assert over == [True]


def test_output_gate_places_each_tensor_as_its_shard_arrives_and_lets_the_shard_go_after_its_reads(tmp_path):
    from safetensors.torch import save_file

    paths = []
    for i in range(3):
        paths.append(tmp_path / f"s{i}.safetensors")
        save_file({f"t{i}": torch.full((2,), float(i)), f"u{i}": torch.zeros(3)}, paths[-1])
    gate, gone = OutputGate(), []
    gate.expect(["t0", "u0", "t1", "t2", "t2"])  # u1 and u2 are never read; t2 twice (a tied weight)
    gate.arrived(shard(paths[0]), lambda: gone.append(0))
    src = gate.ready("t0")
    assert src.path == paths[0] and src.end - src.start == 8 and not gate.starved
    gate.done("t0")
    assert gone == []  # u0 is still to be read
    gate.done("u0")
    assert gone == [0]
    got = []
    reader = threading.Thread(target=lambda: got.append(gate.ready("t1")), daemon=True)
    reader.start()
    time.sleep(0.2)
    assert gate.starved and not got  # the forward waits for a shard not written yet: the push must go on
    gate.arrived(shard(paths[1]), lambda: gone.append(1))
    reader.join(5)
    assert got[0].path == paths[1] and not gate.starved
    gate.done("t1")
    gate.arrived(shard(paths[2]), lambda: gone.append(2))
    gate.done("t2")
    assert gone == [0, 1]
    gate.done("t2")
    assert gone == [0, 1, 2]


def test_an_opened_gate_lets_everything_go_and_a_waiting_read_gives_up(tmp_path):
    gate, gone = OutputGate(), []
    gate.expect(["never"])
    failed = []

    def reader():
        try:
            gate.ready("never")
        except Exception as e:  # noqa: BLE001
            failed.append(e)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    gate.open()
    thread.join(5)
    assert failed and "never came" in str(failed[0])
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, tmp_path / "late.safetensors")
    gate.arrived(shard(tmp_path / "late.safetensors"), lambda: gone.append("late"))
    assert gone == ["late"]


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    from converter.cli import main

    root = tmp_path_factory.mktemp("streamed")
    base = make_base(root / "base", "llama", dtype=torch.bfloat16)
    lora = make_adapter(base, root / "lora", r=4, lora_alpha=8)
    out = root / "out"
    assert main(["merge", "--base", str(base), "--adapter", str(lora), "--out", str(out), "--no-verify"]) == 0
    return base, out


def streamed(folder: Path, base: Path, bare_base: bool = False):
    """The comparison as a push runs it: the reference built first, then the shards arriving one by one."""
    check, why = prepare_streamed(recorded_recipe(folder), {}, base, None, None, bare_base, lambda _: None)
    assert why is None
    ckpt = Checkpoint(folder)
    check.start(folder, [OutSpec(n, ckpt.info(n).dtype, tuple(ckpt.info(n).shape)) for n in ckpt.names()])
    for f in ckpt.files:
        check.out_gate.arrived(Shard(f.path, f.path.name, "", 0, b"", tuple(f.tensors)), lambda: None)
    return check.finish()


def test_streamed_comparison_equals_the_loaded_models_and_fails_a_sabotage(merged, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    base, out = merged
    behaviour, (problems, _) = streamed(out, base)
    assert not problems
    recipe = recorded_recipe(out)
    b, adapters = sources(recipe, None, base)
    loaded, _ = LLMCheck(out, recipe, b, adapters, Settings(bare_base=False), tmp_path, lambda _: None, Clock()).run()
    assert behaviour.merged_vs_reference == loaded.merged_vs_reference  # the same numbers, bit for bit
    # With the bare base (a row of PEFT's mixed batch), as where no tensor proof has shown what changed.
    behaviour, (problems, _) = streamed(out, base, bare_base=True)
    assert not problems and behaviour.base_vs_reference.mean_kl > 100 * behaviour.merged_vs_reference.mean_kl
    # Nothing merged: the output is the base.
    bad = tmp_path / "nothing-merged"
    shutil.copytree(out, bad)
    save_file(load_file(base / "model.safetensors"), bad / "model.safetensors", metadata={"format": "pt"})
    _, (problems, _) = streamed(bad, base)
    assert problems and "mean KL" in problems[0]


def test_where_it_cannot_stream_it_says_why(merged):
    base, out = merged
    recipe = recorded_recipe(out)
    check, why = prepare_streamed(recipe, {"mode": "full"}, base, None, None, False, lambda _: None)
    assert check is None and "continuations" in why
    check, why = prepare_streamed(recipe, {"memory": 1000}, base, None, None, False, lambda _: None)
    assert check is None and "memory" in why
    check, why = prepare_streamed(replace(recipe, dtype="bnb-nf4"), {}, base, None, None, False, lambda _: None)
    assert check is None and "4-bit" in why


def test_a_quantized_folder_is_compared_loaded_whole(merged, tmp_path):
    import json
    import shutil

    from converter.verification.streamed import Unstreamable, compare_finished

    base, out = merged
    quantized = tmp_path / "q"
    shutil.copytree(out, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    recipe = recorded_recipe(out)
    b, adapters = sources(recipe, None, base)
    with pytest.raises(Unstreamable, match="loaded whole"):
        compare_finished(quantized, recipe, b, adapters, Settings(), lambda _: None, Clock())
