"""README.md of an MLX folder or repo: mlx-community's conventions (`library_name: mlx`, the `mlx` tag, `base_model`
pointing at the safetensors model), the proof, and how to load it with mlx-lm."""

from __future__ import annotations

from converter.mlx.proof import FolderProof


def card(fp: FolderProof, base_model: str, name: str, repo_id: str | None = None) -> str:
    """`base_model`: the merged model (a Hub id once pushed); `repo_id`: where this folder is published, if it is."""
    load = repo_id or name
    kind = f"{fp.type} (affine, groups of 64)" if fp.type != "bf16" else "bf16 (not quantized)"
    link = f"[{base_model}](https://huggingface.co/{base_model})" if "/" in base_model else f"`{base_model}`"
    lines = [
        "---",
        f"base_model: {base_model}",
        "library_name: mlx",
        "pipeline_tag: text-generation",
        "tags:",
        "- mlx",
        "- converter",
        "---",
        "",
        f"# {name}",
        "",
        f"{link} in MLX format, {kind}, written as `mlx_lm.convert` writes it and proven by mlx-lm, by converter.",
        "",
        "## Proof",
        "",
    ]
    lines += [f"- {p.name}: {p.verdict}: {p.detail}" for p in fp.parts]
    lines += [
        "",
        "The full proof is in `mlx-proof.json`. Tensors: every tensor read back equals the merged model's (cast as "
        "mlx-lm casts it, quantized by `mx.quantize`); behaviour: `mlx_lm.load` runs seeded token ids on the CPU and "
        "its logits are compared with the merged model's in float32 (torch), within the type's measured limit.",
        "",
        "## Use with mlx",
        "",
        "```bash",
        "pip install mlx-lm",
        "```",
        "",
        "```python",
        "from mlx_lm import load, generate",
        "",
        f'model, tokenizer = load("{load}")',
        'print(generate(model, tokenizer, prompt="hello", verbose=True))',
        "```",
        "",
    ]
    return "\n".join(lines)
