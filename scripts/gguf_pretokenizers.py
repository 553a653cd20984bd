"""Regenerate converter/gguf/pretokenizers.json from llama.cpp's converter (in the llama-cpp-python sdist).

llama.cpp names a BPE tokenizer's pre-tokenizer by hashing the token ids of one fixed text; the table of hashes
lives in its `convert_hf_to_gguf.py` (conversion/base.py, `get_vocab_base_pre`). We identify pre-tokenizers the same
way, so we read the same table as data: the check text and hash -> name, nothing else.

    python scripts/gguf_pretokenizers.py path/to/llama_cpp_python-0.3.36.tar.gz
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tarfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "converter" / "gguf" / "pretokenizers.json"


def table(source: str) -> dict:
    body = source[source.index("def get_vocab_base_pre") :]
    body = body[: body.index("# Marker: End get_vocab_base_pre")]
    text = ast.literal_eval(re.search(r"chktxt = (.+)\n", body).group(1))
    hashes = dict(re.findall(r'if chkhsh == "([0-9a-f]{64})":\s*\n(?:\s*#[^\n]*\n)*\s*res = "([^"]+)"', body))
    return {"text": text, "hashes": hashes}


def main(sdist: str) -> None:
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("vendor/llama.cpp/conversion/base.py"))
        source = tar.extractfile(member).read().decode()
    data = table(source)
    data["source"] = Path(sdist).name
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"{OUT}: {len(data['hashes'])} pre-tokenizers")


if __name__ == "__main__":
    main(sys.argv[1])
