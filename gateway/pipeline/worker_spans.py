"""A generation's worker spans, made by the gateway from the times its worker returned.

The worker notes a traced request's times (worker/schedule/trace_marks.py) and sends them
with its last event (`Finish.trace` / `Error.trace`): the traceparent it was given, and the
wall-clock ns when it arrived, joined the queue, was admitted, made its first token and
ended, with its prefill and decode step counts. Here they become spans, children of that
traceparent (the gateway's request span):

    {chat|text_completion} {model}   arrived → end    the GenAI conventions' request attributes
      ├ prepare                      arrived → queued   chat template, tokens, grammar
      ├ queue                        queued → admitted  the requests waiting when it joined
      ├ prefill                      admitted → first token   cached and computed prompt tokens
      └ decode                       first token → end  output tokens, steps

A worker is another process, maybe another host: its map is checked here, and a malformed
one makes no worker spans (the request's own span says how it ended)."""

from __future__ import annotations

from typing import Any

from ...shared import protocol as p

NS_MAX = 2**63 - 1


def _ns(value: object) -> int | None:
    return value if type(value) is int and 0 < value < NS_MAX else None


def _count(value: object) -> int:
    return value if type(value) is int and 0 <= value < NS_MAX else 0


def marks_of(wire: object) -> dict | None:
    """The worker's times, checked: every time an int ns (admitted and first_token None where
    the request never got that far), in order; None when the map cannot be trusted."""
    if not isinstance(wire, dict) or not isinstance(wire.get("parent"), str):
        return None
    times: dict = {}
    for name in ("arrived", "queued", "admitted", "first_token", "end"):
        value = wire.get(name)
        if value is None and name in ("admitted", "first_token"):
            times[name] = None
        elif _ns(value) is None:
            return None
        else:
            times[name] = value
    if times["admitted"] is None and times["first_token"] is not None:
        return None
    order = [t for t in times.values() if t is not None]
    if order != sorted(order):
        return None
    times.update(parent=wire["parent"], prefill_steps=_count(wire.get("prefill_steps")))
    times["decode_steps"] = _count(wire.get("decode_steps"))
    return times


def request_attributes(gen) -> dict:
    """The GenAI semantic conventions' attributes of one generation's request and response."""
    req: p.GenerateRequest = gen.req
    s = req.sampling
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation(req),
        "gen_ai.provider.name": "mlxgw",
        "gen_ai.request.model": gen.model_name,
        "gen_ai.response.model": gen.model_name,
        "gen_ai.response.id": req.rid,
        "gen_ai.request.temperature": s.temperature,
        "gen_ai.request.top_p": s.top_p,
        "gen_ai.usage.input_tokens": gen.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": gen.usage.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": gen.usage.cached_tokens,
        "mlxgw.priority": req.priority,
    }
    optional = {
        "gen_ai.request.max_tokens": req.max_tokens,
        "gen_ai.request.top_k": s.top_k or None,
        "gen_ai.request.seed": s.seed,
        "gen_ai.request.choice.count": req.n if req.n != 1 else None,
        "gen_ai.request.stop_sequences": list(req.stop) or None,
    }
    attrs.update({k: v for k, v in optional.items() if v is not None})
    if gen.outcome:
        attrs["gen_ai.response.finish_reasons"] = [gen.outcome]
        if gen.outcome.startswith("error:"):
            attrs["error.type"] = gen.outcome[6:]
    return attrs


def operation(req: p.GenerateRequest) -> str:
    return "chat" if req.messages is not None else "text_completion"


def emit_worker_spans(tracing, request_span: Any, gen) -> None:
    """The worker spans of one generation, if its worker returned its times."""
    marks = marks_of(getattr(gen, "worker_trace", None))
    if marks is None or not request_span.is_recording():
        return
    parent = tracing.parent_of(marks["parent"])
    if tracing.trace.get_current_span(parent).get_span_context().trace_id != request_span.get_span_context().trace_id:
        return  # not the traceparent this request's span sent: not this request's times
    attrs = request_attributes(gen)
    top = tracing.tracer.start_span(
        f"{attrs['gen_ai.operation.name']} {gen.model_name}",
        context=parent,
        kind=tracing.internal,
        start_time=marks["arrived"],
        attributes=attrs,
    )
    if "error.type" in attrs:
        top.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR))
    inside = tracing.context_of(top)
    end, admitted, first = marks["end"], marks["admitted"], marks["first_token"]
    u = gen.usage

    def child(name: str, start: int, stop: int | None, attributes: dict) -> None:
        span = tracing.tracer.start_span(name, context=inside, kind=tracing.internal, start_time=start)
        span.set_attributes(attributes)
        span.end(end_time=stop or end)

    child("prepare", marks["arrived"], marks["queued"], {})
    # the requests waiting when it joined the queue, itself included
    waiting = gen.accepted.queued if gen.accepted is not None else 0
    child("queue", marks["queued"], admitted, {"mlxgw.queue.waiting": waiting})
    if admitted is not None:
        prefill = {
            "gen_ai.usage.input_tokens": u.prompt_tokens,
            "gen_ai.usage.cache_read.input_tokens": u.cached_tokens,
            "mlxgw.prefill.computed_tokens": max(0, u.prompt_tokens - u.cached_tokens),
            "mlxgw.prefill.steps": marks["prefill_steps"],
        }
        child("prefill", admitted, first, prefill)
    if first is not None:
        decode = {"gen_ai.usage.output_tokens": u.completion_tokens, "mlxgw.decode.steps": marks["decode_steps"]}
        child("decode", first, end, decode)
    top.end(end_time=end)
