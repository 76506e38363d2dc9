"""The whole-day study's pure parts: a peer's FIM prompt is the prompt mlxgw's worker builds
from the same /infill fields (bench/team/day_peers.py), a model without FIM tokens is refused
by name, and a round's loads become one row per server and class and one table
(bench/team/day_report.py)."""

from __future__ import annotations

import shutil

import pytest
from helpers.fim_models import QWEN_FIM_TOKENS

from mlxgw.bench.loadgen import RequestResult
from mlxgw.bench.team.day import Loads
from mlxgw.bench.team.day_peers import CompletionsWire, fim_format, fim_prompt
from mlxgw.bench.team.day_report import NOT_OPEN, UNANSWERED, class_rows, markdown, merge
from mlxgw.bench.team.typing_session import Keystroke, source_file
from mlxgw.shared.fim import CODESTRAL


@pytest.fixture(scope="module")
def fim_tokenizer_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2's tokenizer with Qwen2.5-Coder's FIM tokens added unflagged, as Qwen's own
    tokenizer.json has them (the harder case for the worker: it flags them itself)."""
    from tokenizers import AddedToken, Tokenizer

    folder = tmp_path_factory.mktemp("fim-tokenizer")
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_FIM_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


def test_a_peers_fim_prompt_reads_as_the_workers_own_prompt(fim_tokenizer_dir):
    """The text a peer receives, tokenized as mlx_lm.server tokenizes a completion's prompt,
    is token for token the prompt mlxgw's worker builds for the same /infill request."""
    from mlx_lm.utils import load_tokenizer

    from mlxgw.worker.text.fim import FimPrompts

    tokenizer = load_tokenizer(fim_tokenizer_dir)
    fmt = fim_format(fim_tokenizer_dir)
    assert fmt.name == "qwen"
    text = source_file(12, seed=3)
    cursor = text.index("\n", len(text) // 2) + 1
    wire = CompletionsWire("http://x", "m", fmt, "lines", n_predict=32)
    for prefix in (text[:cursor], text[:cursor] + "    values = sor"):  # a new line, then mid-line
        name = "typist_7.py"
        body = wire.body(prefix, text[cursor:], name, 32)
        assert body["max_tokens"] == 32 and body["prompt"].startswith(f"<|repo_name|>myproject\n<|file_sep|>{name}\n")
        start = prefix.rfind("\n") + 1  # llama.vscode's shape: the cursor's line after the middle token
        fim = {"prefix": prefix[:start], "suffix": text[cursor:], "middle": prefix[start:], "filename": name}
        assert tokenizer.encode(body["prompt"]) == FimPrompts(tokenizer).encode(fim, None, None)


def test_fim_prompt_orders():
    qwen_plain = fim_prompt(fim_format_of("qwen"), "a = ", "\nb = 2\n")
    assert qwen_plain == "<|fim_prefix|>a = <|fim_suffix|>\nb = 2\n<|fim_middle|>"
    assert fim_prompt(CODESTRAL, "a = ", "\nb\n", "1") == "[SUFFIX]\nb\n[PREFIX]a = 1"  # no middle token


def fim_format_of(name: str):
    from mlxgw.shared.fim import KNOWN_FORMATS

    return next(f for f in KNOWN_FORMATS if f.name == name)


def test_a_model_without_fim_tokens_is_refused_by_name(smollm2_dir):
    with pytest.raises(SystemExit, match="no fill-in-the-middle tokens.*Qwen2.5-Coder"):
        fim_format(smollm2_dir)


def _round(wall: float, agent_ttfts: list[float], keys: list[Keystroke], opens: list[float]) -> Loads:
    loads = Loads(wall=wall)
    loads.results["agent"] = [RequestResult(True, 200, ttft=t, tokens=10) for t in agent_ttfts]
    loads.results["agent"].append(RequestResult(False, 503, "HTTP 503: busy"))
    loads.results["background"] = [RequestResult(True, 200, ttft=1.0, tokens=50)]
    loads.typing.keystrokes = keys
    loads.typing.open_s = opens
    return loads


def _keys(ttfts: list[float | None], error: str | None = None) -> list[Keystroke]:
    out = [Keystroke(sent=0.0, first_token=0.05, delivered=3)]  # superseded: not a row's request
    for t in ttfts:
        out.append(Keystroke(sent=10.0, first_token=None if t is None else 10.0 + t, delivered=4, last_of_burst=True))
    if error:
        out.append(Keystroke(sent=20.0, last_of_burst=True, error=error))
    return out


def test_rows_per_server_and_class_merged_over_rounds_and_tabled():
    rows = class_rows("mlxgw", 1, _round(10.0, [1.0, 2.0, 3.0], _keys([0.5, 4.0, None]), [8.0, 10.0]), 3.0, 2**30)
    rows += class_rows("mlxgw", 2, _round(20.0, [2.0, 4.0], _keys([1.0], "HTTP 400"), [12.0]), 3.0, 2**29)
    rows += class_rows("vllm-mlx", 1, _round(10.0, [5.0], _keys([2.0]), [30.0]), 3.0, None)
    unopened = _round(10.0, [], [], [])
    unopened.typists = 2  # two typists whose files never opened: two editor failures, nothing typed
    rows += class_rows("mlx_lm.server", 1, unopened, 3.0, None)
    assert [r["class"] for r in rows[:4]] == ["editor", "chat", "agent", "background"]
    editor, chat, agent, background = rows[:4]
    # the editor: last keystrokes only; one unanswered within the pause fails, so does one refused
    assert (editor["completed"], editor["failed"], editor["within_pause"]) == (2, 1, pytest.approx(1 / 3, abs=1e-3))
    assert editor["errors"] == [UNANSWERED] and editor["output_tokens"] == 8 and editor["file_open_p50_s"] == 9.0
    assert rows[4]["errors"] == ["HTTP 400"] and rows[4]["within_pause"] == 0.5
    assert (agent["completed"], agent["failed"], agent["ttft_p50_s"], agent["output_tok_s"]) == (3, 1, 2.0, 3.0)
    assert chat["completed"] == 0 and chat["ttft_p50_s"] is None  # no chat user: an empty row, not a crash
    assert background["output_tok_s"] == 5.0 and agent["peak_rss_mb"] == 1024

    assert (rows[-4]["failed"], rows[-4]["errors"], rows[-4]["within_pause"]) == (2, [NOT_OPEN], None)

    merged = merge(rows)
    assert [(r["server"], r["class"]) for r in merged][:5] == [
        ("mlxgw", "editor"), ("mlxgw", "chat"), ("mlxgw", "agent"), ("mlxgw", "background"), ("vllm-mlx", "editor"),
    ]  # fmt: skip
    m_agent = merged[2]
    assert m_agent["completed"] == 5 and m_agent["ttft_p50_s"] == 2.5 and m_agent["ttft_p50_s_rounds"] == [2.0, 3.0]
    assert merged[0]["within_pause"] == pytest.approx((1 / 3 + 0.5) / 2, abs=1e-3) and merged[0]["peak_rss_mb"] == 768

    table = markdown(merged, "1 round")
    lines = table.splitlines()
    assert lines[0] == "1 round" and lines[2].startswith("| server | class | ok | failed | tok/s (rounds) |")
    assert "| mlxgw | agent | 5 | 2 | 2.0 (3.0, 1.0) | 2.50 (2.00, 3.00) |" in table
    vllm_editor = next(line for line in lines if line.startswith("| vllm-mlx | editor |"))
    assert vllm_editor.endswith("| 1.00 | 30.00 | - |")  # one round: no rounds beside; no RSS sampled
