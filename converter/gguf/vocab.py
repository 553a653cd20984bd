"""The tokenizer as GGUF metadata: its model (BPE `gpt2` or SentencePiece `llama`), tokens, types, merges or scores,
special ids, add_bos / add_eos, the chat template, and for BPE the pre-tokenizer's name.

Why the pre-tokenizer by hash: llama.cpp re-implements each model's pre-tokenization (the regexes that split text
before BPE) and picks one by the name in `tokenizer.ggml.pre`; its converter finds the name by tokenizing a fixed
text and hashing the ids. We use the same text and table (pretokenizers.json, read from llama.cpp's converter by
scripts/gguf_pretokenizers.py), so a tokenizer llama.cpp would not recognise is refused here, not shipped wrong.
Special tokens, merges and the template come from gguf's own SpecialVocab.
"""

from __future__ import annotations

import json
from functools import cache
from hashlib import sha256
from pathlib import Path

import gguf

from converter.errors import BadInputError
from converter.gguf.arch import Family

_TABLE = Path(__file__).with_name("pretokenizers.json")


@cache
def _pretokenizers() -> dict:
    return json.loads(_TABLE.read_text())


def load_tokenizer(folder: Path):
    """transformers' tokenizer of the folder; a folder without one (or one transformers cannot load) in one line."""
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise BadInputError(f"{folder}: no tokenizer.json or tokenizer.model: a GGUF needs the tokenizer", file=folder)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())
        raise BadInputError(f"{folder}: cannot load its tokenizer ({reason})", file=folder) from None


def pre_tokenizer(tokenizer, folder: object) -> str:
    """llama.cpp's name for this BPE tokenizer's pre-tokenization (its hash of the fixed text's token ids)."""
    table = _pretokenizers()
    digest = sha256(str(tokenizer.encode(table["text"])).encode()).hexdigest()
    name = table["hashes"].get(digest)
    if name is None:
        raise BadInputError(
            f"{folder}: llama.cpp does not know this BPE tokenizer's pre-tokenizer (hash {digest[:12]}...): "
            "a GGUF of it would tokenize differently from the model",
            file=folder,
        )  # fmt: skip
    return name


def _looks_special(token: str) -> bool:
    """llama.cpp's converter marks these added tokens as control tokens even when not flagged special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _bpe_vocab(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens and their types in id order; ids the tokenizer lacks are `[PADn]` (unused), as llama.cpp writes."""
    reverse = {i: t for t, i in tokenizer.vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:  # llama.cpp expects control / user tokens pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _special_vocab(folder: Path, *, tokenizer=None, **kwargs) -> gguf.SpecialVocab:
    """gguf's SpecialVocab (special ids, merges, chat template), with add_bos / add_eos as transformers does them:
    a GGUF without the flags leaves the choice to llama.cpp's default for the tokenizer type, which may differ."""
    special = gguf.SpecialVocab(folder, **kwargs)
    tokenizer = tokenizer or load_tokenizer(folder)
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    special.add_special_token["bos"] = bos is not None and len(with_special) > len(bare) and with_special[0] == bos
    special.add_special_token["eos"] = eos is not None and len(with_special) > len(bare) and with_special[-1] == eos
    return special


def _add_sentencepiece(w: gguf.GGUFWriter, folder: Path, vocab_size: int, *, phi3: bool = False) -> None:
    """tokenizer.model's pieces, scores and types, then the added tokens over them (Phi-3's converter reads
    them a little differently, and its files are read as it does)."""
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        from converter.io.optional import install_hint

        raise BadInputError(
            f"{folder}: a SentencePiece tokenizer (tokenizer.model) needs sentencepiece: {install_hint('gguf')}"
        ) from None
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(folder / "tokenizer.model"))
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores, types = [-10000.0] * vocab_size, [gguf.TokenType.UNUSED] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):
        tokens[i], scores[i] = sp.IdToPiece(i).encode(), sp.GetScore(i)
        types[i] = (
            gguf.TokenType.UNKNOWN if sp.IsUnknown(i) else gguf.TokenType.CONTROL if sp.IsControl(i)
            else gguf.TokenType.UNUSED if sp.IsUnused(i) else gguf.TokenType.BYTE if sp.IsByte(i)
            else gguf.TokenType.NORMAL
        )  # fmt: skip
    added_file = folder / "added_tokens.json"
    for token, i in (json.loads(added_file.read_text()) if added_file.is_file() else {}).items():
        if i < vocab_size:
            tokens[i], scores[i], types[i] = token.encode(), -1000.0, gguf.TokenType.USER_DEFINED
    config_file = folder / "tokenizer_config.json"
    decoder = json.loads(config_file.read_text()).get("added_tokens_decoder", {}) if config_file.is_file() else {}
    added = [(int(key), data) for key, data in decoder.items()]
    if phi3:  # Phi-3's converter: tokenizer.json's added tokens too, and only the special flag makes a control token
        tokenizer_file = folder / "tokenizer.json"
        listed = json.loads(tokenizer_file.read_text()).get("added_tokens", []) if tokenizer_file.is_file() else []
        added += [(int(data["id"]), data) for data in listed]
    for i, data in added:
        token = data["content"]
        if i >= vocab_size:
            continue
        if data.get("special") or (not phi3 and _looks_special(token)):
            types[i] = gguf.TokenType.CONTROL
        else:
            token, types[i] = (token if phi3 else token.replace("\u2581", " ")), gguf.TokenType.USER_DEFINED
        scores[i], tokens[i] = -1000.0, token.encode()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    _special_vocab(folder, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _merge_scores(folder: Path, tokens: list[bytes], scores: list[float]) -> list[float]:
    """Scores that make llama.cpp's SentencePiece tokenizer merge in tokenizer.json's merge order: each token made
    by a merge scores minus that merge's rank (as a SentencePiece BPE model's pieces do). gguf's LlamaHfVocab gives
    every token -1000, and llama.cpp, merging the highest score first, then merges left to right instead: a Llama 2
    tokenizer saved by transformers 5 (tokenizer.json only) tokenized `"  hello"` as `"▁▁" "hello"`, not
    `"▁" "▁hello"`."""
    merges = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"].get("merges") or []
    rank: dict[str, int] = {}
    for i, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, i)
    out = list(scores)
    for i, token in enumerate(tokens):
        text = token.decode("utf-8", errors="replace").replace(" ", "\u2581")
        if text in rank and scores[i] == -1000.0:
            out[i] = -float(rank[text])
    return out


def _add_llama_hf(w: gguf.GGUFWriter, folder: Path) -> bool:
    """A SentencePiece-style BPE in tokenizer.json (byte fallback), as gguf's LlamaHfVocab reads it, scored by its
    merges (`_merge_scores`)."""
    try:
        vocab = gguf.LlamaHfVocab(folder)
    except (FileNotFoundError, TypeError):
        return False
    tokens, scores, types = zip(*vocab.all_tokens(), strict=True)
    scores = _merge_scores(folder, list(tokens), list(scores))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(tokens))
    w.add_token_scores(list(scores))
    w.add_token_types(list(types))
    _special_vocab(folder, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    return True


def add_vocab(w: gguf.GGUFWriter, folder: Path, config: dict, family: Family, *, pre: str | None = None) -> None:
    """Everything `tokenizer.*` for this folder. `pre` overrides the detected pre-tokenizer (tests' sabotage)."""
    vocab_size = int(config["vocab_size"])
    config_file = folder / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if family.llama_hf_vocab and tok_config.get("add_prefix_space") is not None:
        w.add_add_space_prefix(tok_config["add_prefix_space"])
    if family.vocab == "phi3" and tok_config.get("tokenizer_class") != "GPT2Tokenizer":  # Phi-4's is GPT-2's BPE
        if not (folder / "tokenizer.model").is_file():
            raise BadInputError(f"{folder}: no tokenizer.model: llama.cpp reads a Phi-3 tokenizer from it", file=folder)
        _add_sentencepiece(w, folder, vocab_size, phi3=True)
        return
    if family.spm_first and (folder / "tokenizer.model").is_file():
        _add_sentencepiece(w, folder, vocab_size)
        if family.norm_plus_one:  # Gemma: llama.cpp's converter says so explicitly
            w.add_add_space_prefix(False)
        return
    if family.llama_hf_vocab and _add_llama_hf(w, folder):
        return
    if not (folder / "tokenizer.json").is_file():
        raise BadInputError(f"{folder}: no tokenizer.json or tokenizer.model: a GGUF needs the tokenizer", file=folder)
    tokenizer = load_tokenizer(folder)
    if max(tokenizer.vocab.values()) >= vocab_size:
        raise BadInputError(f"{folder}: the tokenizer has ids beyond the model's vocab_size {vocab_size}", file=folder)
    tokens, types = _bpe_vocab(tokenizer, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or pre_tokenizer(tokenizer, folder))
    w.add_token_list(tokens)
    w.add_token_types(types)
    _special_vocab(folder, load_merges=True, tokenizer=tokenizer).add_to_gguf(w, quiet=True)


def vocab_metadata(folder: Path, config: dict, family: Family, *, pre: str | None = None) -> dict[str, gguf.GGUFValue]:
    """add_vocab's keys and values, made once for the files of several types (they are the same in each)."""
    w = gguf.GGUFWriter(None, "scratch")
    add_vocab(w, folder, config, family, pre=pre)
    return {k: v for k, v in w.kv_data[0].items() if k != gguf.Keys.General.ARCHITECTURE}


def prepends_per_piece(tokenizer) -> bool:
    """Whether transformers' tokenizer is a SentencePiece reading that leaves text after a special token (or text
    that starts with a space) without SentencePiece's own "▁": a Metaspace pre-tokenizer, as transformers 5 builds
    for every Llama-style tokenizer class. llama.cpp, like SentencePiece, puts the "▁" before every piece of text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.pre_tokenizer).__name__ == "Metaspace"


def sentencepiece_convention(tokenizer, text: str, add_special: bool) -> list[int]:
    """The ids of `text` with each piece of text between special tokens tokenized as llama.cpp's SentencePiece
    tokenizer does: a space before it (which Metaspace turns into the "▁" it would not add), special tokens as they
    are, and transformers' own BOS / EOS around. Only the whitespace convention differs from transformers' ids:
    every piece is still tokenized by transformers' vocabulary and merges."""
    import re

    added = sorted((t for t in tokenizer.get_added_vocab() if t), key=len, reverse=True)
    pieces = re.split("(" + "|".join(re.escape(t) for t in added) + ")", text) if added else [text]
    body: list[int] = []
    for piece in pieces:
        if piece in tokenizer.get_added_vocab():
            body.append(tokenizer.get_added_vocab()[piece])
        elif piece:
            body += tokenizer(" " + piece, add_special_tokens=False)["input_ids"]
    if not add_special:
        return body
    bare, full = tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer(text)["input_ids"]
    head = next((k for k in range(len(full) - len(bare) + 1) if full[k : k + len(bare)] == bare), 0)
    return full[:head] + body + full[head + len(bare) :]
