"""A chat template's filters are bounded like its loops: against a real `mlxgw up` and its
worker, a filter whose size or count argument would build a huge value (or loop for
minutes in Python outside the template's own frames) is a fast 400, with the worker's
memory where it was and the same worker serving on; a filter the sandbox does not know is
a 400 too, and ordinary templates render as before."""

from __future__ import annotations

import time

import psutil
import pytest
from helpers import TINY_CONFIG, http, start_gateway


@pytest.fixture(scope="module")
def gw(home, tiny_dir):
    config = {
        "manager": TINY_CONFIG["manager"],
        "models": [{"name": "tiny", "preload": True, "max_num_seqs": 4, "chat": {"allow_request_chat_template": True}}],
    }
    gateway = start_gateway(home, config, "template-filters-gateway")
    yield gateway
    gateway.stop()


def _chat(gw, template: str) -> tuple[int, dict, float]:
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    body["chat_template_kwargs"] = {"chat_template": template}
    started = time.monotonic()
    status, _, payload = http(gw.url + "/v1/chat/completions", "POST", body, timeout=120)
    return status, payload, time.monotonic() - started


def _worker(gw) -> psutil.Process:
    (worker,) = gw.model_status("tiny")["workers"]
    return psutil.Process(worker["pid"])


# Each built hundreds of MB in the worker or ran for many seconds past the 5-s budget: the
# filters ran outside the template's frames, where neither the trace hook nor the output
# check looked.
FILTER_BOMBS = {
    "tojson indent": "{{ messages|tojson(indent=60000000) }}",
    "batch size with a fill": "{{ messages|batch(60000000, 'x')|list|length }}",
    "slice count": "{{ messages|slice(20000000)|list|length }}",
    "wordwrap width 1": "{{ ('ab ' * 1000000)|wordwrap(1)|length }}",
    "join separator": "{{ range(100000)|map('string')|join('x' * 1000000) }}",
    "str.join separator": "{{ ('x' * 1000000).join(range(100000)|map('string')) }}",
    "sum of lists": "{{ ([range(2000)|list] * 4000)|sum(start=[])|length }}",
}


@pytest.mark.parametrize("template", FILTER_BOMBS.values(), ids=FILTER_BOMBS.keys())
def test_a_filter_past_the_budget_is_a_fast_400_and_the_worker_is_unharmed(gw, template):
    worker = _worker(gw)
    rss = worker.memory_info().rss
    status, payload, took = _chat(gw, template)
    assert status == 400 and "budget" in payload["error"]["message"], payload
    assert took < 5, took
    assert worker.memory_info().rss - rss < 64 << 20, (worker.memory_info().rss - rss) >> 20
    assert _worker(gw).pid == worker.pid and gw.model_status("tiny")["restarts"] == 0


def test_a_filter_the_sandbox_does_not_know_is_a_400(gw):
    status, payload, _ = _chat(gw, "{{ messages[0].content|no_such_filter }}")
    assert status == 400 and "no_such_filter" in payload["error"]["message"], payload


def test_ordinary_filters_render_as_before(gw):
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content|trim|e }}"
        "{{ (m|tojson(indent=2))|length > 0 }}{{ [1, 2, 3]|batch(2, 0)|list|length }}"
        "{{ [1, 2, 3]|slice(2)|list|length }}{{ 'a b c'|wordwrap(2)|length }}{{ [[1], [2]]|sum(start=[]) }}"
        "{{ ['a', 'b']|join(', ') }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    status, payload, _ = _chat(gw, template)
    assert status == 200, payload
    assert payload["usage"]["prompt_tokens"] > 5
