"""Measure the GGUF behaviour proof's differences on right conversions (the table in docs/gguf.md).

For SmolLM2-135M-Instruct (the test fixture) and for the same model merged with a random LoRA (every factor
~N(0, 0.05), which amplifies any difference in computation), each type is written (ours: F32 / F16 / BF16 / Q8_0;
llama.cpp's quantizer from our F32 file: the K-quants) and run by llama.cpp on the verification texts; printed is the
relative RMS difference of its logits from transformers' (converter.gguf.proof.BEHAVIOUR_LIMIT is set from these).
Needs converter[gguf] and the fixture (`make fixtures`). About 10 minutes on 2 cores. `--tiny` measures the
tests' tiny model of each architecture instead (docs/gguf.md's table of architectures).

    python bench/gguf_thresholds.py [--workdir bench/work/gguf] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]

import conftest  # noqa: E402, F401  (the test suite's environment: offline Hub, passive OpenMP waiters)
from build_fixtures import cache_dir  # noqa: E402
from model_helpers import make_adapter, run_cli  # noqa: E402

from converter.gguf import llama, proof, write  # noqa: E402
from converter.gguf.arch import family_of  # noqa: E402
from converter.gguf.source import open_source  # noqa: E402
from converter.gguf.types import LLAMA_TYPES, PYTHON_TYPES  # noqa: E402


def measure(folder: Path, work: Path, types: list[str]) -> dict[str, float]:
    """Each type's relative RMS difference over the behaviour proof's inputs (and the share of positions whose top
    token is the same), printed as it is measured."""
    src = open_source(folder)
    family = family_of(src.config, folder)
    ref = proof.reference(src, with_logits=True)
    want = np.concatenate([b.ravel() for b in ref.logits])
    out = {}
    for t in ["F32", *(t for t in types if t != "F32")]:  # the K-quants are made from the F32 file
        path = work / f"{folder.name}-{t}.gguf"
        if t in PYTHON_TYPES:
            write.write_gguf(src, family, t, path, name="model")  # (llama.cpp reads "phi3" in a name as Phi-3)
        else:
            llama.quantize(work / f"{folder.name}-F32.gguf", path, t)
        got = llama.logits(path, ref.inputs)
        out[t] = proof._rel(np.concatenate([a.ravel() for a in got]), want)
        top = np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(got, ref.logits, strict=True)]))
        print(f"{folder.name:28s} {t:7s} {out[t]:.2g} ({top:.0%}) (limit {proof.BEHAVIOUR_LIMIT[t]})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=str(ROOT / "bench" / "work" / "gguf"))
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny architectures instead (a minute)")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests" / "gguf"))
        from test_gguf import TINY

        for model_type, make in TINY.items():
            folder = work / "tiny" / model_type
            if not folder.exists():
                make(folder)
            measure(folder, work / "tiny", ["F32", "F16", "BF16", "Q8_0", "Q4_K_M"])
        return
    smollm2 = cache_dir() / "smollm2-135m-instruct"
    merged = work / "smollm2-random-lora"
    if not merged.exists():
        lora = make_adapter(smollm2, work / "lora", r=4,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])  # fmt: skip
        assert run_cli("merge", "--base", smollm2, "--adapter", lora, "--out", merged, "--no-verify") == 0
    for folder in (smollm2, merged):
        measure(folder, work, PYTHON_TYPES + LLAMA_TYPES)


if __name__ == "__main__":
    main()
