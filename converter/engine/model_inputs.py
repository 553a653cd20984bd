"""The prompts a merged model is run on, their token ids, and a model's float32 logits on them.

Why here, below both: the verification runs the merged model on these inputs, and the GGUF proof compares
llama.cpp's logits on the same ids with the verification's own (ModelLogits) instead of running the model again.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers.",
]
PERPLEXITY_TEXT = (
    "The quick brown fox jumps over the lazy dog. Rivers flow to the sea, and the sea gives back the rain. "
    "Every merge should be checked before it is published."
)


def build_inputs(tok, prompts: list[str], vocab: int):
    """Token ids for each prompt (chat template when there is one); random ids when the model has no tokenizer."""
    import torch

    if tok is None:
        g = torch.Generator().manual_seed(0)
        inputs = [torch.randint(0, vocab, (1, 12 + 3 * i), generator=g) for i in range(len(prompts))]
        return inputs, inputs[0][:, :16], torch.randint(0, vocab, (1, 48), generator=g), False
    template = bool(getattr(tok, "chat_template", None))
    inputs = []
    for prompt in prompts:
        if template:
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = prompt
        inputs.append(tok(text, return_tensors="pt", add_special_tokens=not template).input_ids)
    ppl = tok(PERPLEXITY_TEXT, return_tensors="pt").input_ids
    return inputs, inputs[0][:, :16], ppl, template


@dataclass
class ModelLogits:
    """One model's float32 logits (float32 compute, its weights as stored) on token ids: what a verified merge hands
    a proof that follows (the GGUF behaviour proof) so the merged model is not run again on the same inputs."""

    ids: list[list[int]]
    logits: list  # per row of ids: numpy float32 [positions, vocab]

    @classmethod
    def of(cls, inputs: list, logits: list) -> ModelLogits:
        """From build_inputs' rows ([1, n] tensors) and a run's logits ([n, vocab] float32 tensors)."""
        return cls([row[0].tolist() for row in inputs], [t.numpy() for t in logits])
