"""The proof of a GGUF file, in three parts, each naming what is wrong when it fails.

1. Tensors: the file read back with gguf's reader and put back in Hugging Face row order equals the source:
   F32 / F16 / BF16 bit for bit as cast, Q8_0 bit-identical to gguf's reference quantization of the same tensor
   (stored bytes compared: no dequantization, no float comparison); in a K-quant file each tensor dequantized and
   within its type's measured quantization error (bit for bit where llama.cpp kept it F32 / F16 / Q8_0). Every
   source tensor is there, nothing else is; the metadata llama.cpp reads for shapes, rope and the vocabulary agrees
   with config.json.
2. Tokenizer: llama.cpp's tokenization equals transformers' on the prompts, on text with the special tokens, and
   on the rendered chat template.
3. Behaviour: llama.cpp's logits against transformers' logits of the source model on the same token ids; the
   relative RMS difference stays under a threshold per type, measured from right conversions (BEHAVIOUR_LIMIT).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from converter import outcome
from converter.engine.model_inputs import PROMPTS, ModelLogits, build_inputs
from converter.errors import BadInputError
from converter.gguf import arch, llama
from converter.gguf.source import Source
from converter.gguf.write import QTYPE, Written, _stored_type, digest
from converter.io.same_bytes import same_bytes

# where pre-tokenizers differ: digit runs, runs of spaces and newlines, contractions, punctuation, non-ASCII
MIXED_TEXT = "In 2024, 1234567 users paid $3.50 each.\n\n   def f(x):\n\treturn x**2  # it's done! Ça coûte 10€."
# Relative RMS difference of llama.cpp's logits from transformers' (float32) over all positions of all inputs, per
# file type. Measured on right conversions of two models (docs/gguf.md has the table): SmolLM2-135M-Instruct, and the
# same merged with a random LoRA (every factor ~N(0, 0.05): far from its training, it amplifies any difference in
# computation). Each limit is at least 2x the larger of the two. llama.cpp computes with float16 KV caches
# and, for quantized types, quantized activations, so even F32 is not exact. A Q/K row order left as Hugging Face's
# measured 0.67 and a 10x wrong rope base 0.11 (SmolLM2, F32): the float types catch both by behaviour alone; for the
# quantized types the tensor and metadata proofs are what catch them.
BEHAVIOUR_LIMIT = {
    "F32": 0.01, "F16": 0.01, "BF16": 0.07, "Q8_0": 0.45, "Q6_K": 0.8, "Q5_K_M": 0.9, "Q5_K_S": 0.9,
    "Q5_0": 0.9, "Q4_K_M": 0.9, "Q4_K_S": 0.9, "Q4_0": 1.5,
}  # fmt: skip
# Relative RMS error of one dequantized tensor against its source, per stored ggml type (K-quant files only; the
# types we write are checked exactly). Measured on SmolLM2's weights: the worst tensor of each type is at most about
# 40% of its limit (Q6_K 0.018, Q5_0 / Q5_1 0.053, Q4_0 0.10).
TENSOR_LIMIT = {
    "Q6_K": 0.05, "Q5_K": 0.13, "Q5_0": 0.13, "Q5_1": 0.13, "Q4_K": 0.26, "Q4_0": 0.26, "Q4_1": 0.26,
}  # fmt: skip
EXACT = {"F32", "F16", "BF16", "Q8_0"}
# A MoE layer sends each position to the experts with the k largest router logits. Where the k-th and the next are
# nearly tied, llama.cpp's slightly different arithmetic may choose the other expert, and that position's logits (and,
# through attention, the later ones') then differ by far more than the type's limit although the file is right (a
# tiny Mixtral in F32: a gap of 5e-4 against router logits of about 1 flipped, and that position read 0.05). A text
# is compared up to its first position whose gap, in any layer, is below ROUTER_TIE[type] x the layer's RMS router
# logit: the positions before it are computed from the same experts in both (attention is causal). Each value is
# about 4x the relative error the type's rounding puts on a router logit (F32 and F16: 4x the gap that flipped). Only
# the float types leave near ties out: a flip's error is far inside a quantized type's limit (right files on tiny
# Mixtral, Qwen2-MoE and Qwen3-MoE with router LoRAs read at most 0.073 in Q8_0 over every position, limit 0.45),
# while cutting texts short there hid sabotages the whole texts catch (bench/README.md).
ROUTER_TIE = {"F32": 0.002, "F16": 0.002, "BF16": 0.01}


Part = outcome.ProofPart  # one part of a file's proof


class FileProof(outcome.PartsProof):
    """One GGUF file's proof."""

    def as_proofs(self) -> outcome.Proofs:
        """For a verb's outcome (converter.outcome); what a failed file's VerificationFailed reports."""
        return outcome.Proofs(gguf=(self.summary(),))


@dataclass
class Reference:
    """What transformers says about the source, computed once for every file: token ids and float32 logits."""

    texts: list[tuple[str, str, bool]]  # (what, text, add special tokens): the tokenizer proof's
    ids: list[list[int]]
    # the behaviour proof's token ids: the verification's inputs (each prompt as the model is prompted: through its
    # chat template where it has one), so a verified merge's own float32 logits of the merged model serve as these;
    # a MoE model's are the texts with ids (their near ties of a router are found by a forward of their own)
    inputs: list[list[int]] = field(default_factory=list)
    logits: list[np.ndarray] | None = None  # per input
    # MoE models: per input, each position's smallest router gap over the layers, relative (see ROUTER_TIE)
    router_gaps: list[np.ndarray] | None = None
    # A SentencePiece tokenizer that transformers reads with Metaspace: per text, the ids with llama.cpp's (and
    # SentencePiece's) "▁" before every piece of text (vocab.sentencepiece_convention); the one difference the
    # tokenizer proof accepts, and states
    spm_ids: list[list[int]] | None = None

    def compared(self, type_name: str) -> list[int]:
        """How many leading positions of each input the behaviour proof compares for this type."""
        lengths = [len(i) for i in self.inputs]
        if self.router_gaps is None or type_name not in ROUTER_TIE:
            return lengths
        ties = [np.flatnonzero(g < ROUTER_TIE[type_name]) for g in self.router_gaps]
        return [int(t[0]) if t.size else n for t, n in zip(ties, lengths, strict=True)]


def reference(source: Source, with_logits: bool, merged: ModelLogits | None = None) -> Reference:
    """The tokenizer proof's texts and ids, and the behaviour proof's inputs and their float32 logits: `merged`'s
    (the merged model's logits from its verification, converter.engine.model_inputs.ModelLogits) where they are of
    these inputs and no router gaps are needed, else computed here."""
    from converter.gguf.vocab import load_tokenizer, prepends_per_piece, sentencepiece_convention

    tok = load_tokenizer(source.folder)
    specials = " ".join(t for t in tok.all_special_tokens)
    texts = [(f"prompt {i + 1}", p, True) for i, p in enumerate(PROMPTS)]
    texts.append(("special tokens", f"{specials} hello {specials}", True))
    texts.append(("digits and spaces", MIXED_TEXT, True))
    if tok.chat_template:
        messages = [{"role": "user", "content": PROMPTS[0]}]
        texts.append(("chat template", tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                      False))  # fmt: skip
    ids = [tok(text, add_special_tokens=special)["input_ids"] for _, text, special in texts]
    vocab_size = int(source.config.get("vocab_size") or 0)
    experts = int(source.config.get("num_experts_per_tok") or 0)
    if experts:  # the texts: they begin differently (a router's near tie in a shared chat prefix would end them all)
        inputs = [i for i in ids if i]
    else:
        inputs = [row[0].tolist() for row in build_inputs(tok, PROMPTS, vocab_size)[0]]
    if vocab_size and max(max(i, default=0) for i in [*ids, *inputs]) >= vocab_size:
        raise BadInputError(f"{source.folder}: the tokenizer gives ids beyond the model's vocab_size {vocab_size}",
                            file=source.folder)  # fmt: skip
    ref = Reference(texts, ids, inputs)
    if prepends_per_piece(tok):
        ref.spm_ids = [sentencepiece_convention(tok, text, special) for _, text, special in texts]
    if with_logits and merged is not None and merged.ids == inputs and not experts:
        ref.logits = merged.logits
    elif with_logits:
        ref.logits, ref.router_gaps = _float32_logits(source, inputs, experts)
    return ref


def _float32_logits(source: Source, ids: list[list[int]],
                    experts: int) -> tuple[list[np.ndarray], list[np.ndarray] | None]:  # fmt: skip
    """transformers' logits of the source on each of `ids`, computing in float32, its weights left in their files
    and read one layer at a time (converter.engine.precision): the results of a float32 load, with memory that does
    not grow with the model (a float32 load of an 8 B model would take 32 GB). The model is built hollow where its
    weights are the files' tensors as they are (converter.engine.hollow), else loaded by transformers. For a MoE model
    also each position's router gaps (`Reference.router_gaps`)."""
    import torch

    from converter.engine.hollow import causal_lm_reading_files, release_heap
    from converter.engine.precision import float32_compute

    model, sources = causal_lm_reading_files(source.folder, source.config)
    with torch.no_grad(), float32_compute(model, sources):
        out = batched_logits(model, ids, experts)
    del model
    release_heap()
    return out


def batched_logits(model, ids: list[list[int]], experts: int) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """A causal LM's logits on each of `ids` in one batch, padded on the right: the weights are read once, and a
    causal model's real positions never see the padding (each text's logits are those of running it alone, to
    float32 summation order). With `experts` (a MoE model's experts per token), also each position's smallest router
    gap over the layers: the k-th largest router logit minus the next, relative to the layer's RMS router logit over
    the real positions (`Reference.router_gaps`)."""
    import torch

    n = max(len(i) for i in ids)
    batch = torch.tensor([i + [0] * (n - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (n - len(i)) for i in ids])
    routed = {"output_router_logits": True} if experts else {}
    out = model(input_ids=batch, attention_mask=mask, **routed)
    logits = [out.logits[k, : len(i)].float().numpy() for k, i in enumerate(ids)]
    if not experts:
        return logits, None
    real = mask.bool()
    gaps = []
    for layer in out.router_logits:  # (texts x positions, experts) each
        layer = layer.float().reshape(len(ids), n, -1)
        top = layer.topk(experts + 1, dim=-1).values
        gaps.append((top[..., experts - 1] - top[..., experts]) / layer[real].pow(2).mean().sqrt().clamp_min(1e-30))
    smallest = torch.stack(gaps).amin(0)
    return logits, [smallest[k, : len(i)].numpy() for k, i in enumerate(ids)]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _read_back(t) -> np.ndarray:
    data = np.asarray(t.data)
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, t.tensor_type)


def _same_bits(data: np.ndarray, want: np.ndarray, to_hf) -> bool:
    """Whether the file's bytes of a tensor are `want`'s (the reference cast or quantization of the source, in
    Hugging Face row order): `to_hf` puts the file's rows back in that order first, each row's bytes with it (every
    type we write stores a row as whole blocks). Bits, not values: no NaN or signed-zero leniency, and no
    dequantization."""
    got, want = np.ascontiguousarray(data).view(np.uint8), np.ascontiguousarray(want).view(np.uint8)
    if got.size != want.size:
        return False
    if to_hf is not None:
        got = to_hf(got.reshape(len(want), -1))
    return same_bytes(got, want)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def prove_tensors(reader: gguf.GGUFReader, source: Source, family: arch.Family, type_name: str,
                  written: Written | None = None) -> Part:  # fmt: skip
    """Part 1: every source tensor, read back from the file, against the reference cast / quantization. With
    `written` (the file `reader` reads, and the digests of the reference's bytes in Hugging Face row order, made as
    they were written: converter.gguf.write.Written), a tensor whose bytes, read from the file and put back in that
    order, hash the same is proven without reading the source again; any other is compared with the source read
    now, which also names what differs."""
    found = {t.name: t for t in reader.tensors}
    n = arch.block_count(source.config)
    tmap = gguf.get_tensor_name_map(family.arch, n)
    expected: set[str] = set()
    worst = (0.0, "")
    for hf_name, members in arch.tensor_groups(source.tensors, source.config, family, source.folder).items():
        if hf_name.endswith(arch.SKIPPED):
            continue
        if family.tied_head and hf_name == family.tied_head[0]:
            embeddings = family.tied_head[1]
            if embeddings not in source.tensors or not np.array_equal(source.read(hf_name), source.read(embeddings)):
                return Part("tensors", False, f"{hf_name} differs from {embeddings}: llama.cpp's "
                            f"{arch.arch_name(family)} takes its output head from the token embeddings")  # fmt: skip
            continue
        name = arch.gguf_name(hf_name, tmap, source.folder)
        expected.add(name)
        if name not in found:
            return Part("tensors", False, f"{name} ({hf_name}) is missing from the file")
        t = found[name]
        stacked = members != (hf_name,)  # a MoE layer's experts, one (experts, out, in) tensor
        transform = None if stacked else arch.transform(hf_name, source.config, family)
        shape = (len(members), *source.tensors[members[0]].shape) if stacked else source.tensors[hf_name].shape
        shape = transform.shape(shape) if transform else shape
        stored_shape = tuple(int(d) for d in reversed(t.shape))
        if _squeezed(stored_shape) != _squeezed(shape):  # llama.cpp's quantizer drops outer 1s: (1, n) -> (n,)
            return Part("tensors", False, f"{name} ({hf_name}) has shape {stored_shape}, expected {shape}")
        kind = t.tensor_type.name
        if type_name in QTYPE:
            want_type = _stored_type(name, shape, QTYPE[type_name], n)
            if t.tensor_type != want_type:
                return Part("tensors", False, f"{name} is stored as {kind}, expected {want_type.name}")
        to_hf = transform.to_hf if transform else None
        if written and kind in EXACT and (transform is None or to_hf) and \
                _digests_agree(written, t, members, to_hf, shape[0]):  # fmt: skip
            continue
        failed, closeness = _against_source(t, name, hf_name, members, source, transform, shape)
        if failed is not None:
            return failed
        worst = max(worst, closeness)
    for name, made in arch.extra_tensors(source.config, family).items():
        expected.add(name)
        if name not in found or not np.array_equal(_read_back(found[name]).ravel(), made):
            return Part("tensors", False, f"{name} (rope scaling, from config.json) is missing or wrong")
    extra = sorted(set(found) - expected)
    if extra:
        return Part("tensors", False, f"{extra[0]} is in the file but comes from no source tensor")
    how = (
        "equal to the source as cast / reference-quantized"
        if type_name in QTYPE
        else f"within their types' quantization error (closest to a limit: {worst[1]})"
    )
    return Part("tensors", True, f"{len(expected)} tensors, {how}")


def _digests_agree(written: Written, t, members: tuple[str, ...], to_hf, rows: int) -> bool:
    """Whether the file's bytes of `t`, its `rows` put back in Hugging Face order by `to_hf` (each expert's slice
    of a stacked tensor on its own), hash as the reference's did when it was written. The bytes are read from the
    file, not from the reader's memory map: memory holds one tensor, not the file's pages, while the proof goes on."""
    if any(m not in written.digests for m in members):
        return False
    data = np.fromfile(written.path, np.uint8, int(t.n_bytes), offset=int(t.data_offset))
    if to_hf is not None:
        data = to_hf(data.reshape(rows, -1))
    parts = data.reshape(len(members), -1)
    return all(digest(part) == written.digests[m] for part, m in zip(parts, members, strict=True))


def _against_source(t, name: str, hf_name: str, members: tuple[str, ...], source: Source, transform,
                    shape: tuple[int, ...]) -> tuple[Part | None, tuple[float, str]]:  # fmt: skip
    """One tensor of the file against the source read now: a failing Part or None, and for a K-quant how close
    it came to its limit."""
    stacked = members != (hf_name,)
    src = np.stack([source.read(m) for m in members]) if stacked else source.read(hf_name)
    order, to_hf = "in Hugging Face row order", transform.to_hf if transform else None
    if transform and not to_hf:  # a change of values or layout: the source as llama.cpp stores it
        src, order = transform.to_gguf(src), "as llama.cpp stores it"
    kind = t.tensor_type.name
    if kind in EXACT:
        want = src if kind == "F32" else gguf.quants.quantize(src, t.tensor_type)
        if not _same_bits(t.data, want, to_hf):
            got = _read_back(t).reshape(shape)
            got = to_hf(got) if to_hf else got
            bad = int(np.sum(got != gguf.quants.dequantize(want, t.tensor_type).reshape(shape)))
            return Part("tensors", False, f"{name} ({hf_name}): {bad} values differ from the source as {kind} "
                        f"({order})"), (0.0, "")  # fmt: skip
        return None, (0.0, "")
    got = _read_back(t).reshape(shape)
    got = to_hf(got) if to_hf else got
    limit = TENSOR_LIMIT.get(kind)
    rel = _rel(got, src)
    if limit is None or not rel <= limit:
        return Part("tensors", False, f"{name} ({hf_name}) as {kind}: relative error {rel:.3g} "
                    f"(limit {limit})"), (0.0, "")  # fmt: skip
    return None, (rel / limit, f"{name} {kind} {rel:.3g}")


def prove_metadata(reader: gguf.GGUFReader, source: Source, family: arch.Family) -> Part:
    """The keys llama.cpp sizes and runs the model by, against config.json (names the key that differs)."""
    a, c = arch.arch_name(family), source.config

    def value(key: str):
        f = reader.get_field(key)
        return None if f is None else f.contents()

    want = {"general.architecture": a, **arch.expected_metadata(c, family)}
    for key, expected in want.items():
        got = value(key)
        if got is None or (isinstance(expected, float) and not np.isclose(got, expected, rtol=1e-6)) or \
                (not isinstance(expected, float) and got != expected):  # fmt: skip
            return Part("metadata", False, f"{key} is {got!r}, config.json says {expected!r}")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != c["vocab_size"]:
        got = None if tokens is None else len(tokens.data)
        return Part("metadata", False, f"tokenizer.ggml.tokens has {got} tokens, config.json's vocab_size is "
                    f"{c['vocab_size']}")  # fmt: skip
    return Part("metadata", True, f"{len(want) + 1} keys agree with config.json")


def _piece(vocab, ids: list[int], i: int) -> str:
    if i >= len(ids):
        return "(end)"
    return repr(vocab.detokenize(ids[i : i + 1], special=True).decode(errors="replace"))


SPM_SPACE = (
    "llama.cpp puts a space before the text after each special token and before a text that starts with one, as "
    "SentencePiece does and transformers' Metaspace reading of this tokenizer does not"
)


def prove_tokenizer(path: Path, ref: Reference) -> Part:
    """Part 2: llama.cpp's token ids against transformers', text by text; names the first token that differs. A
    text that differs only by SentencePiece's space (`Reference.spm_ids`, a Metaspace reading) passes, named."""
    vocab = llama.tokenizer(path)
    spaced: list[str] = []
    try:
        for k, ((what, text, special), want) in enumerate(zip(ref.texts, ref.ids, strict=True)):
            got = vocab.tokenize(text.encode(), add_bos=special, special=True)
            if got != want and ref.spm_ids is not None and got == ref.spm_ids[k]:
                spaced.append(what)
            elif got != want:
                pairs = enumerate(zip(got, want, strict=False))
                i = next((k for k, (x, y) in pairs if x != y), min(len(got), len(want)))
                return Part("tokenizer", False, f"{what}: token {i} is {_piece(vocab, got, i)} in llama.cpp, "
                            f"{_piece(vocab, want, i)} in transformers ({len(got)} vs {len(want)} tokens)")  # fmt: skip
    finally:
        vocab.close()
    detail = f"{len(ref.texts)} texts tokenized alike (special tokens, chat template included)"
    if spaced:
        alike = len(ref.texts) - len(spaced)
        detail = (f"{alike} texts tokenized alike; on {len(spaced)} ({', '.join(spaced)}) {SPM_SPACE}, and the "
                  "tokens are otherwise the same")  # fmt: skip
    return Part("tokenizer", True, detail)


def prove_behaviour(path: Path, ref: Reference, type_name: str, lora: Path | None = None) -> Part:
    """Part 3: llama.cpp's logits against the reference logits on the same ids (`Reference.inputs`): the relative
    RMS difference over all positions of all inputs (per input it is noisy for the low-bit types), limit per type.
    With `lora` (an adapter GGUF applied at run time on the base GGUF `path`), the reference is PEFT's base +
    adapter, unmerged."""
    got = llama.logits(path, ref.inputs, lora=lora)
    for k, (a, b) in enumerate(zip(got, ref.logits, strict=True)):
        if a.shape != b.shape:
            return Part("behaviour", False, f"prompt {k + 1}: llama.cpp gives {a.shape[-1]} logits, transformers "
                        f"{b.shape[-1]}")  # fmt: skip
    compared = ref.compared(type_name)
    got = [a[:n] for a, n in zip(got, compared, strict=True)]
    want = [b[:n] for b, n in zip(ref.logits, compared, strict=True)]
    total, kept = sum(len(ids) for ids in ref.inputs), sum(compared)
    if not kept:
        reason = "every text begins with a near tie of a MoE router, where llama.cpp may choose other experts"
        proven = "the file proof" if lora else "the tensors proof"
        return Part("behaviour", True, f"{reason}: no position to compare ({proven} stands)", judged=False)
    rel = _rel(np.concatenate([a.ravel() for a in got]), np.concatenate([b.ravel() for b in want]))
    limit = BEHAVIOUR_LIMIT[type_name]
    agree = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(got, want, strict=True)])))
    whose = "logits with the adapter differ from PEFT's" if lora else "logits differ from transformers'"
    detail = (
        f"llama.cpp's {whose} by {rel:.2g} (relative RMS; limit {limit} for {type_name}); same top token at "
        f"{agree:.0%} of positions"
    )
    if kept < total:
        detail += f"; {kept} of {total} positions compared (each text up to its first near tie of a MoE router)"
    return Part("behaviour", rel <= limit, detail)
