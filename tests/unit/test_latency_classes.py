"""Latency classes in the worker: the most urgent waiting work runs first (by arrival + its
class's target), an urgent request takes a row from a less urgent class, a superseded row
leaves the batch before the next step, and a step beside decoding rows is sized to a few of
their decode steps.

The real Scheduler over the real MLXRunner (tiny model); bounds count steps and the rows
each forward carries, not seconds."""

from __future__ import annotations

import time

import pytest

from mlxgw.shared.protocol import BACKGROUND_PRIORITY, GenerateRequest, SamplingParams
from mlxgw.worker.schedule.prefill_plan import PrefillBudget, PrefillPace

BUDGET = 128
GREEDY = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})  # no end-of-sequence


class Forwards:
    """The runner, recording each step's forwards as (rows, tokens) of their input."""

    def __init__(self, runner):
        self.runner = runner
        self.steps: list[list[tuple[int, int]]] = []
        self._now: list[tuple[int, int]] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def record(self, rows: int, tokens: int) -> None:
        self._now.append((rows, tokens))

    def step(self):
        self._now = []
        out = self.runner.step()
        self.steps.append(self._now)
        return out


@pytest.fixture(scope="module")
def host(tiny_dir):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(
        str(tiny_dir), context_length=None, max_num_seqs=4, prefill_step_size=BUDGET, cache_bytes=0
    )
    wrapped = Forwards(runner)
    first = runner.model.layers[0]
    base = type(first)

    class Recording(base):  # the first layer sees every forward's (rows, tokens) input
        def __call__(self, x, *args, **kwargs):
            if x.ndim >= 2:
                wrapped.record(int(x.shape[0]), int(x.shape[1]))
            return base.__call__(self, x, *args, **kwargs)

    first.__class__ = Recording
    return wrapped


def _scheduler(host, max_num_seqs: int):
    from mlxgw.worker.schedule.scheduler import Scheduler

    host.cache_clear()
    pace = PrefillPace(max_step_s=1e6, max_step_decoding_s=1e6)
    pace.observe(1_000_000, 1.0)
    return Scheduler(host, max_num_seqs=max_num_seqs, max_queue=16, prefill_budget=BUDGET, pace=pace)


def _submit(sched, rid: str, length: int, max_tokens: int, latency: str | None = None, **kw) -> None:
    tokens = [100 + (sum(map(ord, rid)) * 7 + i) % 5000 for i in range(length)]
    req = GenerateRequest(
        rid=rid, prompt_tokens=tokens, max_tokens=max_tokens, sampling=GREEDY, latency_class=latency, **kw
    )
    ((_, ev),) = sched.submit(req)
    assert ev.KIND == "accepted", ev


def _first_tokens(sched, until: str | None = None) -> list[str]:
    """Step until `until` has its first token (None: until no work is left); the requests in
    the order their first tokens came."""
    order: list[str] = []
    while sched.has_work():
        for rid, ev in sched.step():
            if ev.KIND in ("delta", "finish") and rid not in order:
                order.append(rid)
        if until in order:
            break
    return order


def _running(sched) -> set[str]:
    return {s.req.rid for s in sched.admission.running.values()}


def test_an_editor_keystroke_overtakes_queued_agent_chat_and_background_work(host):
    sched = _scheduler(host, max_num_seqs=1)
    _submit(sched, "batch", 8, 3, "background", priority=BACKGROUND_PRIORITY)
    _submit(sched, "agent-1", 8, 2, "agent")
    _submit(sched, "agent-2", 8, 2, "agent")
    _submit(sched, "chat", 8, 2, "chat")
    _submit(sched, "keystroke", 8, 2, "editor")  # arrives last, owed first
    assert sched.admission._pace_steps() == 1  # a typist types: a step reads what one decode step takes
    order = _first_tokens(sched)
    assert order == ["keystroke", "chat", "agent-1", "agent-2", "batch"], order


def test_an_urgent_request_takes_the_row_of_a_less_urgent_class(host):
    sched = _scheduler(host, max_num_seqs=1)
    _submit(sched, "agent", 8, 64, "agent")
    _first_tokens(sched, until="agent")
    _submit(sched, "keystroke", 8, 2, "editor", ttft_target_s=0.01)
    time.sleep(0.01)  # it has waited past half its target: the agent's row is its
    steps = len(host.steps)
    _first_tokens(sched, until="keystroke")
    assert len(host.steps) - steps <= 2, host.steps[steps:]
    order = _first_tokens(sched)
    assert order == ["keystroke", "agent"], order  # the paused agent resumes and ends


def test_an_editor_request_starts_beside_four_agent_reads_that_keep_a_fifth_agent_out(tiny_dir):
    """Four rows reading long prompts hold the step's prompt budget in four shares: a fifth
    agent waits for one to finish, but a less urgent read never keeps an editor's out (three
    file opens and every keystroke after them waited minutes for agents' first turns)."""
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(
        str(tiny_dir), context_length=None, max_num_seqs=8, prefill_step_size=BUDGET, cache_bytes=0
    )
    sched = _scheduler(runner, max_num_seqs=8)
    for i in range(5):
        _submit(sched, f"agent-{i}", 3000, 2, "agent")
    sched.step()
    assert _running(sched) == {f"agent-{i}" for i in range(4)}
    _submit(sched, "file-open", 3000, 2, "editor")
    sched.step()
    assert "file-open" in _running(sched) and "agent-4" not in _running(sched)
    for rid in ["file-open"] + [f"agent-{i}" for i in range(5)]:
        sched.cancel(rid)


def test_a_superseded_row_leaves_the_batch_before_the_next_step_under_load(host):
    sched = _scheduler(host, max_num_seqs=4)
    _submit(sched, "file-open", 3000, 2, "agent")  # a long read, a budget a step
    _submit(sched, "chat-1", 8, 64, "chat")
    _submit(sched, "chat-2", 8, 64, "chat")
    _submit(sched, "keystroke", 8, 64, "editor")
    _first_tokens(sched, until="keystroke")
    _first_tokens(sched, until="chat-2")
    sched.step()
    assert max(rows for rows, tokens in host.steps[-1] if tokens == 1) == 3  # three rows decode
    events = sched.cancel("keystroke")  # a newer keystroke superseded it (the gateway's cancel)
    assert [ev.KIND for _, ev in events] == ["finish"]
    sched.step()
    decode = [rows for rows, tokens in host.steps[-1] if tokens == 1]
    assert decode and max(decode) == 2, host.steps[-1]  # it is not in the next step's batch
    assert "keystroke" not in _running(sched) and "file-open" in _running(sched)
    sched.cancel("chat-1"), sched.cancel("chat-2"), sched.cancel("file-open")


def test_the_classes_are_reported_with_their_first_token_times(host):
    sched = _scheduler(host, max_num_seqs=2)
    _submit(sched, "keystroke", 8, 2, "editor", ttft_target_s=30.0)
    _submit(sched, "waits", 8, 2)  # an older gateway's request: chat
    _submit(sched, "waits-too", 8, 2, "background", priority=BACKGROUND_PRIORITY)
    classes = sched.counters()["classes"]
    assert classes["chat"]["waiting"] == 1 and classes["background"]["waiting"] == 1
    _first_tokens(sched)
    classes = sched.counters()["classes"]
    editor = classes["editor"]
    assert editor["answered"] == 1 and editor["late"] == 0 and editor["target_s"] == 30.0
    assert editor["ttft_p50_s"] is not None and editor["within_target"] == 1.0
    assert classes["chat"]["answered"] == 1 and classes["agent"]["answered"] == 0


def test_a_step_beside_decoding_rows_reads_what_a_few_decode_steps_take():
    from mlxgw.worker.schedule.prefill_plan import MIN_STEP_WHILE_DECODING_S

    pace = PrefillPace()
    pace.observe(0, 0.25)  # a decode step of this host: 0.25 s
    pace.observe(256, 4.25)  # 256 prompt tokens in 4 s beside it: 64 tokens/s
    assert pace.tokens_per_s == 64
    assert pace.cap(512, decoding=True, decode_steps=4) == 64  # 4 decode steps (1 s) of prompt reading
    assert pace.cap(512, decoding=True) == 256  # no editor about: the 4 s bound beside decoding rows
    assert pace.cap(512) == 32  # nobody decodes: a step of 0.5 s (a request arriving waits for it)
    fast = PrefillPace()
    fast.observe(0, 0.01)
    fast.observe(5000, 1.0)
    assert fast.step_s(decoding=True, decode_steps=4) == MIN_STEP_WHILE_DECODING_S  # milliseconds steps: a floor


def test_a_keystroke_keeps_the_steps_beside_decoding_rows_short_for_a_while():
    from mlxgw.worker.schedule.prefill_plan import EDITOR_RECENT_S

    budget = PrefillBudget(512)
    budget.pace.observe(0, 0.25)
    budget.pace.observe(256, 4.25)  # 64 prompt tokens/s beside a 0.25 s decode step

    class Row:
        to_prefill = 0  # a decoding row

    budget.start_step([Row()])
    assert budget.step_budget == 256  # agents alone: a 4 s step reads their first turns
    budget.start_step([Row()], decode_steps=4)
    assert budget.step_budget == 64  # a typist about: a step is four decode steps
    assert EDITOR_RECENT_S >= 5  # a burst's keystrokes are seconds apart


def test_steps_read_one_decode_step_while_a_typist_types_and_four_while_an_editor_is_about(host):
    from mlxgw.worker.schedule.prefill_plan import DECODE_STEPS_PER_PREFILL, EDITOR_RECENT_S, TYPING_S

    admission = _scheduler(host, max_num_seqs=2).admission
    assert admission._pace_steps() == 0  # no editor: steps beside decoding rows may take 4 s
    admission.keystroke_at = time.monotonic()
    assert admission._pace_steps() == 1  # a keystroke now: the next waits one step, then its own
    admission.keystroke_at -= TYPING_S
    assert admission._pace_steps() == DECODE_STEPS_PER_PREFILL  # between bursts
    admission.keystroke_at -= EDITOR_RECENT_S
    assert admission._pace_steps() == 0


@pytest.mark.parametrize("latency", ["editor", "agent"])
def test_an_editor_s_file_outlasts_other_rows_in_the_prefix_cache(tiny_dir, latency):
    """An editor's prompt is held (its blocks leave the cache after every unheld one): the
    agents' turns after it evict the control's file, not the editor's."""
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    probe = build_mlx_runner(
        str(tiny_dir), context_length=None, max_num_seqs=4, prefill_step_size=BUDGET, cache_bytes=0
    )
    per_token = probe.stats()["kv_bytes_per_token"]
    runner = build_mlx_runner(
        str(tiny_dir), context_length=None, max_num_seqs=4, prefill_step_size=BUDGET, cache_bytes=per_token * 700
    )
    sched = _scheduler(runner, max_num_seqs=4)
    _submit(sched, "file", 300, 1, latency)
    _first_tokens(sched)
    for i in range(3):  # 900 more tokens through a 700-token cache
        _submit(sched, f"agent-{i}", 300, 1, "agent")
        _first_tokens(sched)
    tokens = [100 + (sum(map(ord, "file")) * 7 + i) % 5000 for i in range(300)]
    cached = runner.cached_tokens(tokens)
    assert (cached >= 256) if latency == "editor" else (cached == 0), (latency, cached)


def test_a_request_s_class_is_its_route_s_or_asked_and_never_above_its_key_s_grant():
    from mlxgw.gateway.access.keys import ApiKey
    from mlxgw.gateway.pipeline.latency_class import classify, route_class

    assert route_class({"prefix": "a"}, None) == "editor"
    assert route_class(None, [{"type": "function"}]) == "agent" and route_class(None, None) == "chat"
    no_key: dict = {}
    assert classify(no_key, None, "editor", 0) == ("editor", 0)
    assert classify(no_key, "agent", "editor", 0) == ("agent", 0)  # asked
    assert classify(no_key, None, "chat", BACKGROUND_PRIORITY) == ("background", BACKGROUND_PRIORITY)  # flex, batch
    assert classify(no_key, "background", "chat", 5) == ("background", BACKGROUND_PRIORITY)
    agent_key = {"key": ApiKey("harness", "0" * 64, latency_class="agent")}
    assert classify(agent_key, None, "editor", 0) == ("agent", 0)  # its grant is the most urgent it gets
    assert classify(agent_key, "background", "chat", 0) == ("background", BACKGROUND_PRIORITY)  # less is fine


def test_a_key_s_class_is_a_checked_field_of_the_keys_file_and_of_keys_set(tmp_path):
    from mlxgw.gateway.access.key_admin import KeyEditError, create_key, update_key
    from mlxgw.gateway.access.keys import KeysFileError, parse_keys

    (key,), _ = parse_keys({"keys": [{"name": "ci", "sha256": "a" * 64, "latency_class": "background"}]}, "keys.yaml")
    assert key.latency_class == "background"
    with pytest.raises(KeysFileError, match="latency_class"):
        parse_keys({"keys": [{"name": "ci", "sha256": "a" * 64, "latency_class": "urgent"}]}, "keys.yaml")
    path = tmp_path / "keys.yaml"
    create_key(path, "harness", {})
    assert update_key(path, "harness", {"latency_class": "agent"})["latency_class"] == "agent"
    with pytest.raises(KeyEditError, match="latency_class"):
        update_key(path, "harness", {"latency_class": "now"})
