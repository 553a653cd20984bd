"""`push --gguf TYPES` for a diffusion model: the proven GGUF files in `<repo>-GGUF`, in one commit, with a card
that lists the types and their sizes and says how ComfyUI and diffusers load them.

Why a repo of its own: that is where people look for a model's GGUF files (one file per type, the `gguf` tag,
`base_model` pointing at the safetensors repo), as for language models (converter.gguf.publish).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from converter.gguf.diffusion_export import PROOF_FILE, DiffusionResult, export
from converter.gguf.diffusion_run import UNETS
from converter.gguf.publish import gguf_repo

# diffusers' class for an architecture that only one family is written as; where several are (flux: Flux.1 and
# Flux.2; wan: Wan, SkyReels V2, ChronoEdit; ltxv: LTX-Video and LTX-2; lumina2: Lumina 2 and Z-Image) the card
# names the class the behaviour proof ran, or none
DIFFUSERS_CLASS = {
    "sd3": "SD3Transformer2DModel", "hidream": "HiDreamImageTransformer2DModel",
    "hyvid": "HunyuanVideoTransformer3DModel", "qwen_image": "QwenImageTransformer2DModel",
}  # fmt: skip


def card(result: DiffusionResult, base_repo: str, repo_id: str) -> str:
    """README.md of the GGUF repo: front matter, the files with type and size, the proof, how to load them."""
    unet = result.arch in UNETS
    lines = ["---", f"base_model: {base_repo}", "library_name: gguf", "tags:", "- gguf", "- comfyui",
             *([] if unet else ["- diffusers"]), "- converter", "---", "", f"# {repo_id.split('/')[-1]}", "",
             f"GGUF files of the {result.arch} denoiser of [{base_repo}](https://huggingface.co/{base_repo}) for "
             f"ComfyUI (ComfyUI-GGUF){'' if unet else ' and diffusers'}, written and proven by converter.", "",
             "| file | type | size | proof |", "|---|---|---|---|"]  # fmt: skip
    for path, fp in zip(result.files, result.proofs, strict=True):
        checked = ", ".join(p.name for p in fp.parts if p.judged)
        verdict = "passed" if fp.passed else "FAILED"
        lines.append(f"| `{path.name}` | {fp.type} | {path.stat().st_size / 1e6:.1f} MB | {verdict} ({checked}) |")
    lines += ["", "## Proof", ""]
    for fp in result.proofs:
        lines.append(f"- `{fp.name}`: " + "; ".join(
            f"{p.name}{'' if p.judged else ' (not judged)'}: {p.detail}" for p in fp.parts))  # fmt: skip
    lines += [
        "", f"The full proof is in `{PROOF_FILE}`.", "", "## ComfyUI", "",
        "Install ComfyUI-GGUF, put a file in `ComfyUI/models/unet`, and load it with the **Unet Loader (GGUF)** node "
        "(`UnetLoaderGGUF`); the text encoders and the VAE load with their usual nodes.", "", "## diffusers", "",
        *_diffusers_lines(result, repo_id), "",
    ]  # fmt: skip
    return "\n".join(lines)


def _diffusers_lines(result: DiffusionResult, repo_id: str) -> list[str]:
    """How diffusers loads a file: through the class the proof ran it as, or the architecture's only one; else in
    words (a wrong class name would load the wrong model); a UNet's files it does not load."""
    if result.arch in UNETS:
        return ["diffusers' GGUF loader does not load these files: it takes each tensor as stored, and the UNet's "
                "tensors stored as rows of 256 need the original shapes ComfyUI-GGUF records "
                "(`comfy.gguf.orig_shape.*`). The proof ran them in diffusers put back at those shapes, as "
                "ComfyUI-GGUF's loader does."]  # fmt: skip
    cls = result.diffusers_class or DIFFUSERS_CLASS.get(result.arch)
    if cls is None:
        return ["diffusers reads these files with its GGUF loader: the model family's transformer class, "
                "`from_single_file(..., quantization_config=GGUFQuantizationConfig(...))`."]  # fmt: skip
    return ["```python", "import torch", f"from diffusers import GGUFQuantizationConfig, {cls}", "",
            f'model = {cls}.from_single_file("https://huggingface.co/{repo_id}/blob/main/{result.files[0].name}",',
            "    quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16))", "```"]  # fmt: skip


class PendingDiffusionGGUF:
    """PendingGGUF's interface (converter.gguf.publish) for a diffusion model: nothing is written while the merge
    streams (`tee` is None); `export` writes and proves the files from the merged single file before the model's
    commit, `push` publishes them after it, `discard` in every case."""

    def __init__(self, types: list[str], name: str, log: Callable[[str], None], workdir: str | Path | None = None):
        self.types, self.name, self.log = types, name, log
        self.out = Path(tempfile.mkdtemp(prefix="converter-gguf-push-", dir=workdir)) / "gguf"
        self.result: DiffusionResult | None = None

    def tee(self) -> None:
        return None

    def export(self, folder: str | Path, report=None) -> None:
        """`report` (the merge's verification) is not read: the diffusion proof runs diffusers on the file itself."""
        self.result = export(folder, self.types, self.out, name=self.name, log=self.log)

    def push(self, base_repo: str, *, token: str | None, private: bool):
        from converter.hub.publish import push_folder

        if self.result is None:
            raise RuntimeError("GGUF files pushed before they were written")
        repo_id = gguf_repo(base_repo)
        (self.out / "README.md").write_text(card(self.result, base_repo, repo_id))
        return push_folder(self.out, repo_id, token=token, private=private, overwrite=True,
                           message="Upload GGUF files (converter)", log=self.log)  # fmt: skip

    def discard(self) -> None:
        shutil.rmtree(self.out.parent, ignore_errors=True)
