"""Build a Hugging Face `tokenizers` tokenizer from a GGUF file's vocabulary.

GGUF stores a byte-level BPE tokenizer (`tokenizer.ggml.model = gpt2`) as its tokens, merges,
token types and the name of llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`); a SentencePiece
BPE tokenizer (`llama`: Llama 2, Mistral, Gemma, Phi-3) as tokens with scores and types. We
rebuild the same pipeline with the `tokenizers` library so mlx-lm (via transformers) loads it
like any downloaded model."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .architectures import UnsupportedModel

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
_SPIECE_UNDERLINE = "\u2581"

# Pre-tokenizer regexes, as llama.cpp (llama-vocab.cpp) and the models' own tokenizer.json use.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False), _byte_level(False)]
    )


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level(True)])


# tokenizer.ggml.pre -> (pre-tokenizer factory, BPE ignore_merges)
_PRE_TOKENIZERS = {
    "default": (lambda: _byte_level(True), False),
    "gpt2": (lambda: _byte_level(True), False),
    "smollm": (_digits_then_gpt2, False),
    "starcoder": (_digits_then_gpt2, False),
    "refact": (_digits_then_gpt2, False),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), False),
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), True),
}


@dataclass
class TokenizerFiles:
    tokenizer_json: str
    tokenizer_config: dict
    eos_token_ids: list[int]
    bos_token_id: int | None


def _optional_id(md: dict, key: str, n_tokens: int) -> int | None:
    value = md.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_tokens:
        raise UnsupportedModel(f"GGUF metadata {key!r} = {value!r} is not a token id of the vocabulary")
    return value


def _flag(md: dict, key: str, default: bool) -> bool:
    value = md.get(key)
    return default if value is None else bool(value)


def _string_list(md: dict, key: str) -> list[str]:
    value = md.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UnsupportedModel(f"GGUF metadata {key!r} is not a list of strings")
    return value


def _byte_level_bpe(md: dict, tokens: list[str]) -> Tokenizer:
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedModel(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    make_pre, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in _string_list(md, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise UnsupportedModel("GGUF merges must be pairs separated by one space")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = make_pre()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, as transformers' converter derives
    them (SentencePieceExtractor): every split of a piece into two pieces of the vocabulary,
    ranked by the merged piece's score."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores):
        splits = ((piece[:i], piece[i:]) for i in range(1, len(piece)))
        local = [(left, right, score) for left, right in splits if left in vocab and right in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: m[2], reverse=True)
    return [(left, right) for left, right, _ in found]


def _sentencepiece_bpe(md: dict, tokens: list[str], unk: int | None) -> Tokenizer:
    """SentencePiece BPE with byte fallback, as transformers' Llama/Gemma converters build it.
    `add_space_prefix` (Llama 2, Mistral, Phi-3; not Gemma) prepends the word-start mark."""
    scores = md.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise UnsupportedModel("a SentencePiece GGUF vocabulary needs one score per token")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, scores)
    unk_token = tokens[unk] if unk is not None else None
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(bpe)
    add_prefix = _flag(md, "tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend(_SPIECE_UNDERLINE)] if add_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPIECE_UNDERLINE)])
    decoding = [decoders.Replace(_SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decoding.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decoding)
    return tokenizer


def _token_types(md: dict, n_tokens: int) -> list[int]:
    types = md.get("tokenizer.ggml.token_type", [])
    if not isinstance(types, list) or (types and len(types) != n_tokens):
        raise UnsupportedModel("GGUF tokenizer.ggml.token_type must hold one type per token")
    return types


def build_tokenizer(md: dict, context_length: int) -> TokenizerFiles:
    kind = md.get("tokenizer.ggml.model")
    tokens = _string_list(md, "tokenizer.ggml.tokens")
    if not tokens:
        raise UnsupportedModel("the GGUF file has no vocabulary (tokenizer.ggml.tokens)")
    unk = _optional_id(md, "tokenizer.ggml.unknown_token_id", len(tokens))
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(md, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(md, tokens, unk)
    else:
        raise UnsupportedModel(
            f"GGUF tokenizer model {kind!r} is not supported; "
            "supported: byte-level BPE ('gpt2'), SentencePiece ('llama')"
        )
    types = _token_types(md, len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}

    # Control tokens (<|im_start|> ...) must never be split by BPE: register them as added tokens.
    special = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    user = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    n = len(tokens)
    bos = _optional_id(md, "tokenizer.ggml.bos_token_id", n)
    eos = _optional_id(md, "tokenizer.ggml.eos_token_id", n)
    eot = _optional_id(md, "tokenizer.ggml.eot_token_id", n)
    pad = _optional_id(md, "tokenizer.ggml.padding_token_id", n)
    add_bos = _flag(md, "tokenizer.ggml.add_bos_token", False) and bos is not None
    if add_bos:
        bos_tok = tokens[bos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B", special_tokens=[(bos_tok, bos)]
        )
    elif kind == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    eos_ids = [i for i in (eos, eot) if i is not None]
    # ChatML templates end a turn with <|im_end|>; stop there even when the GGUF names
    # <|endoftext|> as EOS (and vice versa).
    control = set(special)
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if name in control and vocab[name] not in eos_ids:
            eos_ids.append(vocab[name])

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": False,
    }
    for field, idx in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)):
        if idx is not None:
            config[field] = tokens[idx]
    template = md.get("tokenizer.chat_template")
    if template and not isinstance(template, str):
        raise UnsupportedModel("GGUF tokenizer.chat_template is not a string")
    if template:
        config["chat_template"] = template
    return TokenizerFiles(
        tokenizer_json=tokenizer.to_str(),
        tokenizer_config=config,
        eos_token_ids=eos_ids,
        bos_token_id=bos,
    )


def dump_json(obj: dict) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
