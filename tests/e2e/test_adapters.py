"""LoRA adapters per request, many in one batch.

Adapters are written in the test in mlx_lm.lora's exact output format, their low-rank
weights random and non-zero (tests/helpers/lora_adapters.py), on tiny random models of the
family matrix (tests/helpers/family_models.py): a plain llama (and a 4-bit one), an MoE
(qwen3_moe), a hybrid with gated DeltaNet layers (qwen3_5) and a sliding-window family
(gemma3_text). Every row's
greedy tokens must equal `mlx_lm.load(base, adapter_path=A)` generating alone, in mixed
batches, in-process through the worker's real runner and through `mlxgw up` over HTTP."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import shutil

import mlx.core as mx
import pytest
import yaml
from helpers import NO_EOS, http, start_gateway, wait_for
from helpers.family_models import build_family_model, build_quantized_family_model
from helpers.lora_adapters import write_lora_adapter

from mlxgw.gateway.access.keys import hash_key
from mlxgw.shared.errors import ServiceError
from mlxgw.shared.model_sections import SpeculativeConfig
from mlxgw.shared.protocol import SamplingParams
from mlxgw.worker.model.cpu.cpu_attention import bypassed
from mlxgw.worker.model.interfaces import Row

TOKENS = 8
GREEDY = SamplingParams(temperature=0.0)
# Adapters target what mlx_lm.lora targets by default (every linear layer of every block,
# an MoE's experts and router included), except where a family's keys are given here.
FAMILIES = {"llama": None, "qwen3_moe": None, "qwen3_5": None, "gemma3_text": None, "llama-4bit": None}


@pytest.fixture(scope="module")
def models(home, smollm2_dir):
    root = home / "models"
    out = {}
    for family, keys in FAMILIES.items():
        if family == "llama-4bit":  # quantized base layers (QuantizedLinear), as mlx-lm's convert writes them
            base = build_quantized_family_model("llama", root / f"lora-{family}", smollm2_dir)
        else:
            base = build_family_model(family, root / f"lora-{family}", smollm2_dir)
        a = write_lora_adapter(base, home / "adapters" / f"{family}-a", seed=1, keys=keys)
        b = write_lora_adapter(base, home / "adapters" / f"{family}-b", seed=2, keys=keys, rank=8, scale=2.0)
        out[family] = (base, a, b)
    return out


@functools.cache
def _loaded(base, adapter):
    from mlx_lm import load

    return load(str(base), adapter_path=str(adapter) if adapter else None)


def reference(base, adapter, prompt: list[int], max_tokens: int = TOKENS) -> list[int]:
    """mlx-lm alone: load(base, adapter_path=...), stream_generate, greedy."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = _loaded(base, adapter)
    with bypassed():  # mlx-lm's own attention (the worker routes its modules process-wide)
        steps = stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens, sampler=make_sampler(0.0))
        return [r.token for r in steps]


def make_runner(base, adapters: dict, **kwargs):
    from mlxgw.worker.model.adapters.bank import AdapterSet
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    options = dict(context_length=None, max_num_seqs=8, prefill_step_size=16, cache_bytes=64 << 20)
    bounds = {k: kwargs.pop(k) for k in ("max_resident", "max_bytes") if k in kwargs}
    return build_mlx_runner(
        base, **{**options, **kwargs}, adapters=AdapterSet({k: str(v) for k, v in adapters.items()}, **bounds)
    )


def run_together(runner, jobs: list[tuple[list[int], str | None]]) -> list[tuple[list[int], int]]:
    """Insert every (prompt, adapter) into one batch, step until all end: (tokens, cached) each."""
    slot, cached = {}, []
    for i, (prompt, adapter) in enumerate(jobs):
        uid, hit = runner.insert(Row(prompt, TOKENS, GREEDY, adapter=adapter))
        slot[uid] = i
        cached.append(hit)
    out: list[list[int]] = [[] for _ in jobs]
    finished = 0
    while finished < len(jobs):
        for t in runner.step().tokens:
            out[slot[t.uid]].append(t.token)
            finished += t.finish is not None
    return list(zip(out, cached))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_of_a_mixed_batch_each_match_mlx_lm_alone_with_their_adapter(family, models):
    base, a, b = models[family]
    # Speculation on at every batch size: verification forwards route rows too.
    runner = make_runner(base, {"A": a, "B": b}, speculative=SpeculativeConfig(max_rows=8))
    tok = runner.tokenizer
    prompts = [tok.encode("the quick brown fox " * n) for n in (3, 5, 4, 6)]
    names = ["A", "B", None, "A"]
    folders = {"A": a, "B": b, None: None}
    got = run_together(runner, list(zip(prompts, names)))
    for prompt, name, (tokens, _) in zip(prompts, names, got):
        assert tokens == reference(base, folders[name], prompt), f"{family}: row with adapter {name}"
    # The adapters change the answers measurably (else parity would prove nothing).
    assert got[0][0] != reference(base, None, prompts[0])
    assert got[1][0] != reference(base, None, prompts[1])
    assert runner.adapters.stats()["resident"] == ["A", "B"] or set(runner.adapters.stats()["resident"]) == {"A", "B"}


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])  # trimmable KV; recurrent state from checkpoints
def test_a_prefix_computed_under_one_adapter_is_never_served_to_another_or_the_base(family, models):
    base, a, b = models[family]
    runner = make_runner(base, {"A": a, "B": b}, speculative=SpeculativeConfig(mode="off"))
    prompt = runner.tokenizer.encode("a shared system prompt that every request repeats " * 3)
    ((first, cached),) = run_together(runner, [(prompt, "A")])
    assert cached == 0 and first == reference(base, a, prompt)
    ((plain, cached),) = run_together(runner, [(prompt, None)])
    assert cached == 0, "the base read a prefix computed under adapter A"
    assert plain == reference(base, None, prompt)
    ((other, cached),) = run_together(runner, [(prompt, "B")])
    assert cached == 0, "adapter B read a prefix computed under adapter A"
    assert other == reference(base, b, prompt)
    ((again, cached),) = run_together(runner, [(prompt, "A")])
    assert cached == len(prompt) - 1 and again == first  # its own prefix is reused


def test_a_corrupt_or_mismatched_adapter_is_refused_with_the_reason_and_the_base_keeps_serving(home, models):
    base, a, _ = models["llama"]
    bad = home / "adapters" / "bad"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(a, bad / "corrupt")
    data = (bad / "corrupt" / "adapters.safetensors").read_bytes()
    (bad / "corrupt" / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    shutil.copytree(a, bad / "dora")
    config = (bad / "dora" / "adapter_config.json").read_text()
    (bad / "dora" / "adapter_config.json").write_text(config.replace('"lora"', '"dora"'))
    (bad / "empty").mkdir()
    folders = {
        "corrupt": bad / "corrupt",
        "dora": bad / "dora",
        "empty": bad / "empty",
        "other-family": models["qwen3_5"][1],  # its layers are not this model's
        "good": a,
    }
    runner = make_runner(base, folders, speculative=SpeculativeConfig(mode="off"))
    prompt = runner.tokenizer.encode("hello there " * 4)
    reasons = {
        "corrupt": "adapters.safetensors is unreadable",
        "dora": "only LoRA adapters are served",
        "empty": "is not an adapter folder",
        "other-family": "in this model (trained for another model?)",
    }
    for name, reason in reasons.items():
        with pytest.raises(ServiceError) as refused:
            runner.insert(Row(prompt, TOKENS, GREEDY, adapter=name))
        assert f"the adapter '{name}' cannot be served" in str(refused.value) and reason in str(refused.value)
        assert refused.value.status == 400
    got = run_together(runner, [(prompt, None), (prompt, "good")])
    assert got[0][0] == reference(base, None, prompt) and got[1][0] == reference(base, a, prompt)
    with pytest.raises(ServiceError, match="not configured on this model"):
        runner.adapters.note("r1", "nobody")


def peft_copy(mlx_folder, dest, **config):
    """An mlx_lm.lora adapter in Hugging Face PEFT's layout: `base_model.model.<layer>.lora_A.weight`
    (rank x input) and lora_B (output x rank), lora_alpha / r for the scale. (No PEFT here to
    export one: this is PEFT's documented layout, written from the mlx-lm adapter.)"""
    import json

    weights = mx.load(str(mlx_folder / "adapters.safetensors"))
    mlx_config = json.loads((mlx_folder / "adapter_config.json").read_text())["lora_parameters"]
    peft = {}
    for key, value in weights.items():
        layer, _, leaf = key.rpartition(".")
        peft[f"base_model.model.{layer}.lora_{'A' if leaf == 'lora_a' else 'B'}.weight"] = mx.contiguous(value.T)
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "adapter_model.safetensors"), peft)
    rank = mlx_config["rank"]
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": mlx_config["scale"] * rank, "bias": "none", **config}
    (dest / "adapter_config.json").write_text(json.dumps(body))
    return dest


def test_a_peft_lora_folder_serves_as_the_same_adapter_and_a_dora_one_is_refused(home, models):
    base, a, _ = models["llama"]
    peft = peft_copy(a, home / "adapters" / "peft-a")
    dora = peft_copy(a, home / "adapters" / "peft-dora", use_dora=True)
    runner = make_runner(base, {"peft": peft, "dora": dora}, speculative=SpeculativeConfig(mode="off"))
    prompt = runner.tokenizer.encode("the quick brown fox " * 4)
    ((got, _),) = run_together(runner, [(prompt, "peft")])
    assert got == reference(base, a, prompt)
    with pytest.raises(ServiceError, match="DoRA adapters are not served"):
        runner.insert(Row(prompt, TOKENS, GREEDY, adapter="dora"))


def test_resident_adapters_are_bounded_but_rows_in_use_keep_theirs(models):
    base, a, b = models["llama"]
    runner = make_runner(base, {"A": a, "B": b}, speculative=SpeculativeConfig(mode="off"), max_resident=1)
    prompt = runner.tokenizer.encode("one two three four five")
    got = run_together(runner, [(prompt, "A"), (prompt, "B")])  # both resident while both run
    assert got[0][0] == reference(base, a, prompt) and got[1][0] == reference(base, b, prompt)
    run_together(runner, [(prompt, "A")])
    stats = runner.adapters.stats()
    assert stats["resident"] == ["A"] and stats["evictions"] >= 1


def test_an_adapter_larger_than_the_byte_bound_is_refused_and_a_smaller_one_serves(models):
    base, a, b = models["llama"]  # B has twice A's rank: twice its bytes
    bound = sum(w.nbytes for w in mx.load(str(a / "adapters.safetensors")).values())
    runner = make_runner(base, {"A": a, "B": b}, speculative=SpeculativeConfig(mode="off"), max_bytes=bound)
    bank = runner.adapters
    prompt = runner.tokenizer.encode("one two three four five")
    with pytest.raises(ServiceError, match="exceed adapter_memory_mb") as refused:
        runner.insert(Row(prompt, TOKENS, GREEDY, adapter="B"))
    assert refused.value.status == 400
    ((tokens, _),) = run_together(runner, [(prompt, "A")])
    assert tokens == reference(base, a, prompt) and bank.stats()["resident"] == ["A"]


def test_adapters_leaving_and_arriving_share_the_stacks_exactly_and_a_byte_bound_evicts_idle_ones(models, home):
    base, a, b = models["llama"]
    # C and D have A's rank: one stack group (worker/model/adapters/stacks.py); B's rank is another.
    c = write_lora_adapter(base, home / "adapters" / "llama-c", seed=3)
    d = write_lora_adapter(base, home / "adapters" / "llama-d", seed=4)
    runner = make_runner(base, {"A": a, "B": b, "C": c}, speculative=SpeculativeConfig(mode="off"))
    bank = runner.adapters
    prompt = runner.tokenizer.encode("one two three four five six")
    run_together(runner, [(prompt, "A"), (prompt, "C"), (prompt, "B")])
    position_of_a = bank.resident["A"].positions
    bank.set_sources({"B": str(b), "C": str(c), "D": str(d)})  # A leaves; D takes its place in the stacks
    got = run_together(runner, [(prompt, "D"), (prompt, None), (prompt, "C"), (prompt, "B")])
    for (tokens, _), folder in zip(got, [d, None, c, b]):
        assert tokens == reference(base, folder, prompt)
    assert bank.resident["D"].positions == position_of_a
    # Bounded by bytes (B's, twice the rank of C's): C runs, the idle D and B leave.
    bank.max_bytes = bank.resident["B"].nbytes
    ((tokens, _),) = run_together(runner, [(prompt, "C")])
    assert tokens == reference(base, c, prompt)
    stats = bank.stats()
    assert stats["resident"] == ["C"] and stats["resident_bytes"] <= stats["max_bytes"]


@pytest.mark.parametrize(
    "models_yaml, why",
    [
        ([{"name": "m", "adapters": [{"name": "x", "path": "rel/dir"}]}], "path must be an absolute folder"),
        ([{"name": "m", "adapters": [{"name": "m2", "path": "/a"}]}, {"name": "m2"}], "'m2' already names something"),
        ([{"name": "m", "kind": "embedding", "adapters": [{"name": "x", "path": "/a"}]}], "only chat models"),
        ([{"name": "m", "adapters": [{"name": "x", "path": "/a", "aliases": ["m:x"]}]}], "without ':'"),
        (
            [{"name": "m", "adapter_memory_mb": 0, "adapters": [{"name": "x", "path": "/a"}]}],
            "'adapter_memory_mb': must be more than 0",
        ),
    ],
)
def test_models_yaml_refuses_an_adapter_it_could_not_serve_or_name(models_yaml, why):
    from mlxgw.shared.config import ConfigError, parse_registry

    with pytest.raises(ConfigError, match=why):
        parse_registry({"models": models_yaml})


def test_an_adapter_is_found_by_its_name_an_alias_or_base_colon_name():
    from mlxgw.shared.config import parse_registry

    adapters = [{"name": "bot", "path": "/a", "aliases": ["helpdesk"]}]
    registry = parse_registry({"models": [{"name": "base", "aliases": ["b-*"], "adapters": adapters}]})
    for name in ("bot", "helpdesk", "base:bot", "b-1:bot"):
        entry, adapter = registry.adapter(name)
        assert (entry.name, adapter.name) == ("base", "bot")
    assert registry.adapter("base") is None and registry.adapter("other:bot") is None


# -- through `mlxgw up` -------------------------------------------------------------------------

KEYS = {"ops": "sk-adapters-ops", "bot": "sk-adapters-bot"}


@pytest.fixture(scope="module")
def gateway(home, models):
    base, a, b = models["llama"]
    # Adapters added over HTTP come from a folder the operator allows (as FROM paths).
    config = {
        "manager": {"auto_discover": False, "allowed_import_paths": [str(home / "adapters")]},
        "models": [
            {
                "name": "lora-base",
                "source": base.name,
                "preload": True,
                "max_num_seqs": 8,
                "adapters": [
                    {"name": "support-bot", "path": str(a), "aliases": ["helpdesk"]},
                    {"name": "reviewer", "path": str(b)},
                ],
            }
        ],
    }
    keys_path = home / "adapter-keys.yaml"
    entries = [
        {"name": "ops", "sha256": hash_key(KEYS["ops"]), "admin": True},
        {"name": "bot", "sha256": hash_key(KEYS["bot"]), "models": ["support-bot"]},
    ]
    keys_path.write_text(yaml.safe_dump({"keys": entries}))
    gw = start_gateway(home, config, "adapters-gateway", extra_args=("--keys", str(keys_path)))
    yield gw
    gw.stop()


def call(gw, method: str, path: str, key: str = "ops", body: dict | None = None):
    return http(f"{gw.url}{path}", method, body, headers={"Authorization": f"Bearer {KEYS[key]}"})


def worker_pid(gw) -> int:
    models = call(gw, "GET", "/v1/status")[2]["models"]
    (worker,) = next(m for m in models if m["name"] == "lora-base")["workers"]
    return worker["pid"]


def complete(gw, model: str, prompt: list[int], key: str = "ops") -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    status, _, out = call(gw, "POST", "/v1/completions", key, body)
    return status, out


def same_text(out: dict, expected: str) -> bool:
    # The stream detokenizer drops the space a first token's text may start with.
    return out["choices"][0]["text"].lstrip() == expected.lstrip()


def test_adapters_are_listed_as_models_with_their_base(gateway):
    status, _, listed = call(gateway, "GET", "/v1/models")
    assert status == 200
    by_id = {m["id"]: m for m in listed["data"]}
    assert by_id["support-bot"]["parent"] == by_id["support-bot"]["root"] == "lora-base"
    assert by_id["support-bot"]["aliases"] == ["lora-base:support-bot", "helpdesk"]
    assert by_id["reviewer"]["parent"] == "lora-base"
    assert call(gateway, "GET", "/v1/models/lora-base:reviewer")[2]["id"] == "reviewer"
    tags = {m["name"]: m for m in call(gateway, "GET", "/api/tags")[2]["models"]}
    assert tags["support-bot"]["details"]["parent_model"] == "lora-base"


def test_mixed_requests_over_http_each_match_mlx_lm_alone_and_the_ledger_names_the_adapter(gateway, models):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    base, a, b = models["llama"]
    tok = load_tokenizer(base)
    prompts = [tok.encode("the quick brown fox " * n) for n in (3, 5, 4, 6)]
    names = ["support-bot", "reviewer", "lora-base", "lora-base:support-bot"]
    folders = [a, b, None, a]
    with cf.ThreadPoolExecutor(4) as pool:  # one batch: the four arrive together
        answers = list(pool.map(lambda job: complete(gateway, *job), zip(names, prompts)))
    for name, folder, prompt, (status, out) in zip(names, folders, prompts, answers):
        assert status == 200, out
        assert same_text(out, tok.decode(reference(base, folder, prompt))), name
        assert out["model"] in (name, "support-bot")
    usage = call(gateway, "GET", "/v1/usage?by=model")[2]["data"]
    assert {"support-bot", "reviewer", "lora-base"} <= {row.get("model") for row in usage}


def test_every_choice_of_a_request_runs_under_its_adapter(gateway, models):
    base, a, _ = models["llama"]
    prompt = [7, 7, 8, 9, 11, 13]
    body = {"model": "support-bot", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "n": 2}
    status, _, out = call(gateway, "POST", "/v1/completions", body=body)
    assert status == 200, out
    expected = _decode(base, reference(base, a, prompt))
    assert [c["text"].lstrip() for c in out["choices"]] == [expected.lstrip()] * 2


def test_a_key_restricted_to_one_adapter_reaches_only_that_adapter(gateway):
    prompt = [1, 2, 3, 4]
    assert complete(gateway, "support-bot", prompt, key="bot")[0] == 200
    assert complete(gateway, "lora-base:support-bot", prompt, key="bot")[0] == 200
    assert complete(gateway, "helpdesk", prompt, key="bot")[0] == 200  # an alias of the adapter
    assert complete(gateway, "reviewer", prompt, key="bot")[0] == 403
    assert complete(gateway, "lora-base", prompt, key="bot")[0] == 403
    listed = [m["id"] for m in call(gateway, "GET", "/v1/models", key="bot")[2]["data"]]
    assert listed == ["support-bot"]


def test_adapters_are_added_and_removed_while_the_worker_keeps_running(gateway, models, home):
    base, _, _ = models["llama"]
    pid = worker_pid(gateway)
    fresh = write_lora_adapter(base, home / "adapters" / "llama-c", seed=3)
    prompt = [5, 6, 7, 8, 9, 10]
    # A folder that is no adapter of this model is refused with the reason; nothing changes.
    other = str(models["qwen3_5"][1])
    status, _, out = call(gateway, "POST", "/v1/adapters", body={"model": "lora-base", "name": "c", "path": other})
    assert status == 400 and "trained for another model" in out["error"]["message"]
    assert complete(gateway, "c", prompt)[0] == 404
    status, _, out = call(gateway, "POST", "/v1/adapters", body={"model": "lora-base", "name": "c", "path": str(fresh)})
    assert status == 201, out
    status, out = complete(gateway, "c", prompt)
    assert status == 200 and same_text(out, _decode(base, reference(base, fresh, prompt)))
    registry = yaml.safe_load(gateway.config_path.read_text())
    assert {"name": "c", "path": str(fresh.resolve())} in registry["models"][0]["adapters"]
    assert call(gateway, "DELETE", "/v1/adapters/c")[0] == 200
    assert complete(gateway, "c", prompt)[0] == 404
    assert complete(gateway, "support-bot", prompt)[0] == 200
    assert worker_pid(gateway) == pid  # the same worker throughout


def adapter_stats(gw) -> dict:
    models = call(gw, "GET", "/v1/status")[2]["models"]
    (worker,) = next(m for m in models if m["name"] == "lora-base")["workers"]
    return worker["stats"].get("adapters") or {}


def test_an_adapter_removed_under_load_finishes_its_running_rows_then_leaves(gateway, models, home):
    base, _, _ = models["llama"]
    folder = write_lora_adapter(base, home / "adapters" / "llama-d", seed=4)
    body = {"model": "lora-base", "name": "d", "path": str(folder)}
    assert call(gateway, "POST", "/v1/adapters", body=body)[0] == 201
    long = {"model": "d", "prompt": [5, 6, 7, 8], "max_tokens": 400, "temperature": 0, "logit_bias": NO_EOS}
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(call, gateway, "POST", "/v1/completions", "ops", long)
        wait_for(lambda: adapter_stats(gateway).get("rows", 0) >= 1, timeout=60, interval=0.05)
        assert call(gateway, "DELETE", "/v1/adapters/d")[0] == 200
        assert complete(gateway, "d", [1, 2])[0] == 404  # new requests: gone at once
        status, _, out = running.result()
    assert status == 200 and out["choices"][0]["finish_reason"] == "length", out  # the running row kept it
    wait_for(lambda: "d" not in adapter_stats(gateway).get("resident", ["d"]), timeout=30)


def test_a_byte_bound_for_one_adapter_keeps_one_resident_and_the_other_still_answers(home, models):
    """adapter_memory_mb in models.yaml, through `mlxgw up`: A and C (same rank, same bytes)
    do not fit together, so each request for the one not resident loads it and the idle
    other leaves; the bound is taken out of the worker's measured KV budget."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    base, a, _ = models["llama"]
    c = write_lora_adapter(base, home / "adapters" / "llama-c", seed=3)
    one = sum(w.nbytes for w in mx.load(str(a / "adapters.safetensors")).values())
    bound_mb = 1.5 * one / (1 << 20)
    entry = {"name": "lora-bounded", "source": base.name, "preload": True, "max_num_seqs": 4}
    entry |= {"adapter_memory_mb": bound_mb, "adapters": [{"name": "a", "path": str(a)}, {"name": "c", "path": str(c)}]}
    gw = start_gateway(home, {"manager": {"auto_discover": False}, "models": [entry]}, "adapters-bounded")
    try:
        tok = load_tokenizer(base)
        prompt = tok.encode("one two three four five six")
        for name, folder in (("a", a), ("c", c), ("a", a)):
            status, _, out = http(
                f"{gw.url}/v1/completions",
                "POST",
                {"model": name, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0},
            )
            assert status == 200, out
            assert same_text(out, tok.decode(reference(base, folder, prompt))), name

        def worker() -> dict:
            models = http(f"{gw.url}/v1/status")[2]["models"]
            return next(m for m in models if m["name"] == "lora-bounded")["workers"][0]["stats"]

        # the status is refreshed periodically: its first report may not carry the adapters yet
        wait_for(lambda: (worker().get("adapters") or {}).get("loads") == 3, timeout=30)
        stats = worker()["adapters"]
        assert stats["resident"] == ["a"] and stats["evictions"] == 2, stats
        assert stats["max_bytes"] == int(bound_mb * (1 << 20)) and stats["resident_bytes"] == one
        assert "less adapter_memory_mb" in worker()["kv"]["source"]
    finally:
        gw.stop()


def _decode(base, tokens: list[int]) -> str:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(base).decode(tokens)


# -- the real default model, with an adapter trained by mlx_lm.lora itself ---------------------------


@pytest.mark.slow
def test_an_adapter_trained_by_mlx_lm_lora_serves_on_the_real_model(home, smollm2_dir, tmp_path):
    import json
    import subprocess
    import sys

    from helpers import openai_client, run_reference

    from mlxgw.shared.platform import worker_environment

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"text": f"Ticket {i}: the printer on floor {i % 5} jammed. Fix: restart the spooler."} for i in range(16)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    adapter = tmp_path / "tickets"
    train = [sys.executable, "-m", "mlx_lm", "lora", "--model", str(smollm2_dir), "--train", "--data", str(data)]
    train += ["--iters", "4", "--batch-size", "2", "--num-layers", "4", "--learning-rate", "1e-3"]
    train += ["--adapter-path", str(adapter), "--max-seq-length", "64", "--val-batches", "1"]
    out = subprocess.run(train, env=worker_environment(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    config = {
        "manager": {"auto_discover": False},
        "models": [
            {
                "name": "smollm2-lora",
                "source": str(smollm2_dir),
                "preload": True,
                "max_num_seqs": 4,
                "adapters": [{"name": "tickets", "path": str(adapter)}],
            }
        ],
    }
    gw = start_gateway(home, config, "adapters-real")
    try:
        client = openai_client(gw)
        messages = [{"role": "user", "content": "Ticket 7: the printer on floor 2"}]
        answers = {
            name: client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=24)
            .choices[0]
            .message.content
            for name in ("tickets", "smollm2-lora")
        }
    finally:
        gw.stop()
    reference = run_reference(f"""
from mlx_lm import load, generate
model, tok = load({str(smollm2_dir)!r}, adapter_path={str(adapter)!r})
prompt = tok.apply_chat_template({messages!r}, add_generation_prompt=True)
print(generate(model, tok, prompt, max_tokens=24), end="")
""")
    assert answers["tickets"] == reference
    assert answers["smollm2-lora"] != reference  # the trained adapter changed the answer
