"""A tiny random-weight llama that fills in the middle: SmolLM2's tokenizer plus Qwen2.5-Coder's
FIM tokens, flagged special (as most tokenizers flag them) or not (as Qwen2.5-Coder's own
tokenizer.json does)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

QWEN_FIM_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def build_fim_model(dest: Path, smollm2_dir: Path, work: Path, special: bool = True) -> Path:
    from tiny_model import build_tiny_model
    from tokenizers import AddedToken, Tokenizer

    work.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    tokens = [AddedToken(t, special=special, normalized=False) for t in QWEN_FIM_TOKENS]
    (tok.add_special_tokens if special else tok.add_tokens)(tokens)
    tok.save(str(work / "tokenizer.json"))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, work / name)
    config = json.loads((smollm2_dir / "config.json").read_text())
    config["vocab_size"] = tok.get_vocab_size()
    (work / "config.json").write_text(json.dumps(config))
    return build_tiny_model(dest, work)
