"""Build a Hugging Face `tokenizers` tokenizer from a GGUF file's vocabulary.

GGUF stores a byte-level BPE tokenizer as its tokens, merges, token types and the name of
llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`). We rebuild the same pipeline with the
`tokenizers` library so mlx-lm (via transformers) loads it like any downloaded model."""

from __future__ import annotations

import json
from dataclasses import dataclass

import mlx.core as mx
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .architectures import UnsupportedModel

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

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


def _optional_id(md: dict, key: str) -> int | None:
    value = md.get(key)
    return None if value is None else int(value.item() if isinstance(value, mx.array) else value)


def _flag(md: dict, key: str, default: bool) -> bool:
    value = md.get(key)
    return default if value is None else bool(value.item() if isinstance(value, mx.array) else value)


def build_tokenizer(md: dict, context_length: int) -> TokenizerFiles:
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is")
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedModel(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    make_pre, ignore_merges = _PRE_TOKENIZERS[pre]

    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    types = md["tokenizer.ggml.token_type"].tolist() if "tokenizer.ggml.token_type" in md else []
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = make_pre()
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|> ...) must never be split by BPE: register them as added tokens.
    special = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    user = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    bos = _optional_id(md, "tokenizer.ggml.bos_token_id")
    eos = _optional_id(md, "tokenizer.ggml.eos_token_id")
    eot = _optional_id(md, "tokenizer.ggml.eot_token_id")
    unk = _optional_id(md, "tokenizer.ggml.unknown_token_id")
    pad = _optional_id(md, "tokenizer.ggml.padding_token_id")
    add_bos = _flag(md, "tokenizer.ggml.add_bos_token", False) and bos is not None
    if add_bos:
        bos_tok = tokens[bos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B", special_tokens=[(bos_tok, bos)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    eos_ids = [i for i in (eos, eot) if i is not None]
    # ChatML templates end a turn with <|im_end|>; stop there even when the GGUF names
    # <|endoftext|> as EOS (and vice versa).
    control = set(special)
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
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
