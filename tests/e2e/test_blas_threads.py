"""The CPU BLAS's thread count per kind of step (worker/model/cpu/blas_threads.py): the choice follows
the measured step times, trials of the other count get rarer the dearer it is, a changed
count never changes a token, and the control reaches the OpenBLAS the worker preloads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlxgw.shared.platform import openblas_path
from mlxgw.worker.model.cpu.blas_threads import (
    BUSY_RATIO,
    CAP,
    FIRST_INTERVAL,
    MAX_INTERVAL,
    SAMPLES,
    TRIAL_STEPS,
    BlasThreadPolicy,
    KindChoice,
)


def run_kind(choice: KindChoice, cost: dict[int, float], steps: int) -> list[int]:
    """Steps of one kind whose time depends only on the thread count; the counts used."""
    used, previous = [], None
    for _ in range(steps):
        count = choice.choose()
        choice.record(count, cost[count], after_change=previous is not None and count != previous)
        used.append(count)
        previous = count
    return used


def test_a_quiet_host_keeps_every_thread_and_trials_one_rarely():
    choice = KindChoice((1, 2))
    used = run_kind(choice, {1: 0.129, 2: 0.096}, 1000)
    assert choice.current == 2
    assert used.count(1) <= 2 * (TRIAL_STEPS + 1) + (1000 // MAX_INTERVAL + 1) * (TRIAL_STEPS + 1)
    assert choice.interval == MAX_INTERVAL


def test_a_busy_host_moves_to_one_thread_and_trials_the_dear_count_rarely():
    choice = KindChoice((1, 2))
    used = run_kind(choice, {1: 0.253, 2: 0.871}, 300)
    first_one = used.index(1)
    assert first_one == SAMPLES  # the count in use is measured, then the other is tried
    assert choice.current == 1
    # 3.4x dearer: the first interval is already 16 * 2 * 3.4 steps, not 16
    assert choice.interval > 4 * FIRST_INTERVAL
    assert used[first_one + TRIAL_STEPS + 1 :].count(2) <= 2 * (TRIAL_STEPS + 1)


def test_a_host_that_gets_busy_then_quiet_is_followed():
    choice = KindChoice((1, 2))
    run_kind(choice, {1: 0.129, 2: 0.096}, 100)
    assert choice.current == 2
    # the count in use gets dear: its own samples show it, and the next trial finds the other
    run_kind(choice, {1: 0.253, 2: 0.871}, MAX_INTERVAL + 2 * (TRIAL_STEPS + 1))
    assert choice.current == 1
    run_kind(choice, {1: 0.129, 2: 0.096}, 2 * MAX_INTERVAL + 2 * (TRIAL_STEPS + 1))
    assert choice.current == 2


def test_a_host_that_gets_busy_after_a_quiet_start_is_followed_at_once():
    """Settled on two threads with its trials far apart, the host gets busy: the count in use
    now costs far more than one thread did when last tried, so that is tried within a few
    steps, not an interval later."""
    choice = KindChoice((1, 2))
    run_kind(choice, {1: 0.129, 2: 0.096}, 300)
    assert choice.current == 2 and choice.interval >= 4 * FIRST_INTERVAL
    used = run_kind(choice, {1: 0.150, 2: 0.800}, SAMPLES + TRIAL_STEPS + 2)
    assert choice.current == 1 and used[-1] == 1


def test_counts_within_the_margin_do_not_flip_on_noise():
    """Two counts a few percent apart, each step off by up to +-4%: the count in use stays,
    where a bare comparison of medians flipped on the noise."""
    import random

    rng = random.Random(7)
    choice = KindChoice((1, 2))
    used, previous = [], None
    for _ in range(1000):
        count = choice.choose()
        cost = (0.100 if count == 2 else 0.102) * (1 + rng.uniform(-0.04, 0.04))
        choice.record(count, cost, after_change=previous is not None and count != previous)
        used.append(count)
        previous = count
    assert choice.current == 2
    assert used.count(1) <= 2 * (TRIAL_STEPS + 1) + (1000 // MAX_INTERVAL + 1) * (TRIAL_STEPS + 1)


def test_a_step_that_spanned_an_idle_wait_is_not_a_sample_and_a_long_one_counts_capped():
    choice = KindChoice((1, 2))
    run_kind(choice, {1: 0.2, 2: 0.1}, 20)
    before = list(choice.times[2])
    choice.record(2, 60.0, after_change=False)  # 600x: a wait with nothing to do
    assert list(choice.times[2]) == before
    choice.record(2, 4.0, after_change=False)  # 40x: a step that waited for a core counts, capped
    assert choice.times[2][-1] == pytest.approx(CAP * 0.1)


def test_a_busy_host_whose_two_thread_steps_stall_now_and_then_moves_to_one_thread():
    """Traced on a busy host at 8 rows: two threads' steps took 170-250 ms or 3.5-4 s, one
    thread's 220-380 ms. The median of three, with the stalls dropped as idle waits, kept two
    threads; their mean is what the host pays."""
    choice = KindChoice((1, 2))
    stalls = iter([0.2, 3.8, 0.19, 0.21, 3.6, 0.2, 3.9, 0.18, 3.7] * 100)
    used, previous = [], None
    for _ in range(300):
        count = choice.choose()
        cost = next(stalls) if count == 2 else 0.3
        choice.record(count, cost, after_change=previous is not None and count != previous)
        used.append(count)
        previous = count
    assert choice.current == 1 and used[-100:].count(2) <= 2 * (TRIAL_STEPS + 1)


class Control:
    """OpenBLAS's process-wide count, as a value (the decision logic's unit test)."""

    def __init__(self, n: int):
        self.n, self.calls = n, []

    def get(self) -> int:
        return self.n

    def set(self, n: int) -> None:
        self.calls.append(n)
        self.n = n


def test_the_policy_changes_the_count_only_between_steps_after_synchronising():
    control, synced = Control(2), []
    policy = BlasThreadPolicy(control, lambda: synced.append(control.n))
    for _ in range(SAMPLES + TRIAL_STEPS + 2):
        policy.start(decode_rows=1, reads_prompt=False)
    assert control.calls[0] == 1 and synced[0] == 2  # synchronised while still at 2
    policy.start(decode_rows=0, reads_prompt=False)  # nothing runs: no step, no sample
    assert policy._open is None
    assert (
        policy.kind(3, False) == (4, False)
        and policy.kind(16, True) == (16, True)
        and policy.kind(1, False) == (1, False)
    )


def test_a_pinned_step_runs_at_every_thread_and_is_not_a_sample():
    control = Control(2)
    policy = BlasThreadPolicy(control, lambda: None)
    for _ in range(SAMPLES + 1):
        policy.start(decode_rows=1, reads_prompt=False)  # measured at 2, then 1 is tried
    assert control.n == 1
    samples = {n: list(t) for n, t in policy.kinds[(1, False)].times.items()}
    policy.start(decode_rows=1, reads_prompt=False, pinned=True)  # a seeded row joined
    assert control.n == 2 and policy._open is None
    policy.start(decode_rows=1, reads_prompt=False, pinned=True)
    assert {n: list(t) for n, t in policy.kinds[(1, False)].times.items()} == samples


def test_samples_are_per_position_and_a_verification_is_none(monkeypatch):
    """A step's time counts per position it fed: one thread, 1.3x slower per position, tried
    on steps that read shorter prompt chunks, is still found slower. A speculative
    verification (its width decides its time) is no sample."""
    from mlxgw.worker.model.cpu import blas_threads

    control, clock = Control(2), [0.0]
    monkeypatch.setattr(blas_threads.time, "perf_counter", lambda: clock[0])
    policy = BlasThreadPolicy(control, lambda: None)
    for _ in range(4 * (SAMPLES + TRIAL_STEPS + 2)):
        policy.start(decode_rows=16, reads_prompt=True)
        positions = 16 + (200 if control.n == 2 else 40)  # the trials happen to read short chunks
        clock[0] += positions * (0.001 if control.n == 2 else 0.0013)
        policy.done(positions)
    choice = policy.kinds[(16, True)]
    assert choice.current == 2 and all(len(t) == SAMPLES for t in choice.times.values())
    kept = {n: list(t) for n, t in choice.times.items()}
    policy.start(decode_rows=16, reads_prompt=True)
    clock[0] += 5.0  # a wide verification
    policy.done(16 * 9, sample=False)
    policy.start(decode_rows=16, reads_prompt=True)
    assert {n: list(t) for n, t in choice.times.items()} == kept


def run_policy(policy: BlasThreadPolicy, control, clock: list, kind: tuple[int, bool], cost: dict, steps: int):
    """Steps of one kind through the policy, each taking cost[count] per position; the counts used."""
    used, (rows, prompt) = [], kind
    for _ in range(steps):
        policy.start(decode_rows=rows, reads_prompt=prompt)
        used.append(control.n)
        clock[0] += cost[control.n] * rows
        policy.done(rows)
    return used


def test_a_busy_hosts_verdict_is_followed_by_kinds_that_have_not_learned_alone(monkeypatch):
    """Traced with two busy loops at c = 32: every kind of step learned alone, starting at two
    threads for three samples, and a burst met a dozen kinds (a new kind's two-thread steps
    3.5-17 s, one thread's 0.2-2). Once one kind finds one thread far cheaper, a kind seen for
    the first time runs at one thread and tries two threads only once the host's verdict is
    gone; on a quiet host (1.3x apart) every kind still learns alone."""
    from mlxgw.worker.model.cpu import blas_threads

    control, clock = Control(2), [0.0]
    monkeypatch.setattr(blas_threads.time, "perf_counter", lambda: clock[0])
    policy = BlasThreadPolicy(control, lambda: None)
    busy, quiet = {1: 0.25, 2: 3.8}, {1: 0.129, 2: 0.096}
    run_policy(policy, control, clock, (1, False), busy, SAMPLES + TRIAL_STEPS + 3)
    assert policy.host == 1 and policy.summary()["host"] == 1
    for kind in [(16, True), (32, False), (8, True)]:
        assert set(run_policy(policy, control, clock, kind, busy, 3 * (SAMPLES + TRIAL_STEPS))) == {1}, kind
    # the host gets quiet: the kind that measured both finds it at its next trial, and the
    # verdict no longer holds, so the others learn alone again from their own samples
    steps = 0
    while policy.host is not None and steps < 2 * MAX_INTERVAL:
        run_policy(policy, control, clock, (1, False), quiet, 1)
        steps += 1
    assert policy.host is None
    used = run_policy(policy, control, clock, (16, True), quiet, SAMPLES + 2 * TRIAL_STEPS + 2)
    assert 2 in used and policy.kinds[(16, True)].current == 2
    # a quiet verdict is no host verdict: a new kind starts at every thread and tries one
    fresh = BlasThreadPolicy(Control(2), lambda: None)
    run_policy(fresh, fresh.control, clock, (1, False), quiet, SAMPLES + TRIAL_STEPS + 3)
    assert fresh.kinds[(1, False)].current == 2 and fresh.host is None and quiet[1] / quiet[2] < BUSY_RATIO
    assert run_policy(fresh, fresh.control, clock, (8, False), quiet, 1) == [2]


def test_a_single_thread_blas_has_no_policy():
    assert not BlasThreadPolicy(Control(1), lambda: None).active


@pytest.mark.skipif(openblas_path() is None, reason="needs the Linux OpenBLAS the worker preloads")
def test_the_count_reaches_the_preloaded_openblas_and_changes_no_token(smollm2_dir):
    """In a process with the worker's environment: the control sets OpenBLAS's count, and
    greedy tokens at batch 1 and 3 are the same whatever the count."""
    from mlxgw.shared.platform import worker_environment

    script = f"""
import pathlib
from mlxgw.shared.platform import blas_threads
from mlxgw.shared.protocol import SamplingParams
from mlxgw.worker.model.interfaces import Row
from mlxgw.worker.process.build_mlx import build_mlx_runner

control = blas_threads()
assert control is not None
most = control.get()
control.set(1); assert control.get() == 1
control.set(most)

# One runner for every count (a load per decode cost seconds each): with no prefix
# cache, nothing of one decode's rows is left for the next.
r = build_mlx_runner(pathlib.Path({str(smollm2_dir)!r}), context_length=None, max_num_seqs=4, prefill_step_size=64,
                     cache_bytes=0)
r.blas = None  # this test sets the count itself

def decode(rows, threads):
    control.set(threads)
    greedy = SamplingParams(temperature=0.0)
    uids = [r.insert(Row(list(range(100 + 7 * i, 160 + 7 * i)), 24, greedy))[0] for i in range(rows)]
    got = {{u: [] for u in uids}}
    while any(len(v) < 24 for v in got.values()):
        for t in r.step().tokens:
            got[t.uid].append(t.token)
    return [got[u][:24] for u in uids]

for rows in (1, 3):
    assert decode(rows, 1) == decode(rows, max(2, most)), rows
print("ok")
"""
    env = worker_environment()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_policy_is_off_where_asked():
    env = {**os.environ, "MLXGW_ADAPTIVE_BLAS": "0"}
    code = (
        "import mlx.core as mx; from mlxgw.worker.model.cpu.blas_threads import policy_for; print(policy_for(mx, None))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "None", out.stderr[-2000:]
