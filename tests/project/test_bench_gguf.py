"""bench/gguf_bench.py on fake numbers (the benchmark itself is never run by tests), and the helper that unpacks
llama.cpp's converter for it and for the GGUF tests."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from converter.testing import llama_convert

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gguf_bench  # noqa: E402
from merge_bench import RunResult  # noqa: E402

INFO = {"date": "today", "cores": "2", "ram": "8 GiB", "cpu": "cpu", "versions": "v", "source": "commit abc"}


def run(name: str, wall: float, cpu: float, peak: float) -> RunResult:
    return RunResult(name, 0, wall, 0.0, peak, Path(f"{name}.log"), cpu_s=cpu, load1=1.0)


def test_arguments_default_to_three_rounds_recorded_and_refuse_zero():
    args = gguf_bench.parse_args([])
    assert (args.rounds, args.small, args.no_record, args.results.name) == (3, False, False, "RESULTS.md")
    args = gguf_bench.parse_args(["--small", "--rounds", "1", "--no-record"])
    assert (args.rounds, args.small, args.no_record) == (1, True, True)
    with pytest.raises(SystemExit) as e:
        gguf_bench.parse_args(["--rounds", "0"])
    assert e.value.code == 2


def test_the_usual_way_adds_its_steps_times_and_keeps_their_largest_peak():
    total = gguf_bench.combine("usual-0", [run("peft", 5, 4, 700), run("convert", 10, 8, 500), run("q", 5, 2, 250)])
    assert (total.wall_s, total.cpu_s, total.peak_rss_mib, total.ok) == (20, 14, 700, True)


def test_logits_are_compared_only_over_the_same_tokens():
    a = np.array([[1.0, 3.0, 2.0], [0.0, 1.0, 5.0]])
    b = np.array([[1.0, 2.5, 2.0], [0.0, 6.0, 5.0]])  # top-1 differs at the second position
    c = gguf_bench.compare_logits([1, 2], a, [1, 2], b)
    assert c["same_tokens"] and c["tokens"] == 2 and c["top1"] == 1
    assert c["max_abs"] == 5.0 and c["span"] == 6.0
    assert c["rel_rms"] == pytest.approx(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))
    assert gguf_bench.compare_logits([1, 2], a, [1, 3], b) == {"same_tokens": False, "tokens": (2, 2)}


def fake_report(converter_walls: list[float], tokens_b: list[int] | None = None, passed: bool = True) -> str:
    runs = {
        "converter": [run(f"c{i}", w, w / 2, 1400) for i, w in enumerate(converter_walls)],
        "usual": [run(f"u{i}", 20, 20, 700) for i in range(len(converter_walls))],
        **{step: [run(step, 5, 5, 300) for _ in converter_walls] for step in gguf_bench.STEPS},
    }
    logits = np.eye(3)
    outputs = {n: {"run": run(n, 1.5, 1, 200), "bytes": 3 * 2**20, "ids": [1, 2, 3], "logits": logits}
               for n in ("converter", "usual", "f16")}  # fmt: skip
    compared = {
        ("converter", "usual"): gguf_bench.compare_logits([1, 2, 3], logits, tokens_b or [1, 2, 3], logits * 0.5),
        ("converter", "f16"): gguf_bench.compare_logits([1, 2, 3], logits, [1, 2, 3], logits),
        ("usual", "f16"): gguf_bench.compare_logits([1, 2, 3], logits * 0.5, [1, 2, 3], logits),
    }
    tensors = {"tensors": 10, "identical": 8, "blocks": 1000, "blocks_differing": 3, "unmatched": 0}
    parts = [{"name": "metadata", "passed": True, "detail": "ok"},
             {"name": "behaviour", "passed": passed, "detail": "differs by 0.03"}]  # fmt: skip
    proof = {"files": [{"file": "m-Q8_0.gguf", "type": "Q8_0", "passed": passed, "parts": parts}], "llama_cpp": True}
    verification = {"verdict": "pass", "seconds": 8.4, "phase_seconds": {"tensor proof": 2.3}}
    return gguf_bench.render(INFO, "python bench/gguf_bench.py", "0.1 B", len(converter_walls), True, runs, outputs,
                             compared, tensors, proof, verification)  # fmt: skip


def test_the_report_gives_medians_and_the_median_of_each_rounds_ratio():
    text = fake_report([10, 12, 30])  # ratios 0.5, 0.6, 1.5 to the usual way's 20 s: the median is 0.6
    assert "wall 0.60x, CPU 0.30x, peak RSS 2.00x**" in text
    assert "| 12.0 s (10.0 / 12.0 / 30.0) | 6.0 s (5.0 / 6.0 / 15.0) | 1400 MiB |" in text  # the median round's
    assert "same top-1 token at 3/3 positions" in text and "max abs difference 0.5" in text
    assert "8 of 10 tensors byte-identical; 3 of 1,000 blocks differ" in text
    assert "m-Q8_0.gguf: **pass** (metadata ok; behaviour ok)" in text and "verification.json): pass, 8.4 s" in text
    assert text.startswith("\n## `converter merge --gguf Q8_0` vs the usual way")
    assert "cold cache, 3 alternating" in text


def test_the_report_says_when_the_files_tokenize_differently_and_when_the_proof_failed():
    text = fake_report([10], tokens_b=[1, 2], passed=False)
    assert "tokenized the prompt differently in the two files (3 and 2 tokens): logits not compared" in text
    assert "**FAIL** (metadata ok; behaviour FAILED)" in text


def test_tensor_data_is_compared_block_by_block(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    changed = w.copy()
    changed[2, 40] += 1.0  # one Q8_0 block of eight

    def write(path: Path, weight: np.ndarray, norm: np.ndarray) -> Path:
        writer = gguf.GGUFWriter(path, "llama")
        writer.add_tensor("w", quantize(weight, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        writer.add_tensor("norm", norm)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    norm = np.ones(64, dtype=np.float32)
    a = write(tmp_path / "a.gguf", w, norm)
    assert gguf_bench.compare_tensors(a, write(tmp_path / "b.gguf", w, norm)) == {
        "tensors": 2, "identical": 2, "blocks": 8 + 64, "blocks_differing": 0, "unmatched": 0}  # fmt: skip
    other = norm.copy()
    other[[3, 9]] = 2.0
    assert gguf_bench.compare_tensors(a, write(tmp_path / "c.gguf", changed, other)) == {
        "tensors": 2, "identical": 0, "blocks": 8 + 64, "blocks_differing": 1 + 2, "unmatched": 0}  # fmt: skip


def fake_sdist(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in ("convert_hf_to_gguf.py", "conversion/__init__.py", "gguf-py/gguf/__init__.py", "src/llama.cpp",
                     "convert_lora_to_gguf.py"):  # fmt: skip
            data = f"# {name}\n".encode()
            info = tarfile.TarInfo(f"llama_cpp_python-0.3.36/vendor/llama.cpp/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_llama_cpps_converter_is_unpacked_alone_once_and_run_from_its_folder(tmp_path):
    sdist = fake_sdist(tmp_path / "sdist.tar.gz")
    root = llama_convert.unpack(sdist, tmp_path / "llama.cpp")
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert found == ["conversion/__init__.py", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py"]
    sdist.unlink()  # unpacked already: the sdist is not read again
    assert llama_convert.unpack(sdist, tmp_path / "llama.cpp") == root
    with pytest.raises(FileNotFoundError, match="sdist missing"):
        llama_convert.unpack(sdist, tmp_path / "elsewhere")
    cmd = llama_convert.command([("f16", tmp_path / "m.gguf", tmp_path / "model")], python="py")
    assert cmd[:2] == ["py", "-c"] and cmd[3:] == ["f16", str(tmp_path / "m.gguf"), str(tmp_path / "model")]
