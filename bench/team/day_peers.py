"""The whole-day study's servers: mlxgw, mlx_lm.server and vllm-mlx started on one model
folder with one prefix-cache byte bound and one batch width, and the typists' keystrokes for
a server without /infill.

A peer has no /infill, so a keystroke goes as a streaming `/v1/completions` whose prompt is
the model's fill-in-the-middle prompt built here from the same fields the /infill request
carries, as mlxgw's worker builds it (worker/text/fim.py): for Qwen2.5-Coder
`<|repo_name|>myproject\\n<|file_sep|>{filename}\\n<|fim_prefix|>{input_prefix}<|fim_suffix|>
{input_suffix}<|fim_middle|>{prompt}`, the control tokens' spellings read from the model
folder's tokenizer (a model without them is refused). `n_predict` becomes `max_tokens`; a
superseded keystroke's stream is closed, as an editor drops it; a file open is the same
prompt with `max_tokens: 1` (a peer cannot be asked for no token). The peers parse the
control tokens out of the prompt text, which mlxgw never does for client text: that is the
only difference in what the model reads."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ...shared.fim import FimFormat, detect
from ..servers import ServerProcess, registry, spawn_mlx_lm, spawn_mlxgw, spawn_vllm_mlx
from .typing_session import InfillWire, Keystroke, infill_fields

DEFAULT_REPO = "myproject"  # what mlxgw's worker (and llama.cpp) name the repository


def vocabulary(model_dir: Path) -> set[str]:
    """Every token spelling of the folder's tokenizer.json: its added tokens and its vocabulary."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        tok = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{model_dir}: no readable tokenizer.json ({e}): cannot build its FIM prompts") from e
    vocab = tok.get("model", {}).get("vocab")
    words = set(vocab) if isinstance(vocab, dict) else {v[0] for v in vocab or [] if isinstance(v, list)}
    return words | {t.get("content") for t in tok.get("added_tokens", [])}


def fim_format(model_dir: Path) -> FimFormat:
    """The folder's FIM format (shared/fim.py's table); SystemExit when its tokenizer has none:
    then no peer can be typed at (SmolLM2, for one, has no FIM tokens)."""
    fmt = detect(vocabulary(model_dir).__contains__)
    if fmt is None:
        raise SystemExit(
            f"{model_dir}: its tokenizer has no fill-in-the-middle tokens, so the typists have nothing to send "
            "to a server without /infill; use a code model (Qwen2.5-Coder-0.5B) or --typists 0"
        )
    return fmt


def fim_prompt(fmt: FimFormat, prefix: str, suffix: str, middle: str = "", filename: str | None = None) -> str:
    """The FIM prompt text mlxgw's worker builds from /infill's input_prefix, input_suffix and
    prompt (`middle`: the text after the middle token) and its filename."""
    head = ""
    if fmt.repo_name and fmt.file_sep and filename:  # the repository-level layout
        head = f"{fmt.repo_name}{DEFAULT_REPO}\n{fmt.file_sep}{filename}\n"
    if fmt.order == "spm":
        body = f"{fmt.suffix}{suffix}{fmt.prefix}{prefix}"
    else:
        body = f"{fmt.prefix}{prefix}{fmt.suffix}{suffix}"
    return head + body + (fmt.middle or "") + middle


class CompletionsWire:
    """Keystrokes as streaming /v1/completions FIM prompts (typing_session.InfillWire's methods)."""

    def __init__(self, url: str, model: str, fmt: FimFormat, shape: str, n_predict: int):
        self.url, self.model, self.fmt, self.shape, self.n_predict = url, model, fmt, shape, n_predict

    def body(self, prefix: str, suffix: str, filename: str, max_tokens: int) -> dict:
        f = infill_fields(prefix, suffix, self.shape)
        prompt = fim_prompt(self.fmt, f["input_prefix"], f["input_suffix"], f.get("prompt", ""), filename)
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}

    async def open(self, session, prefix: str, suffix: str, filename: str) -> None:
        async with session.post(f"{self.url}/v1/completions", json=self.body(prefix, suffix, filename, 1)) as resp:
            await resp.read()

    async def keystroke(self, session, prefix: str, suffix: str, filename: str, key: Keystroke) -> None:
        """Read until the stream ends or the task is cancelled (the next keystroke closes it)."""
        body = {**self.body(prefix, suffix, filename, self.n_predict), "stream": True}
        async with session.post(f"{self.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                key.error = f"HTTP {resp.status}: {(await resp.text())[:120]}"
                return
            async for raw in resp.content:
                choice = _choice(raw)
                if choice.get("text"):
                    key.delivered += 1  # a chunk: a token, or a few where a peer joins them
                if key.first_token is None and (choice.get("text") or choice.get("finish_reason")):
                    key.first_token = time.monotonic()


def _choice(raw: bytes) -> dict:
    """A completion stream's line's first choice ({} for any other line, or a broken one)."""
    if not raw.startswith(b"data: {"):
        return {}
    try:
        choices = json.loads(raw[6:]).get("choices")
    except ValueError:
        return {}
    return choices[0] if choices and isinstance(choices[0], dict) else {}


SERVERS = ("mlxgw", "mlx_lm.server", "vllm-mlx")


def server_labels(args) -> list[str]:
    return ["mlxgw"] + (["mlx_lm.server"] if args.mlx_lm else []) + (["vllm-mlx"] if args.vllm_python else [])


def spawn_server(label: str, args, home: Path) -> ServerProcess:
    """One server on the model folder, configured as bench/team/sessions.py configures it: the
    same prefix-cache byte bound (--cache-mb) for all, mlx_lm.server with a prompt cache entry
    per client, vllm-mlx with its paged cache and SSD tier; and for all the same number of rows
    decoding at once, every client of the day (mlx_lm.server and vllm-mlx decode 32 by default)."""
    rows = max(args.agents + args.chats + args.typists + args.batch_streams, 8)
    if label == "mlxgw":
        cache = {} if args.cache_mb is None else {"prefix_memory_mb": args.cache_mb}
        return spawn_mlxgw(home / "mlxgw", registry(args.model_dir, max_num_seqs=rows, cache=cache))
    if label == "mlx_lm.server":
        flags = ["--prompt-cache-size", str(max(10, rows)), "--decode-concurrency", str(max(32, rows))]
        if args.cache_mb is not None:
            flags += ["--prompt-cache-bytes", str(args.cache_mb << 20)]
        return spawn_mlx_lm(args.model_dir, home, flags)
    if label == "vllm-mlx":
        flags = ["--use-paged-cache", "--ssd-cache-dir", str(home / "vllm-ssd")]
        flags += ["--completion-batch-size", str(max(32, rows))]
        if args.cache_mb is not None:
            flags += ["--cache-memory-mb", str(args.cache_mb)]
        return spawn_vllm_mlx(args.vllm_python, args.model_dir, home, flags)
    raise ValueError(f"unknown server {label!r}; one of {SERVERS}")


def wire_for(label: str, args, url: str, model: str, fmt: FimFormat | None):
    """mlxgw keeps /infill; a peer gets CompletionsWire (None: no typists, no format needed)."""
    if label == "mlxgw" or (label == "server" and not args.fim_completions):
        return InfillWire(url, model, args.shape, args.n_predict)
    if fmt is None:
        raise SystemExit("the typists need the model folder's FIM tokens for a server without /infill")
    return CompletionsWire(url, model, fmt, args.shape, args.n_predict)
