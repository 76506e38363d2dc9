"""Fill-in-the-middle (FIM) formats: the control tokens code models were trained with, and how
a model's format is found from its own vocabulary (or set in models.yaml, `fim:`).

Both sides use this table: the worker builds prompts from it (worker/text/fim.py), the gateway
says which models can complete (`/v1/models` capabilities, Ollama's `/api/show`). A format
is known only when the model's vocabulary holds all three of its prefix, suffix and middle
tokens (Codestral has no middle token: prefix and suffix), so a chat model whose tokenizer
happens to carry one file-separator token (SmolLM2: `<file_sep>`) is not taken for a coder.

Orders: "psm" (prefix, suffix, middle: the common one) and "spm" (suffix first, llama.cpp's
`--spm-infill` order: SUF suffix PRE prefix MID; Codestral's own order, without a middle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FimOrder = Literal["psm", "spm"]


@dataclass(frozen=True)
class FimFormat:
    name: str
    prefix: str
    suffix: str
    middle: str | None  # None: the prompt ends with the last part (Codestral)
    order: FimOrder = "psm"
    repo_name: str | None = None  # repository-level context (Qwen2.5-Coder, StarCoder2)
    file_sep: str | None = None
    # Tokens that end a middle besides the model's end-of-sequence ones: the file separator
    # (the model starts the next file), the other FIM controls, the end of text.
    stops: tuple[str, ...] = field(default_factory=tuple)

    def controls(self) -> tuple[str, ...]:
        """Every control token of the format, as spelled in the vocabulary."""
        parts = (self.prefix, self.suffix, self.middle, self.repo_name, self.file_sep, *self.stops)
        return tuple(dict.fromkeys(t for t in parts if t))


QWEN = FimFormat(
    "qwen",
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
    repo_name="<|repo_name|>",
    file_sep="<|file_sep|>",
    stops=("<|endoftext|>", "<|fim_pad|>"),
)
# StarCoder / StarCoder2, and Granite-Code (trained on StarCoder's tokenizer).
STARCODER = FimFormat(
    "starcoder",
    "<fim_prefix>",
    "<fim_suffix>",
    "<fim_middle>",
    repo_name="<repo_name>",
    file_sep="<file_sep>",
    stops=("<|endoftext|>", "<fim_pad>"),
)
DEEPSEEK = FimFormat(
    "deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", stops=("<｜end▁of▁sentence｜>", "<|EOT|>")
)
CODELLAMA = FimFormat("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", stops=("▁<EOT>",))
CODESTRAL = FimFormat("codestral", "[PREFIX]", "[SUFFIX]", None, order="spm")

KNOWN_FORMATS: tuple[FimFormat, ...] = (QWEN, STARCODER, DEEPSEEK, CODELLAMA, CODESTRAL)


def detect(has_token) -> FimFormat | None:
    """The first known format whose prefix, suffix and middle tokens the vocabulary holds
    (has_token: spelling -> bool)."""
    for fmt in KNOWN_FORMATS:
        if all(has_token(t) for t in (fmt.prefix, fmt.suffix, fmt.middle) if t is not None):
            return fmt
    return None


def from_config(cfg, detected: FimFormat | None) -> FimFormat | None:
    """The format a models.yaml `fim:` entry (shared/config.FimConfig) makes of the detected
    one: off, the detected one with its fields overridden, or one spelled out in full."""
    if cfg is None:
        return detected
    if not cfg.enabled:
        return None
    base = detected
    if base is None:
        if not (cfg.prefix and cfg.suffix):
            return None  # nothing detected and no tokens named: no FIM
        base = FimFormat("custom", cfg.prefix, cfg.suffix, cfg.middle)
    return FimFormat(
        base.name if detected is not None and not (cfg.prefix or cfg.suffix or cfg.middle) else "custom",
        cfg.prefix or base.prefix,
        cfg.suffix or base.suffix,
        cfg.middle if cfg.middle is not None else base.middle,
        order=cfg.order or base.order,
        repo_name=cfg.repo_name if cfg.repo_name is not None else base.repo_name,
        file_sep=cfg.file_sep if cfg.file_sep is not None else base.file_sep,
        stops=tuple(dict.fromkeys((*base.stops, *cfg.stop))),
    )
