"""Within a latency class the shortest read goes first (worker/schedule/fair_share.py): a warm
turn whose prompt the prefix cache holds is admitted ahead of new sessions' long prompts, and
a long read is always in progress beside the short ones, so long prompts are never starved.

The policy over its own data, then the real Scheduler over the real MLXRunner with a prefix
cache (tiny model): counted in steps, not seconds, so it holds on a loaded machine."""

from __future__ import annotations

import pytest

from mlxgw.shared.protocol import GenerateRequest, SamplingParams
from mlxgw.worker.schedule.fair_share import FairQueue, Row, Waiting

BUDGET = 128
GREEDY = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})  # no end-of-sequence


def _waiting(rid: str, left: int, due: float, target_s: float = 3.0) -> Waiting:
    entry = Waiting(0, int(due * 1000), rid, due=due, target_s=target_s)
    entry.left = left
    return entry


def _reading(tokens: int, target_s: float = 3.0) -> Row:
    return Row("r", "", 1.0, 0, 0, True, prefilling=tokens > 0, target_s=target_s, reading=tokens)


def _queue(*entries: Waiting) -> FairQueue:
    queue = FairQueue(enabled=True)
    for entry in entries:
        queue.push(entry)
    return queue


def test_the_shortest_read_of_the_class_goes_first_while_a_long_one_is_being_read():
    queue = _queue(_waiting("first-a", 400, 1.0), _waiting("first-b", 400, 2.0), _waiting("warm", 60, 3.0))
    assert queue.pop([_reading(300)]).rid == "warm"
    assert queue.pop([_reading(300)]).rid == "first-a"  # equal reads: the oldest


@pytest.mark.parametrize("rows", [[], [_reading(0)], [_reading(40)], [_reading(300, target_s=60.0)]])
def test_the_oldest_goes_first_while_no_row_of_its_class_reads_a_longer_prompt(rows):
    """Nothing reading, a row decoding, a row reading less than the shortest waiting one, or
    a long read of another class: the oldest of the class starts, so long prompts progress."""
    queue = _queue(_waiting("first-a", 400, 1.0), _waiting("warm", 60, 3.0))
    assert queue.pop(rows).rid == "first-a"


def test_shortest_first_stays_within_the_most_urgent_class():
    queue = _queue(_waiting("agent-warm", 20, 2.0), _waiting("file-open", 700, 0.9, target_s=0.5))
    assert queue.peek([_reading(300, target_s=0.5)]).rid == "file-open"  # the editor class leads
    assert queue.pop([_reading(300, target_s=0.5)]).rid == "file-open"
    assert queue.pop([]).rid == "agent-warm"
    assert not queue


# -- the real scheduler and runner, with a prefix cache ---------------------------------------
@pytest.fixture(scope="module")
def runner(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(
        str(tiny_dir), context_length=None, max_num_seqs=8, prefill_step_size=BUDGET, cache_bytes=64 << 20
    )


def _scheduler(runner):
    from mlxgw.worker.schedule.prefill_plan import PrefillPace
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner.cache_clear()
    runner.set_prefill_chunk(BUDGET)
    pace = PrefillPace()
    pace.observe(1_000_000, 1.0)  # a measured, fast host: admission alone decides
    return Scheduler(runner, max_num_seqs=8, max_queue=16, prefill_budget=BUDGET, pace=pace)


def _tokens(seed: int, length: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 5000 for i in range(length)]


def _submit(sched, rid: str, tokens: list[int], max_tokens: int) -> None:
    req = GenerateRequest(rid=rid, prompt_tokens=tokens, max_tokens=max_tokens, sampling=GREEDY)
    ((_, ev),) = sched.submit(req)
    assert ev.KIND == "accepted", ev


def _first_token_steps(sched, rids: set[str]) -> dict[str, int]:
    first: dict[str, int] = {}
    step = 0
    while sched.has_work():
        step += 1
        ended = {rid for rid, ev in sched.step() if ev.KIND in ("finish", "error")}
        started = ended | {r["id"] for r in sched.requests() if r["ttft_s"] is not None}
        for rid in (started & rids) - first.keys():
            first[rid] = step
    return first


def _after_a_first_turn(runner):
    """A scheduler whose prefix cache holds one 200-token session, and that session."""
    sched = _scheduler(runner)
    session = _tokens(1, 200)
    _submit(sched, "turn1", session, 2)
    while sched.has_work():
        sched.step()
    return sched, session


def test_the_cache_estimate_counts_the_whole_blocks_a_finished_prompt_left(runner):
    sched, session = _after_a_first_turn(runner)
    assert 160 <= runner.cached_tokens(session + _tokens(2, 30)) <= 200  # whole 32-token blocks
    assert runner.cached_tokens(_tokens(3, 200)) == 0
    assert runner.cached_tokens(session, "another-key") == 0  # another scope holds nothing


def test_a_warm_turn_overtakes_new_sessions_queued_before_it(runner):
    sched, session = _after_a_first_turn(runner)
    firsts = [f"first{i}" for i in range(6)]
    for i, rid in enumerate(firsts):
        _submit(sched, rid, _tokens(10 + i, 3 * BUDGET), 2)
    _submit(sched, "warm", session + _tokens(2, 30), 2)  # arrives last, reads ~40 tokens
    first = _first_token_steps(sched, {"warm", *firsts})
    # Before, first come first served: four 384-token reads took the prompt budget and the
    # warm turn waited for them (12 steps); now it starts beside the oldest one.
    assert first["warm"] <= 3, first
    assert first["warm"] < min(first[rid] for rid in firsts), first
    assert first["first0"] <= min(first[rid] for rid in firsts[1:]), first  # the oldest kept reading
