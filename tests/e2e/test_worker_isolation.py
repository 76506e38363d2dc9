"""One bad request costs its sender one error response, nothing more.

Every reproduction runs against a real `mlxgw up` with the tiny model, while an innocent
greedy stream runs on the same worker. Each checks: the answer (a 400 in OpenAI's error
shape, or a 200 where a value is clamped), the worker's pid unchanged, nothing left in
flight, and the innocent stream's tokens equal to those it gives with no attack."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
from helpers import NO_EOS, TINY_CONFIG, http, openai_client, start_gateway, wait_for

from mlxgw.worker.text.template_budget import TIME_BUDGET_ENV

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
VOCAB = 49152  # SmolLM2's, which the tiny model shares
LOOP_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# The workers' template deadline (worker/text/template_budget.py: 5 s by default): each endless
# template waits it out, four times in this file.
TEMPLATE_BUDGET_S = 1.5  # well above what a render of these tests' prompts needs


@pytest.fixture(scope="module")
def gw(home, tiny_dir):
    """A gateway of its own: `tiny` here lets requests bring a chat template; `tiny-evil`
    ships an endless template of its own (as a GGUF's tokenizer.chat_template can)."""
    evil = home / "models" / "tiny-evil"
    shutil.copytree(tiny_dir, evil, dirs_exist_ok=True)
    tokenizer_config = json.loads((evil / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = LOOP_TEMPLATE
    (evil / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    from helpers.gguf_models import write_twice

    from mlxgw.worker.importers.gguf import import_gguf

    # A GGUF whose tokenizer.chat_template holds the same loop, imported as `mlxgw models import` does.
    _, gguf_file = write_twice("llama", home / "evil-gguf-src", chat_template=LOOP_TEMPLATE)
    import_gguf(str(gguf_file), "gguf-evil", dtype="float32", models_dir=home / "models", force=True)
    config = {
        "manager": TINY_CONFIG["manager"],
        "models": [
            {"name": "tiny", "preload": True, "max_num_seqs": 8, "chat": {"allow_request_chat_template": True}},
            {"name": "tiny-strict", "source": "tiny", "preload": True},
            {"name": "tiny-evil", "preload": True},
            {"name": "gguf-evil", "preload": True},
        ],
    }
    os.environ[TIME_BUDGET_ENV] = str(TEMPLATE_BUDGET_S)  # the gateway's workers inherit it
    try:
        gateway = start_gateway(home, config, "isolation-gateway")
    finally:
        del os.environ[TIME_BUDGET_ENV]
    yield gateway
    gateway.stop()


class InnocentStream:
    """A greedy stream on the model, read on its own thread, chunk times recorded."""

    def __init__(self, gw, model: str = "tiny", max_tokens: int = 48):
        self.stream = openai_client(gw).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell me about the sea."}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"logit_bias": NO_EOS},
        )
        self.chunks: list[str] = []
        self.times: list[float] = []
        first = next(iter(self.stream))  # admitted and decoding from here on
        self._record(first)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _record(self, chunk) -> None:
        self.times.append(time.monotonic())
        if chunk.choices and chunk.choices[0].delta.content:
            self.chunks.append(chunk.choices[0].delta.content)

    def _read(self) -> None:
        try:
            for chunk in self.stream:
                self._record(chunk)
        except Exception:  # closed by the test (close()): the gaps so far are what it wanted
            pass

    def close(self) -> None:
        self.stream.close()
        self._thread.join(30)

    def text(self, timeout: float = 120) -> str:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the innocent stream did not finish"
        return "".join(self.chunks)

    def max_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


@pytest.fixture(scope="module")
def innocent_alone(gw) -> str:
    return InnocentStream(gw).text()


def post_chat(gw, extra: dict, model: str = "tiny", timeout: float = 120):
    body = {"model": model, "messages": MSGS, "max_tokens": 8, **extra}
    return http(gw.url + CHAT, "POST", body, timeout=timeout)


def assert_unharmed(gw, pid: int, model: str = "tiny") -> None:
    assert gw.worker_pid(model) == pid, "the worker was replaced"
    status = gw.model_status(model)
    assert status["restarts"] == 0 and status["state"] == "ready"
    wait_for(lambda: gw.model_status(model)["in_flight"] == 0, 10)


def assert_openai_400(status: int, payload: dict, param: str) -> None:
    assert status == 400, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "invalid_request" and err["param"] == param


REFUSED = [
    ("logit_bias id at the vocabulary size", {"logit_bias": {str(VOCAB): 5, "10": 1}}, "[0, 49152)"),
    ("logit_bias id far past the vocabulary", {"logit_bias": {"99999999": 5}}, "99999999"),
    ("negative logit_bias id", {"logit_bias": {"-1": 5}}, "-1"),
    ("100,000 logit_bias entries", {"logit_bias": {str(i): 1 for i in range(100_000)}}, "at most"),
]


@pytest.mark.parametrize("extra,needle", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_logit_bias_out_of_the_model_is_a_400_that_harms_no_one(gw, innocent_alone, extra, needle):
    pid = gw.worker_pid("tiny")
    innocent = InnocentStream(gw)
    status, _, payload = post_chat(gw, extra)
    assert_openai_400(status, payload, "logit_bias")
    assert needle in payload["error"]["message"]
    assert innocent.text() == innocent_alone
    assert_unharmed(gw, pid)


def test_top_k_past_the_vocabulary_is_clamped_to_off(gw, innocent_alone):
    pid = gw.worker_pid("tiny")
    innocent = InnocentStream(gw)
    sampled = {"temperature": 0.9, "seed": 7, "max_tokens": 12}
    status, _, huge = post_chat(gw, {**sampled, "top_k": 100_000})
    assert status == 200, huge
    assert innocent.text() == innocent_alone
    _, _, off = post_chat(gw, {**sampled, "top_k": 0})
    assert huge["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
    assert_unharmed(gw, pid)


def test_negative_seed_samples_deterministically(gw, innocent_alone):
    pid = gw.worker_pid("tiny")
    innocent = InnocentStream(gw)
    seeded = {"temperature": 1.0, "seed": -1, "max_tokens": 12}
    status, _, first = post_chat(gw, seeded)
    assert status == 200, first
    assert innocent.text() == innocent_alone
    _, _, again = post_chat(gw, seeded)
    assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    assert_unharmed(gw, pid)


def test_prompt_token_ids_past_the_vocabulary_are_a_400(gw):
    pid = gw.worker_pid("tiny")
    for ids in ([1, VOCAB], [-3, 5]):
        body = {"model": "tiny", "prompt": ids, "max_tokens": 2}
        status, _, payload = http(gw.url + "/v1/completions", "POST", body)
        assert_openai_400(status, payload, "prompt")
    assert_unharmed(gw, pid)


def test_request_chat_template_is_refused_unless_the_model_allows_it(gw):
    pid = gw.worker_pid("tiny-strict")
    extra = {"chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}
    status, _, payload = post_chat(gw, extra, model="tiny-strict")
    assert_openai_400(status, payload, "chat_template_kwargs")
    assert "allow_request_chat_template" in payload["error"]["message"]
    assert_unharmed(gw, pid, "tiny-strict")


def test_endless_request_template_ends_in_a_400_within_its_budget(gw, innocent_alone):
    pid = gw.worker_pid("tiny")
    innocent = InnocentStream(gw, max_tokens=48)
    started = time.monotonic()
    status, _, payload = post_chat(gw, {"chat_template_kwargs": {"chat_template": LOOP_TEMPLATE}})
    took = time.monotonic() - started
    assert_openai_400(status, payload, "messages")
    assert "budget" in payload["error"]["message"]
    assert took < TEMPLATE_BUDGET_S + 10
    assert innocent.text() == innocent_alone
    assert_unharmed(gw, pid)


def test_a_models_own_endless_template_ends_each_request_in_a_400_and_the_worker_serves_on(gw):
    """An imported model whose chat template never ends (a GGUF's tokenizer.chat_template is
    copied as is): every chat request is a 400 within the budget, the worker stays, and the
    model still serves completions, which use no template."""
    pid = gw.worker_pid("tiny-evil")
    for _ in range(2):
        started = time.monotonic()
        status, _, payload = post_chat(gw, {}, model="tiny-evil")
        assert_openai_400(status, payload, "messages")
        assert "budget" in payload["error"]["message"]
        assert time.monotonic() - started < TEMPLATE_BUDGET_S + 10
    status, _, body = http(
        f"{gw.url}/v1/completions", "POST", {"model": "tiny-evil", "prompt": "Once upon", "max_tokens": 3}
    )
    assert status == 200, body
    assert_unharmed(gw, pid, "tiny-evil")


def completion_stream_text(gw, model: str, started: threading.Event | None = None) -> str:
    """A greedy completions stream (no chat template) on the model; sets `started` at its
    first chunk. Token 299, the tiny GGUF's end of sequence, is forbidden so it runs long."""
    stream = openai_client(gw).completions.create(
        model=model, prompt="ab", max_tokens=1500, temperature=0, stream=True, extra_body={"logit_bias": {"299": -100}}
    )
    text = []
    for chunk in stream:
        if started is not None:
            started.set()
        text.append(chunk.choices[0].text if chunk.choices else "")
    return "".join(text)


def test_an_imported_gguf_with_an_endless_template_ends_each_chat_in_a_400(gw):
    """A GGUF whose tokenizer.chat_template held a loop once imported without complaint
    and would hang its worker; now the template renders budgeted like every other, while a
    stream on the same worker goes on."""
    pid = gw.worker_pid("gguf-evil")
    alone = completion_stream_text(gw, "gguf-evil")
    started, during = threading.Event(), []
    innocent = threading.Thread(target=lambda: during.append(completion_stream_text(gw, "gguf-evil", started)))
    innocent.start()
    assert started.wait(60)
    began = time.monotonic()
    status, _, payload = post_chat(gw, {}, model="gguf-evil")
    assert_openai_400(status, payload, "messages")
    assert "budget" in payload["error"]["message"]
    assert time.monotonic() - began < TEMPLATE_BUDGET_S + 10
    innocent.join(120)
    assert during == [alone]
    assert_unharmed(gw, pid, "gguf-evil")


def test_template_that_repeats_a_huge_string_is_stopped_before_it_allocates(gw):
    pid = gw.worker_pid("tiny")
    status, _, payload = post_chat(gw, {"chat_template_kwargs": {"chat_template": "{{ 'x' * 1000000000 }}"}})
    assert_openai_400(status, payload, "messages")
    assert "budget" in payload["error"]["message"]
    assert_unharmed(gw, pid)


def test_a_multi_megabyte_prompt_does_not_stall_running_streams(gw):
    """The prompt is tokenized off the engine thread (it is then too long for the context:
    a 400); the running stream keeps its pace meanwhile. On main it stalled for seconds."""
    pid = gw.worker_pid("tiny")
    innocent = InnocentStream(gw, max_tokens=5000)
    big = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 60_000}]  # 2.6 MB
    started = time.monotonic()
    status, _, payload = http(gw.url + CHAT, "POST", {"model": "tiny", "messages": big, "max_tokens": 4}, timeout=300)
    tokenizing = time.monotonic() - started
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload
    during = [b - a for a, b in zip(innocent.times, innocent.times[1:]) if a >= started and b <= started + tokenizing]
    innocent.close()
    assert during, "the stream ended before the big prompt was tokenized; lengthen it"
    assert max(during) < max(2.0, tokenizing / 4), (max(during), tokenizing)
    assert_unharmed(gw, pid)


def test_a_worker_of_another_protocol_version_is_refused_with_one_clear_error(gw):
    import msgpack
    import zmq

    from mlxgw.shared import protocol as p

    endpoint = next(line.split("endpoint ")[1] for line in gw.log().splitlines() if "endpoint " in line)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    hello = {"v": p.PROTOCOL_VERSION + 1, "t": p.HELLO, "worker_id": "future-1", "model": "tiny", "pid": 4242}
    for _ in range(3):  # a hello, then what a worker sends after it
        sock.send(msgpack.packb({**hello, "state": "ready"}))
    wait_for(lambda: "refused worker future-1" in gw.log(), 10)
    sock.close(0)
    ctx.term()
    refusals = [line for line in gw.log().splitlines() if "refused worker future-1" in line]
    assert len(refusals) == 1
    assert f"protocol version {p.PROTOCOL_VERSION + 1}, this gateway {p.PROTOCOL_VERSION}" in refusals[0]
    assert 4242 not in [w["pid"] for w in gw.model_status("tiny")["workers"]]


# -- in process: the scheduler over a real runner -----------------------------------------


def run_to_end(sched) -> dict:
    ends = {}
    while sched.has_work():
        for rid, ev in sched.step():
            if ev.KIND in ("finish", "error"):
                ends[rid] = ev
    return ends


def test_a_raising_logits_processor_ends_only_its_own_sequence(tiny_dir):
    """The real MLX runner and BatchGenerator: one sequence's constraint raises on its third
    token; it ends with an internal error, the others finish with every token."""
    from mlxgw.shared.protocol import GenerateRequest, SamplingParams
    from mlxgw.worker.process.build_mlx import build_mlx_runner
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner = build_mlx_runner(tiny_dir, context_length=None, max_num_seqs=4, prefill_step_size=64, cache_bytes=1 << 20)
    calls = {"n": 0}

    def exploding(tokens, logits):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise RuntimeError("constraint bug")
        return logits

    plain = runner.make_constraint
    runner.make_constraint = lambda req: exploding if req.rid == "bad" else plain(req)
    sched = Scheduler(runner, max_num_seqs=4, max_queue=8)
    greedy = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})
    for rid in ("a", "bad", "c"):
        ((_, ev),) = sched.submit(GenerateRequest(rid=rid, prompt="Once upon a time", max_tokens=6, sampling=greedy))
        assert ev.KIND == "accepted"
    ends = run_to_end(sched)
    assert ends["bad"].KIND == "error" and ends["bad"].error.code == "internal_error"
    assert "constraint bug" in ends["bad"].error.message
    assert ends["a"].KIND == ends["c"].KIND == "finish"
    assert ends["a"].usage.completion_tokens == ends["c"].usage.completion_tokens == 6
    assert sched.running == 0 and sched.waiting == 0


def test_an_output_parser_that_raises_ends_only_its_own_sequence():
    from mlxgw.shared.protocol import GenerateRequest
    from mlxgw.worker.model.runners.null_runner import NullRunner
    from mlxgw.worker.schedule.scheduler import Scheduler

    class Broken:
        think = None

        def feed(self, text):
            raise ValueError("parser bug")

    class Runner(NullRunner):
        def make_parser(self, req, prompt):
            return Broken() if req.rid == "bad" else None

    sched = Scheduler(Runner(), max_num_seqs=4, max_queue=8)
    for rid in ("a", "bad"):
        sched.submit(GenerateRequest(rid=rid, prompt="some words", max_tokens=4))
    ends = run_to_end(sched)
    assert ends["bad"].KIND == "error" and "parser bug" in ends["bad"].error.message
    assert ends["a"].KIND == "finish" and ends["a"].usage.completion_tokens == 4
    assert sched.running == 0 and sched.waiting == 0
