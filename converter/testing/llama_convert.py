"""llama.cpp's own `convert_hf_to_gguf.py`, taken from llama-cpp-python's source distribution.

Why here: the GGUF tests use it as the oracle converter's files must equal, and bench/gguf_bench.py runs it as the
usual way to a GGUF; both unpack and run it the same way. The script needs its `conversion/` and `gguf-py/` beside it
(not the installed `gguf` package: the pair is versioned together) and must run from that folder.

Usage::

    root = unpack(default_sdist(), tmp / "llama.cpp")
    subprocess.run(command([("f16", tmp / "model-F16.gguf", folder)]), cwd=root, check=True)
"""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

SDIST_ENV = "CONVERTER_LLAMA_SDIST"
SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
_VENDOR = "/vendor/llama.cpp/"

# Several conversions in one process: the converter's imports alone cost ~15 s.
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


def default_sdist() -> Path:
    """Where `make test` caches the sdist, unless CONVERTER_LLAMA_SDIST names another file."""
    return Path(os.environ.get(SDIST_ENV, Path.home() / ".cache" / "converter-llama-sdist" / SDIST_NAME))


def unpack(sdist: Path, dest: Path) -> Path:
    """The converter script with its `conversion/` and `gguf-py/`, extracted under `dest`; returns the folder to run
    it from (`.../vendor/llama.cpp`). An earlier unpacking in `dest` is reused."""
    found = next(Path(dest).glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"), None) if Path(dest).is_dir() else None
    if found is not None:
        return found.parent
    if not Path(sdist).is_file():
        raise FileNotFoundError(f"llama-cpp-python's sdist missing at {sdist}: `make test` downloads it (or set "
                                f"{SDIST_ENV})")  # fmt: skip
    Path(dest).mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if _VENDOR in m.name
                   and m.name.split(_VENDOR, 1)[1].startswith(_WANTED)]  # fmt: skip
        tar.extractall(dest, members=members, filter="data")
    return next(Path(dest).glob("*/vendor/llama.cpp"))


def command(jobs: list[tuple[str, Path, Path]], python: str = sys.executable) -> list[str]:
    """The command that runs the converter on each (outtype, out file, model folder), in one process; run it with
    `cwd` the folder `unpack` returned."""
    return [python, "-c", RUN_CONVERTER, *(str(x) for job in jobs for x in job)]
