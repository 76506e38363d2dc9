"""Embeddings and reranking: the real all-MiniLM-L6-v2 in a real worker behind a real gateway,
checked against sentence-transformers' vectors (stored in tests/data, computed once with
tests/data/make_minilm_reference.py), through the official openai SDK and plain HTTP."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest
from helpers import DATA, async_openai_client, http, openai_client, start_gateway

REFERENCE = json.loads((DATA / "minilm_reference.json").read_text())
TEXTS = REFERENCE["texts"]
VECTORS = np.array(REFERENCE["embeddings"], dtype=np.float32)

EMBED_CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {"name": "minilm-l6", "kind": "embedding", "preload": True, "aliases": ["text-embedding-3-small"]},
        {"name": "minilm-truncate", "source": "minilm-l6", "kind": "embedding", "encoder": {"truncate": True}},
        {"name": "tiny-rerank", "kind": "rerank"},
        {"name": "minilm-mlx-embeddings", "source": "minilm-l6", "kind": "embedding", "engine": "mlx-embeddings"},
        {"name": "tiny", "source": "tiny"},
    ],
}


@pytest.fixture(scope="module")
def gw(home, minilm_dir, tiny_reranker_dir, tiny_dir):
    gw = start_gateway(home, EMBED_CONFIG, "embed-gateway")
    yield gw
    gw.stop()


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def embed(gw, body: dict):
    return http(f"{gw.url}/v1/embeddings", "POST", {"model": "minilm-l6", **body})


def worker_stats(gw, model: str, finished_at_least: int = 0, timeout: float = 20) -> dict:
    """The worker's stats from its heartbeats, once they account for `finished_at_least` requests."""
    deadline = time.monotonic() + timeout
    while True:
        workers = [w for w in gw.model_status(model)["workers"] if w["state"] == "ready"]
        stats = workers[0]["stats"] if workers else {}
        if stats.get("finished_requests", -1) >= finished_at_least or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


# -- the official SDK ----------------------------------------------------------------------


def test_sdk_batch_matches_sentence_transformers(gw):
    client = openai_client(gw)
    # Unless told otherwise the SDK asks for base64 and decodes it: both paths are checked.
    for fmt in ({"encoding_format": "float"}, {}):
        r = client.embeddings.create(model="minilm-l6", input=TEXTS, **fmt)
        assert [d.index for d in r.data] == list(range(len(TEXTS)))
        for text, d, ref in zip(TEXTS, r.data, VECTORS):
            assert len(d.embedding) == 384
            assert cosine(d.embedding, ref) > 1 - 1e-3, text
        assert r.usage.prompt_tokens == sum(len(ids) for ids in REFERENCE["input_ids"])
        assert r.usage.total_tokens == r.usage.prompt_tokens
        assert r.model == "minilm-l6"


def test_sdk_single_default_format_and_alias(gw):
    r = openai_client(gw).embeddings.create(model="text-embedding-3-small", input=TEXTS[0])
    assert len(r.data) == 1
    assert cosine(r.data[0].embedding, VECTORS[0]) > 1 - 1e-3
    assert abs(np.linalg.norm(r.data[0].embedding) - 1) < 1e-4


def test_sdk_dimensions_truncate_and_renormalise(gw):
    client = openai_client(gw)
    full = np.array(client.embeddings.create(model="minilm-l6", input=TEXTS[2]).data[0].embedding)
    short = np.array(client.embeddings.create(model="minilm-l6", input=TEXTS[2], dimensions=64).data[0].embedding)
    assert short.shape == (64,)
    assert abs(np.linalg.norm(short) - 1) < 1e-5
    assert np.allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-5)


def test_mlx_embeddings_engine_gives_the_same_vectors(gw):
    """The same folder run by mlx-embeddings (the engine for architectures the built-in
    encoder does not implement): same tokens, same batching, same vectors."""
    pytest.importorskip("mlx_embeddings", reason="needs the embeddings extra")
    r = openai_client(gw).embeddings.create(model="minilm-mlx-embeddings", input=TEXTS, dimensions=384)
    for d, ref in zip(r.data, VECTORS):
        assert cosine(d.embedding, ref) > 1 - 1e-3
    assert r.usage.prompt_tokens == sum(len(ids) for ids in REFERENCE["input_ids"])


def test_base64_is_little_endian_float32_of_the_float_answer(gw):
    _, _, as_float = embed(gw, {"input": TEXTS[:3], "encoding_format": "float"})
    _, _, as_b64 = embed(gw, {"input": TEXTS[:3], "encoding_format": "base64"})
    for f, b in zip(as_float["data"], as_b64["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert np.array_equal(decoded, np.array(f["embedding"], dtype=np.float32))


def test_token_arrays_embed_like_their_text(gw):
    # Token ids are the model's own vocabulary; the special tokens are added as for text.
    bare = [ids[1:-1] for ids in REFERENCE["input_ids"][:3]]
    status, _, one = embed(gw, {"input": bare[0], "encoding_format": "float"})
    assert status == 200
    assert cosine(one["data"][0]["embedding"], VECTORS[0]) > 1 - 1e-5
    status, _, many = embed(gw, {"input": bare, "encoding_format": "float"})
    assert status == 200
    for d, ref in zip(many["data"], VECTORS[:3]):
        assert cosine(d["embedding"], ref) > 1 - 1e-5


# -- limits and bad input ------------------------------------------------------------------


def test_input_over_the_limit_is_a_400_naming_it(gw):
    status, _, body = embed(gw, {"input": ["short", REFERENCE["long_text"]]})
    assert status == 400
    assert body["error"]["param"] == "input"
    assert "input[1]" in body["error"]["message"] and "256 tokens" in body["error"]["message"]


def test_truncating_model_cuts_like_sentence_transformers(gw):
    status, _, body = http(
        f"{gw.url}/v1/embeddings",
        "POST",
        {"model": "minilm-truncate", "input": REFERENCE["long_text"], "encoding_format": "float"},
    )
    assert status == 200, body
    assert cosine(body["data"][0]["embedding"], REFERENCE["long_text_truncated_embedding"]) > 1 - 1e-3
    assert body["usage"]["prompt_tokens"] == 256


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [[1, 2], [3, "x"]]}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": [True, False]}, "input"),
        ({"input": [999999]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 385}, "dimensions"),
        ({"input": "a", "dimensions": "64"}, "dimensions"),
        ({"input": "a", "encoding_format": 5}, "encoding_format"),
        ({"input": "a", "priority": 101}, "priority"),
        ({"input": "a", "priority": "high"}, "priority"),
        ({"input": None}, "input"),
    ],
)
def test_bad_input_is_a_400_and_the_worker_lives(gw, body, param):
    pid = gw.worker_pid("minilm-l6")
    status, _, answer = embed(gw, body)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param
    assert gw.worker_pid("minilm-l6") == pid
    assert embed(gw, {"input": "still alive"})[0] == 200


def test_models_answer_only_on_their_routes(gw):
    status, _, body = http(
        f"{gw.url}/v1/chat/completions", "POST", {"model": "minilm-l6", "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 400 and "/v1/embeddings" in body["error"]["message"]
    status, _, body = http(
        f"{gw.url}/v1/messages",
        "POST",
        {"model": "minilm-l6", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
    )
    assert status == 400 and body["type"] == "error" and "/v1/embeddings" in body["error"]["message"]
    status, _, body = http(f"{gw.url}/v1/embeddings", "POST", {"model": "tiny", "input": "x"})
    assert status == 400 and "chat model" in body["error"]["message"]
    status, _, body = http(f"{gw.url}/v1/embeddings", "POST", {"model": "tiny-rerank", "input": "x"})
    assert status == 400 and "/v1/rerank" in body["error"]["message"]


# -- batching -----------------------------------------------------------------------------


def test_64_concurrent_requests_share_forward_passes(gw):
    texts = [f"request {i}: {TEXTS[i % len(TEXTS)]}" for i in range(64)]
    client = openai_client(gw)
    one_by_one = [np.array(client.embeddings.create(model="minilm-l6", input=t).data[0].embedding) for t in texts]
    time.sleep(1.6)  # heartbeats carry the stats: let them catch up with the sequential run
    before = worker_stats(gw, "minilm-l6")

    async def concurrently():
        aclient = async_openai_client(gw)
        try:
            rs = await asyncio.gather(*(aclient.embeddings.create(model="minilm-l6", input=t) for t in texts))
        finally:
            await aclient.close()
        return [np.array(r.data[0].embedding) for r in rs]

    together = asyncio.run(concurrently())
    after = worker_stats(gw, "minilm-l6", before["finished_requests"] + 64)
    passes = after["forward_passes"] - before["forward_passes"]
    assert after["inputs_encoded"] - before["inputs_encoded"] == 64
    assert 1 <= passes <= 32, passes  # one by one would be 64; a loaded CI machine spreads arrivals
    for a, b in zip(one_by_one, together):
        assert np.allclose(a, b, atol=1e-5)


def test_scheduler_batches_within_the_budgets_and_sorts_by_length(minilm_dir):
    """In-process: the batching policy over the real encoder (its passes are recorded)."""
    from mlxgw.shared import protocol as p
    from mlxgw.shared.events import EventKind
    from mlxgw.worker.model.encoder.encoder import TextEncoder
    from mlxgw.worker.schedule.embeddings import EmbedScheduler

    encoder = TextEncoder(minilm_dir)
    passes: list[list[int]] = []
    embed = encoder.embed

    def recording_embed(batch, dimensions=None):
        passes.append([len(ids) for ids in batch])
        return embed(batch, dimensions)

    encoder.embed = recording_embed
    sched = EmbedScheduler(encoder, max_batch_size=8, max_batch_tokens=600, max_queue=100)
    for i in range(10):
        ((rid, ev),) = sched.submit(p.EmbedRequest(rid=f"r{i}", inputs=[TEXTS[i % 3], TEXTS[2]]))
        assert ev.KIND == EventKind.ACCEPTED
    sched.submit(p.EmbedRequest(rid="long", inputs=["word " * 200]))
    finished = {}
    while sched.has_work():
        before = len(passes)
        for rid, ev in sched.step():
            finished[rid] = ev
        step_inputs = sum(len(x) for x in passes[before:])
        assert step_inputs <= 8  # max_batch_size per step
    assert len(finished) == 11 and all(ev.KIND == EventKind.FINISH for ev in finished.values())
    assert sum(len(x) for x in passes) == 21
    assert len(passes) <= 12  # 21 inputs; passes group equal lengths; the long one runs alone
    assert [202] in passes  # the 202-token input does not pad 7 short ones to its length
    for lengths in passes:
        assert lengths == sorted(lengths) and lengths[-1] <= 1.1 * lengths[0] + 2
    vec = np.frombuffer(finished["r0"].vectors, dtype=np.float32).reshape(2, 384)
    assert cosine(vec[0], VECTORS[0]) > 1 - 1e-3 and cosine(vec[1], VECTORS[2]) > 1 - 1e-3


# -- rerank -------------------------------------------------------------------------------

DOCS = [
    "Bananas are a good source of potassium.",
    "Paris is the capital and largest city of France.",
    "The Eiffel Tower was built for the 1889 World's Fair.",
    "Python is a programming language.",
]


def test_rerank_with_embedding_similarity(gw):
    status, _, body = http(
        f"{gw.url}/v1/rerank",
        "POST",
        {"model": "minilm-l6", "query": "What is the capital of France?", "documents": DOCS},
    )
    assert status == 200, body
    order = [r["index"] for r in body["results"]]
    assert order[0] == 1 and order[-1] in (0, 3)
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert body["results"][0]["document"] == {"text": DOCS[1]}
    assert body["usage"]["prompt_tokens"] > 0
    # the scores are the cosine similarities of the model's own vectors
    vecs = openai_client(gw).embeddings.create(model="minilm-l6", input=["What is the capital of France?", DOCS[1]])
    assert abs(scores[0] - cosine(vecs.data[0].embedding, vecs.data[1].embedding)) < 1e-4


def test_rerank_top_n_return_documents_and_objects(gw):
    status, _, body = http(
        f"{gw.url}/v2/rerank",
        "POST",
        {
            "model": "minilm-l6",
            "query": "tower in Paris",
            "documents": [{"text": d} for d in DOCS],
            "top_n": 2,
            "return_documents": False,
        },
    )
    assert status == 200, body
    assert len(body["results"]) == 2 and all("document" not in r for r in body["results"])


def test_rerank_with_a_cross_encoder(gw):
    request = {"model": "tiny-rerank", "query": "capital of France", "documents": DOCS}
    status, _, body = http(f"{gw.url}/v1/rerank", "POST", request)
    assert status == 200, body
    assert sorted(r["index"] for r in body["results"]) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    # a second identical request scores the same (deterministic model, any batch)
    again = http(f"{gw.url}/v1/rerank", "POST", request)
    assert [r["relevance_score"] for r in again[2]["results"]] == pytest.approx(scores, abs=1e-5)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q"}, "documents"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": ["a", 3]}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"query": "q", "documents": ["a"], "top_n": "2"}, "top_n"),
        ({"query": 5, "documents": ["a"]}, "query"),
        ({"query": "q", "documents": ["a"], "return_documents": "no"}, "return_documents"),
        ({"model": None, "query": "q", "documents": ["a"]}, "model"),
    ],
)
def test_rerank_bad_input(gw, body, param):
    status, _, answer = http(f"{gw.url}/v1/rerank", "POST", {"model": "minilm-l6", **body})
    assert status == 400 and answer["error"]["param"] == param


def test_rerank_refuses_chat_models(gw):
    status, _, body = http(f"{gw.url}/v1/rerank", "POST", {"model": "tiny", "query": "q", "documents": ["a"]})
    assert status == 400 and body["error"]["param"] == "model"


def test_fast_gelu_matches_the_exact_one():
    import mlx.core as mx
    import mlx.nn as nn

    from mlxgw.worker.model.encoder.bert import erf, gelu

    x = mx.concatenate([mx.linspace(-10, 10, 20001), mx.random.normal((10000,)) * 3])
    assert mx.abs(erf(x) - mx.erf(x)).max().item() < 2e-6
    assert mx.abs(gelu(x) - nn.gelu(x)).max().item() < 2e-5


def test_hostile_bodies_never_get_a_500_or_kill_a_worker(gw):
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=False) | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )
    texts = st.text(max_size=60)
    token_ids = st.lists(st.integers(-5, 40000), max_size=6)
    fields = st.fixed_dictionaries(
        {},
        optional={
            "model": st.sampled_from(["minilm-l6", "tiny-rerank", "nope"]) | json_values,
            "input": texts | st.lists(texts | token_ids, max_size=4) | token_ids | json_values,
            "encoding_format": st.sampled_from(["float", "base64", "int8"]) | json_values,
            "dimensions": st.integers(-2, 400) | json_values,
            "query": texts | json_values,
            "documents": st.lists(texts | st.fixed_dictionaries({"text": texts}), max_size=4) | json_values,
            "top_n": st.integers(-1, 5) | json_values,
            "return_documents": json_values,
        },
    )
    routes = st.sampled_from(["/v1/embeddings", "/v1/rerank"])
    seen = set()

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(route=routes, body=fields | json_values)
    @example(route="/v1/embeddings", body={"model": "minilm-l6", "input": ["a", [101, 102]]})
    @example(route="/v1/rerank", body={"model": "tiny-rerank", "query": "q", "documents": ["a", {"text": "b"}]})
    def hit(route, body):
        status, _, payload = http(gw.url + route, "POST", body, timeout=60)
        seen.add(status)
        assert status < 500 or status in (502, 503, 529), (route, body, payload)

    hit()
    assert 200 in seen and seen - {200}, seen
    assert gw.model_status("minilm-l6")["restarts"] == 0
    assert gw.model_status("tiny-rerank")["restarts"] == 0


def test_xlm_roberta_encoder_matches_mlx_embeddings(tmp_path, minilm_dir):
    """XLM-RoBERTa (multilingual E5, BGE-M3) on the built-in encoder: its RoBERTa position
    ids, under padding, against mlx-embeddings' independent implementation, same weights."""
    pytest.importorskip("mlx_embeddings", reason="needs the embeddings extra")
    from tiny_model import build_tiny_encoder

    from mlxgw.worker.model.encoder.encoder import MlxEmbeddingsEncoder, TextEncoder

    folder = build_tiny_encoder(tmp_path / "xlmr", minilm_dir, model_type="xlm-roberta", cross_encoder=False)
    ours, theirs = TextEncoder(folder), MlxEmbeddingsEncoder(folder)
    batch = [ours.tokenize(t, i) for i, t in enumerate(TEXTS[:6])]  # mixed lengths: padded
    for a, b in zip(ours.embed(batch), theirs.embed(batch)):
        assert cosine(a, b) > 1 - 1e-5
    alone = ours.embed(batch[:1])[0]
    assert np.allclose(alone, ours.embed(batch)[0], atol=1e-5)  # padding does not leak in


def test_xlm_roberta_cross_encoder_scores_pairs_independently_of_the_batch(tmp_path, minilm_dir):
    from tiny_model import build_tiny_encoder

    from mlxgw.worker.model.encoder.encoder import TextEncoder

    folder = build_tiny_encoder(tmp_path / "xlmr-rerank", minilm_dir, model_type="xlm-roberta")
    enc = TextEncoder(folder)
    assert enc.cross_encoder
    pairs = [enc.tokenize_pair("capital of France", d) for d in DOCS]
    together = enc.score(pairs)
    alone = [enc.score([p])[0] for p in pairs]
    assert together == pytest.approx(alone, abs=1e-5)
    assert all(0 <= s <= 1 for s in together) and len(set(together)) == len(DOCS)
