"""Speculative decoding (worker/model/speculation/speculative.py and spec_verify.py): greedy
outputs with prompt-lookup speculation are token-identical to plain decoding, alone and in a batch, and
a request that ends inside an accepted draft ends exactly where plain decoding ends it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import openai_client, wait_for
from helpers.runner_jobs import GREEDY, generate_together, speculative_runner
from mlx_lm.models.cache import BatchKVCache

from mlxgw.shared import protocol as p
from mlxgw.shared.config import ConfigError, parse_registry
from mlxgw.shared.events import EventKind
from mlxgw.shared.model_sections import SpeculativeConfig
from mlxgw.shared.protocol import SamplingParams
from mlxgw.worker.model.runners.mlx_runner import MLXRunner
from mlxgw.worker.model.speculation.spec_verify import rollback_rows
from mlxgw.worker.model.speculation.speculative import NgramIndex
from mlxgw.worker.schedule.scheduler import Scheduler

COPY_TEXT = "def add(a, b):\n    return a + b\n\n" * 6


@pytest.fixture(scope="module")
def tiny_runners(tiny_dir):
    return {mode: speculative_runner(tiny_dir, SpeculativeConfig(mode=mode)) for mode in ("off", "prompt_lookup")}


def _copy_prompt(runner: MLXRunner, text: str = COPY_TEXT) -> list[int]:
    return runner.encode_text("Copy this code:\n" + text + "\nCopy:\n" + text[:40])


# -- drafting and rollback, without a model ----------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_last_earlier_occurrence():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert index.propose(tokens, 3) == [2, 3, 5]  # the later of the two earlier "5 6 7"
    assert index.propose(tokens + [2], 2) == [3, 5]


def test_prompt_lookup_proposes_nothing_for_an_unseen_suffix():
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4) == []


def test_rollback_keeps_each_rows_accepted_positions_and_drops_the_rest():
    cache = BatchKVCache([1, 0])
    start = mx.random.normal((2, 2, 3, 4))
    cache.update_and_fetch(start, start)
    fed = mx.random.normal((2, 2, 4, 4))  # a verification pass of width 4
    cache.update_and_fetch(fed, fed)
    rollback_rows([cache], width=4, kept=[3, 1])
    row0, row1 = cache.extract(0), cache.extract(1)
    expect0 = mx.concatenate([start[0:1, :, 1:], fed[0:1, :, :3]], axis=2)
    expect1 = mx.concatenate([start[1:2], fed[1:2, :, :1]], axis=2)
    assert mx.array_equal(row0.keys, expect0) and mx.array_equal(row1.values, expect1)
    assert cache.offset.tolist() == [2 + 3, 3 + 1]


# -- token identity with a model ----------------------------------------------------------------
def test_a_greedy_request_is_token_identical_with_speculation(tiny_runners):
    prompt = _copy_prompt(tiny_runners["off"])
    plain = generate_together(tiny_runners["off"], [(prompt, 40, GREEDY)])
    spec = generate_together(tiny_runners["prompt_lookup"], [(prompt, 40, GREEDY)])
    assert spec == plain and len(plain[0]) == 40


def test_a_batch_of_greedy_requests_of_different_lengths_is_token_identical(tiny_runners):
    r = tiny_runners["off"]
    jobs = [
        (_copy_prompt(r), 37, GREEDY),
        (r.encode_text("one two three one two three one two"), 23, GREEDY),
        (r.encode_text("Hello"), 31, GREEDY),
        (_copy_prompt(r, "x = [1, 2, 3]\n" * 9), 12, GREEDY),
    ]
    assert generate_together(tiny_runners["prompt_lookup"], jobs) == generate_together(r, jobs)


def test_sampled_rows_in_a_speculating_batch_keep_their_seeded_tokens(tiny_runners):
    r = tiny_runners["off"]
    seeded = SamplingParams(temperature=0.8, seed=7)
    jobs = [(_copy_prompt(r), 30, GREEDY), (r.encode_text("Write a poem"), 20, seeded)]
    assert generate_together(tiny_runners["prompt_lookup"], jobs) == generate_together(r, jobs)


def test_a_max_tokens_end_inside_an_accepted_draft_emits_no_extra_token(tiny_runners):
    prompt = _copy_prompt(tiny_runners["off"])
    full = generate_together(tiny_runners["off"], [(prompt, 40, GREEDY)])[0]
    for n in (2, 5, 9, 14):
        assert generate_together(tiny_runners["prompt_lookup"], [(prompt, n, GREEDY)])[0] == full[:n]


def test_a_batch_larger_than_max_rows_does_not_speculate(tiny_dir, tiny_runners):
    """Above max_rows (default 2 on the CPU device) nothing is drafted or verified: at 8-16
    rows speculation lost 6-13% through the server whatever the policy, and at 4 it gained
    nothing."""
    from mlxgw.worker.model.speculation.speculative import CPU_MAX_ROWS, Speculator

    assert Speculator(SpeculativeConfig()).max_rows == CPU_MAX_ROWS  # the tests run on the CPU device
    capped = speculative_runner(tiny_dir, SpeculativeConfig(mode="prompt_lookup", max_rows=2))
    prompt = _copy_prompt(capped)
    jobs = [(prompt, 16, GREEDY)] * 3
    assert generate_together(capped, jobs) == generate_together(tiny_runners["off"], jobs)
    assert capped.speculator.counters.drafted == 0 and capped.speculator.counters.speculative_steps == 0
    two = speculative_runner(tiny_dir, SpeculativeConfig(mode="prompt_lookup", max_rows=2))
    assert generate_together(two, jobs[:2]) == generate_together(tiny_runners["off"], jobs[:2])
    assert two.speculator.counters.speculative_steps > 0  # two rows: at the cap, it speculates


def _text_until_finish(runner: MLXRunner, req: p.GenerateRequest) -> tuple[str, dict]:
    sched = Scheduler(runner, max_num_seqs=4, max_queue=4)
    events = sched.submit(req)
    text = ""
    while True:
        for _, ev in events:
            if ev.KIND in (EventKind.DELTA, EventKind.FINISH):
                text += ev.text or ""
            if ev.KIND == EventKind.FINISH:
                return text, ev
            assert ev.KIND != EventKind.ERROR, ev
        events = sched.step()


def test_a_stop_string_inside_an_accepted_draft_ends_where_plain_decoding_ends(tiny_runners):
    prompt = _copy_prompt(tiny_runners["off"])
    full = tiny_runners["off"].text.tokenizer.decode(generate_together(tiny_runners["off"], [(prompt, 30, GREEDY)])[0])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full

    def ask(runner):
        req = p.GenerateRequest(rid="r", prompt_tokens=prompt, sampling=GREEDY, max_tokens=30, stop=[stop])
        return _text_until_finish(runner, req)

    (plain_text, plain_end), (spec_text, spec_end) = ask(tiny_runners["off"]), ask(tiny_runners["prompt_lookup"])
    assert spec_text == plain_text and stop not in spec_text
    assert spec_end.reason == plain_end.reason == "stop"
    assert spec_end.usage == plain_end.usage


def test_speculation_reports_its_acceptance_rate_in_the_runner_stats(tiny_runners):
    runner = tiny_runners["prompt_lookup"]
    generate_together(runner, [(_copy_prompt(runner), 24, GREEDY)])
    stats = runner.stats()["speculative"]
    assert stats["mode"] == "prompt_lookup" and stats["accepted_tokens"] > 0 and stats["acceptance_rate"] > 0


def test_speculation_off_drafts_nothing(tiny_runners):
    runner = tiny_runners["off"]
    generate_together(runner, [(_copy_prompt(runner), 8, GREEDY)])
    assert runner.stats()["speculative"]["drafted_tokens"] == 0


# -- the real model: drafts accepted on a copy-the-context prompt --------------------------------
def test_the_real_model_accepts_drafts_when_copying_its_context_and_stays_identical(smollm2_dir, monkeypatch):
    runners = {mode: speculative_runner(smollm2_dir, SpeculativeConfig(mode=mode)) for mode in ("off", "prompt_lookup")}
    tok = runners["off"].text.tokenizer
    code = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    # A file copied twice and a third copy begun: the model copies on (a chat request asking
    # to repeat the code depends on the model's whims: a float32 re-import answered in prose).
    copies = f"# shapes.py\n{code}\n\n# shapes_copy.py (identical)\n{code}\n\n"
    prompt = tok.encode(copies + "# shapes_copy2.py (identical)\ndef area(")
    outputs = {mode: generate_together(r, [(prompt, 24, GREEDY)]) for mode, r in runners.items()}
    assert outputs["prompt_lookup"] == outputs["off"]
    assert runners["prompt_lookup"].stats()["speculative"]["acceptance_rate"] > 0
    counters = runners["prompt_lookup"].speculator.counters
    assert counters.largest_verification > 4  # one row drafts several tokens a step
    # A verification carries at most VERIFY_DRAFT_POSITIONS drafted positions, a row its share:
    # at c = 16, 16 rows x 8 drafts made a 144-token forward that cost on a CPU what it saved
    # (0.93x). Four rows under a bound of 4: one draft each, the same tokens.
    from mlxgw.worker.model.speculation import speculative

    monkeypatch.setattr(speculative, "VERIFY_DRAFT_POSITIONS", 4)
    # no pause learned yet; four rows speculate only above the CPU's default row cap
    capped = speculative_runner(smollm2_dir, SpeculativeConfig(mode="prompt_lookup", max_rows=4))
    jobs = [(prompt, 24, GREEDY)] * 4
    assert generate_together(capped, jobs) == generate_together(runners["off"], jobs)
    assert 0 < capped.speculator.counters.largest_verification <= 4


def test_the_acceptance_rate_reaches_the_status_endpoint(tiny_gateway):
    client = openai_client(tiny_gateway)
    messages = [{"role": "user", "content": "Copy this code:\n" + COPY_TEXT}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)

    def speculative() -> dict:
        workers = tiny_gateway.model_status("tiny")["workers"]
        return (workers[0]["stats"].get("speculative") if workers else None) or {}

    wait_for(lambda: (speculative().get("accepted_tokens") or 0) > 0, 15)
    assert speculative()["mode"] == "prompt_lookup" and speculative()["acceptance_rate"] > 0


# -- configuration ----------------------------------------------------------------------------
def test_speculation_is_configured_per_model():
    reg = parse_registry({"models": [{"name": "a", "speculative": {"mode": "off", "max_draft": 4}}]})
    assert reg.models[0].speculative == SpeculativeConfig(mode="off", max_draft=4)
    with pytest.raises(ConfigError, match="max_draft"):
        parse_registry({"models": [{"name": "a", "speculative": {"max_draft": 0}}]})
    with pytest.raises(ConfigError, match="max_rows"):
        parse_registry({"models": [{"name": "a", "speculative": {"max_rows": 0}}]})


def test_both_kinds_of_step_are_timed_until_the_next_step_starts():
    """mlx-lm reads a prompt chunk after each decode step: a speculative step timed around its
    verification alone, against plain steps timed until the next one, made plain look dearer
    while prompts were read (speculation cost 15% at c = 8 on the agent workload)."""
    from mlxgw.worker.model.speculation.speculative import MIN_SAMPLES, Speculator

    spec = Speculator(SpeculativeConfig())
    for i in range(MIN_SAMPLES):
        spec._open = (spec.plain_cost, 8, 10.0 * i, 8)  # 8 tokens in 1 s, prompt chunk included
        spec._close_step(10.0 * i + 1.0)
        spec._open = (spec.spec_cost, 8, 10.0 * i + 2.0, 12)  # 12 tokens in 1.6 s, chunk included
        spec._close_step(10.0 * i + 3.6)
    assert spec.plain_cost[8].per_token() == pytest.approx(1 / 8)
    assert spec.counters.pauses == 1  # 0.133 s per token against 0.125: speculation loses, pauses
    assert 8 not in spec.spec_cost  # judged afresh when it is tried again


def test_a_step_that_spans_an_idle_gap_is_not_a_cost_sample():
    from mlxgw.worker.model.speculation.speculative import MIN_SAMPLES, CostMeter

    meter = CostMeter()
    for _ in range(MIN_SAMPLES):
        meter.add(0.1, 8)
    before = meter.per_token()
    meter.add(30.0, 8)  # the batch emptied after this step; the next one came 30 s later
    assert meter.per_token() == before


def test_a_clear_loss_pauses_after_two_steps_of_each_kind():
    """At c = 32 a verification of 32 rows x 9 positions costs several decode steps and emits
    little more: waiting for MIN_SAMPLES speculative steps at every batch size kept it going
    for a whole wave (0.45x). Two of each now settle a loss of more than EARLY_LOSS;
    a smaller difference is left to the full comparison."""
    from mlxgw.worker.model.speculation.speculative import EARLY_SAMPLES, Speculator

    spec = Speculator(SpeculativeConfig())
    for i in range(EARLY_SAMPLES):
        spec._open = (spec.plain_cost, 32, 10.0 * i, 32)  # 32 tokens in 1 s
        spec._close_step(10.0 * i + 1.0)
        spec._open = (spec.spec_cost, 32, 10.0 * i + 2.0, 40)  # 40 tokens in 3 s: 2.4x dearer
        spec._close_step(10.0 * i + 5.0)
    assert spec.counters.pauses == 1
    small = Speculator(SpeculativeConfig())
    for i in range(EARLY_SAMPLES):
        small._open = (small.plain_cost, 32, 10.0 * i, 32)
        small._close_step(10.0 * i + 1.0)
        small._open = (small.spec_cost, 32, 10.0 * i + 2.0, 40)  # 40 tokens in 1.25 s: equal
        small._close_step(10.0 * i + 3.25)
    assert small.counters.pauses == 0


def test_batch_sizes_share_cost_meters_by_powers_of_two_and_probe_every_other_step_while_learning():
    from mlxgw.worker.model.speculation.speculative import MIN_SAMPLES, PROBE_EVERY, Speculator, size_bucket

    assert [size_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 32, 64]
    spec = Speculator(SpeculativeConfig())
    due = []
    for step in range(1, 9):
        spec.steps = step
        due.append(spec._probe_due(32))
    assert due == [False, True] * 4  # nothing known at 32: every other step is plain
    for i in range(MIN_SAMPLES):
        spec._open = (spec.plain_cost, 32, 10.0 * i, 32)
        spec._close_step(10.0 * i + 1.0)
    assert sum(spec._probe_due(32) for spec.steps in range(1, PROBE_EVERY + 1)) == 1


def test_the_step_trace_records_every_step_and_its_verifications(tiny_dir, tmp_path, monkeypatch, capsys):
    """MLXGW_STEP_TRACE (worker/model/runners/step_trace.py) writes one line per step, and bench/step/trace.py
    accounts for every generated token, with the verifications apart from plain steps."""
    from mlxgw.bench.step.trace import load, main, report

    monkeypatch.setenv("MLXGW_STEP_TRACE", str(tmp_path))
    traced = speculative_runner(tiny_dir, SpeculativeConfig(mode="prompt_lookup"))
    prompt = _copy_prompt(traced)
    out = generate_together(traced, [(prompt, 30, GREEDY), (prompt[:-3], 20, GREEDY)])
    (path,) = tmp_path.glob("*.jsonl")
    header, steps = load(path)
    assert header["speculative"] == "prompt_lookup"
    assert sum(s["emitted"] for s in steps) == sum(len(o) for o in out) == 50
    assert sum(s["read"] for s in steps) >= len(prompt) - 1
    assert sum(s["spec"] for s in steps) == traced.speculator.counters.speculative_steps > 0
    assert all(s["width"] is None or s["held"] <= s["rows_after"] * s["width"] for s in steps)
    rows, md = report(tmp_path)
    assert len(rows) == 1 and rows[0]["tokens"] == 50 and rows[0]["spec_steps"] > 0 and "prompt_lookup" in md
    capsys.readouterr()
    main([str(tmp_path)])
    printed = capsys.readouterr().out
    assert "verifying / plain" in printed and "| 2 |" in printed  # two rows decoded, some steps verified


def test_a_step_trace_folder_that_cannot_be_written_does_not_stop_the_model(tmp_path, monkeypatch, caplog):
    from mlxgw.worker.model.runners.step_trace import StepTrace

    monkeypatch.setenv("MLXGW_STEP_TRACE", str(tmp_path / "missing" / "folder"))
    assert StepTrace.from_env({"model": "m"}) is None
    assert "no step trace" in caplog.text
    monkeypatch.setenv("MLXGW_STEP_TRACE", str(tmp_path))
    assert StepTrace.from_env({"model": "m"}) is not None
