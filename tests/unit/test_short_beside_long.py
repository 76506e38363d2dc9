"""A short prompt arriving while a long one is read gets its first token in the next step,
and that step is short: the long read yields the step's length to it and keeps progressing.

The prefilling rows are one right-padded batch (worker/model/runners/batch_generator.py): a
step costs rows x the longest chunk. A 20-token chat sent beside a ~6,000-token prompt
shared the long one's step, padded to its chunk (a 512-token chunk at 64 tokens/s: an 8-s
step), and waited 27 s for its first token where alone it took 0.3 s.

The real Scheduler over the real MLXRunner (tiny model), on a host made slow on purpose
(MLXGW_TEST_SLOW_PREFILL_MS: every padded prompt token a forward reads costs time,
worker/process/step_progress.py). Bounds count steps and the tokens a step's forwards read,
padding included (what a step's time is made of), not seconds."""

from __future__ import annotations

import time

import pytest

from mlxgw.shared.protocol import GenerateRequest, SamplingParams

BUDGET = 128
SLOW_MS = 1.0  # a prompt token read costs 1 ms more: a 512-token step is half a second
LONG, SHORT = 3000, 20
GREEDY = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})  # no end-of-sequence


class PaddedReads:
    """The runner, counting the tokens each step's prompt forwards read, padding included."""

    def __init__(self, runner):
        self.runner = runner
        self.steps: list[int] = []
        self._read = 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def count(self, tokens: int) -> None:
        self._read += tokens

    def step(self):
        self._read = 0
        out = self.runner.step()
        self.steps.append(self._read)
        return out


@pytest.fixture(scope="module")
def host(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner
    from mlxgw.worker.process.step_progress import SLOW_ENV, install

    runner = build_mlx_runner(
        str(tiny_dir), context_length=None, max_num_seqs=4, prefill_step_size=BUDGET, cache_bytes=0
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SLOW_ENV, str(SLOW_MS))
        install(runner.model, lambda: None)  # the slow host: read at install
    wrapped = PaddedReads(runner)
    first = runner.model.layers[0]
    base = type(first)

    class Counting(base):  # the first layer sees every forward's (rows, tokens) input
        def __call__(self, x, *args, **kwargs):
            if x.ndim >= 2 and x.shape[1] > 1:
                wrapped.count(int(x.shape[0]) * int(x.shape[1]))
            return base.__call__(self, x, *args, **kwargs)

    first.__class__ = Counting
    return wrapped


def _scheduler(host):
    from mlxgw.worker.schedule.prefill_plan import PrefillPace
    from mlxgw.worker.schedule.scheduler import Scheduler

    host.cache_clear()
    host.set_prefill_chunk(BUDGET)
    # a measured rate the step bounds never cut: the plan alone decides every chunk
    pace = PrefillPace(max_step_s=1e6, max_step_decoding_s=1e6)
    pace.observe(1_000_000, 1.0)
    return Scheduler(host, max_num_seqs=4, max_queue=8, prefill_budget=BUDGET, pace=pace)


def _submit(sched, rid: str, tokens: list[int], max_tokens: int) -> None:
    ((_, ev),) = sched.submit(GenerateRequest(rid=rid, prompt_tokens=tokens, max_tokens=max_tokens, sampling=GREEDY))
    assert ev.KIND == "accepted", ev


def _run(sched, until: str | None = None) -> dict[str, str]:
    """Step until `until` has its first output (None: until nothing is left); the text each
    request got meanwhile."""
    text: dict[str, str] = {}
    while sched.has_work():
        for rid, ev in sched.step():
            if ev.KIND in ("delta", "finish"):
                text[rid] = text.get(rid, "") + (ev.text or "")
        if until is not None and until in text:
            break
    return text


def _left_to_read(sched, rid: str) -> int:
    (seq,) = [s for s in sched.admission.running.values() if s.req.rid == rid]
    return seq.to_prefill


LONG_PROMPT = [100 + (7 * i) % 5000 for i in range(LONG)]
SHORT_PROMPT = [200 + 3 * i for i in range(SHORT)]


# -- the plan, as a specification ---------------------------------------------------------
def test_a_step_with_a_short_row_beside_a_long_one_is_sized_to_the_short_row():
    from mlxgw.worker.schedule.prefill_plan import step_chunk

    assert step_chunk([3000, 19], 512) == 64  # not 256: 2 x 64 is a quarter of the step
    assert step_chunk([3000, 100], 512) == 100  # the short row's whole prompt, in one step
    assert step_chunk([3000, 19, 40], 512) == 42  # the floor: 512 / 4 across 3 rows
    assert step_chunk([3000, 2000], 512) == 256  # no row finishes: the even split
    assert step_chunk([19, 40], 512) == 256  # every row finishes: nobody waits on the padding
    assert step_chunk([3000], 512) == 512


# -- the real scheduler and runner ---------------------------------------------------------
def test_a_short_prompt_beside_a_long_read_gets_its_first_token_in_a_short_next_step(host):
    alone = _scheduler(host)
    _submit(alone, "long", LONG_PROMPT, 4)
    expected = _run(alone)["long"]

    sched = _scheduler(host)
    _submit(sched, "long", LONG_PROMPT, 4)
    sched.step()
    sched.step()  # the long prompt is being read, a step budget at a time
    long_step = host.steps[-1]
    assert long_step > 4 * SHORT
    _submit(sched, "short", SHORT_PROMPT, 4)
    left = _left_to_read(sched, "long")
    arrived, steps_before = time.monotonic(), len(host.steps)
    _run(sched, until="short")
    waited_s = time.monotonic() - arrived
    steps = host.steps[steps_before:]
    print(
        f"short's first token: {len(steps)} steps reading {steps} padded tokens, {waited_s:.2f} s (long: {long_step})"
    )
    assert len(steps) <= 2, steps
    # the steps up to its first token did not pad it to the long read's chunk
    assert sum(steps) <= long_step // 4, (steps, long_step)
    assert _left_to_read(sched, "long") < left  # the long read kept progressing meanwhile
    assert _run(sched)["long"] == expected  # and ends with the tokens it gets alone


def test_only_a_row_of_the_most_urgent_class_finishing_sizes_the_step():
    from mlxgw.worker.schedule.prefill_plan import step_chunk

    assert step_chunk([3000, 3000, 9], 512, sizing=[9]) == 42  # a keystroke beside two reads: its step
    assert step_chunk([3000, 3000, 9], 512, sizing=[3000, 3000]) == 170  # an agent's 9 beside file opens


def test_a_short_step_nudges_the_prompt_rate_and_a_slow_one_still_cuts_it():
    from mlxgw.worker.schedule.prefill_plan import PrefillPace

    pace = PrefillPace()
    pace.observe(256, 2.5, prompt_s=2.0, decoding=True)  # 128 tokens/s
    pace.observe(9, 0.6, prompt_s=0.1, decoding=True)  # 9 tokens in 0.1 s: the forward's fixed cost
    assert pace.tokens_per_s > 120  # it was 109 (the slower of the two readings led)
    pace.observe(9, 9.0, prompt_s=8.5, decoding=True)  # 9 tokens in 8.5 s: the host got slow
    assert pace.tokens_per_s < 60
