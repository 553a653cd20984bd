"""`push --gguf TYPES` (and the Space's GGUF choice): the proven GGUF files in a repo of their own, `<repo>-GGUF`,
in one commit, with a card in the Hub's GGUF conventions.

Why a separate repo: that is where the Hub and its users look for GGUF files of a model (the `gguf` tag, a
`base_model` pointing at the safetensors repo, one file per type), and it keeps the safetensors repo loadable by
transformers as it is. The files are written and proven before anything is uploaded, so a failed proof pushes
nothing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from converter.gguf.export import PROOF_FILE, GGUFResult, export, file_stem
from converter.gguf.stream import GGUFTee


def gguf_repo(repo_id: str) -> str:
    return f"{repo_id}-GGUF"


def card(result: GGUFResult, base_repo: str, gguf_repo_id: str) -> str:
    """README.md of the GGUF repo: front matter (gguf tag, base_model), the files, the proof, how to run them."""
    lines = [
        "---",
        f"base_model: {base_repo}",
        "library_name: gguf",
        "tags:",
        "- gguf",
        "- llama.cpp",
        "- converter",
        "---",
        "",
        f"# {gguf_repo_id.split('/')[-1]}",
        "",
        f"GGUF files of [{base_repo}](https://huggingface.co/{base_repo}) for llama.cpp, Ollama and LM Studio, written "
        "and proven by converter.",
        "",
        "| file | type | size | proof |",
        "|---|---|---|---|",
    ]
    for path, fp in zip(result.files, result.proofs, strict=True):
        verdict = "passed" if fp.passed else "FAILED"
        checked = ", ".join(p.name for p in fp.parts if p.judged)
        lines.append(f"| `{path.name}` | {fp.type} | {path.stat().st_size / 1e6:.1f} MB | {verdict} ({checked}) |")
    lines += ["", "## Proof", ""]
    for fp in result.proofs:
        lines.append(
            f"- `{fp.name}`: "
            + "; ".join(f"{p.name}{'' if p.judged else ' (not judged)'}: {p.detail}" for p in fp.parts)
        )
    if not result.llama_proof:
        lines.append("- llama.cpp's tokenizer and behaviour checks did not run (llama-cpp-python not installed).")
    lines += [
        "",
        f"The full proof is in `{PROOF_FILE}`. Tensors: read back with gguf's reader and compared with the source "
        "model's, exactly for F32 / F16 / BF16 / Q8_0, within the quantization error for llama.cpp's K-quants; "
        "tokenizer: llama.cpp's tokens equal transformers'; behaviour: llama.cpp's logits against transformers'.",
        "",
        "## Run it with llama.cpp",
        "",
        "```",
        f"llama-cli -hf {gguf_repo_id}:{result.proofs[0].type}",
        f"llama-server -hf {gguf_repo_id}:{result.proofs[0].type}",
        "```",
        "",
    ]
    return "\n".join(lines)


def push_gguf(result: GGUFResult, base_repo: str, *, token: str | None, private: bool,
              log: Callable[[str], None]):  # fmt: skip
    """Upload the exported folder (files, proof, card) to `<base_repo>-GGUF` in one commit."""
    from converter.hub.publish import push_folder

    repo_id = gguf_repo(base_repo)
    folder = Path(result.out)
    (folder / "README.md").write_text(card(result, base_repo, repo_id))
    json.loads((folder / PROOF_FILE).read_text())  # written by export: present and whole
    return push_folder(folder, repo_id, token=token, private=private, overwrite=True,
                       message="Upload GGUF files (converter)", log=log)  # fmt: skip


class PendingGGUF:
    """The files for `<repo>-GGUF`, written and proven in a temporary folder before anything is committed.

    A merging push has its merged folder only inside the push: `export` runs there, as the push's `finished` hook
    just before its commit, so a failed proof raises and neither repo gets a commit; the files we write ourselves
    are written during its merge by `tee()` (converter.gguf.stream), `export` proves them. `push` after the
    model's own push; `discard` in every case."""

    def __init__(self, types: list[str], name: str, log: Callable[[str], None], workdir: str | Path | None = None):
        self.types, self.name, self.log = types, name, log
        self.out = Path(tempfile.mkdtemp(prefix="converter-gguf-push-", dir=workdir)) / "gguf"
        self.result: GGUFResult | None = None
        self._tee: GGUFTee | None = None

    def tee(self) -> GGUFTee:
        """For the push's merge: the files written as it streams."""
        self._tee = GGUFTee(self.types, self.out, file_stem(self.name), self.log)
        return self._tee

    def export(self, folder: str | Path, report=None) -> None:
        """`report`: the merge's verification, whose logits of the merged model the behaviour proof reuses."""
        written = self._tee.finish() if self._tee is not None else None
        logits = getattr(report, "merged_logits", None)
        self.result = export(folder, self.types, self.out, name=self.name, log=self.log, written=written,
                             merged_logits=logits)  # fmt: skip

    def push(self, base_repo: str, *, token: str | None, private: bool):
        if self.result is None:
            raise RuntimeError("GGUF files pushed before they were written")
        return push_gguf(self.result, base_repo, token=token, private=private, log=self.log)

    def discard(self) -> None:
        if self._tee is not None:
            self._tee.discard()
        shutil.rmtree(self.out.parent, ignore_errors=True)
