"""An adapter cannot poison its batch, and adapters reach only whom they are given to.

- Numeric isolation: rows outside an adapter's group never enter its product, so a row
  beside an adapter whose product overflows (weights of 1e30, finite in float32) decodes
  exactly what it decodes alone, and the adapter's own row ends with its own error; NaN
  weights, a NaN scale and PEFT's `r: 0` are refused when the adapter is added, with a 400
  naming what, and the worker lives.
- Names, keys and files: `<model>:latest` stays the model (no adapter may be named
  `latest`), a key's pattern reaches `<model>:<adapter>` only when the pattern has a ':',
  an adapter folder added over HTTP lies where FROM paths may, the byte bound holds again
  once a burst's rows end, and resident adapters count against the KV budget.

In-process through the worker's real runner, and through `mlxgw up` over HTTP."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil

import mlx.core as mx
import pytest
import yaml
from helpers import http, start_gateway, wait_for
from helpers.family_models import build_family_model
from helpers.lora_adapters import write_lora_adapter

from mlxgw.gateway.access.keys import hash_key
from mlxgw.shared.config import ConfigError, parse_registry
from mlxgw.shared.errors import ServiceError
from mlxgw.shared.model_sections import SpeculativeConfig
from mlxgw.shared.protocol import SamplingParams
from mlxgw.worker.model.interfaces import Row
from mlxgw.worker.model.runners.isolation import SequenceGuard

TOKENS = 8
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["the quick brown fox " * 3, "one two three four five", "a shared system prompt " * 2]


@pytest.fixture(scope="module")
def llama(home, smollm2_dir):
    base = build_family_model("llama", home / "models" / "lora-llama", smollm2_dir)
    a = write_lora_adapter(base, home / "adapters" / "llama-a", seed=1)
    c = write_lora_adapter(base, home / "adapters" / "llama-c", seed=3)
    return base, a, c


def planted(source, dest, value: float | None = None, config: dict | None = None):
    """A copy of an adapter with every lora_a and lora_b set to `value`, or its config changed."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    if value is not None:
        weights = mx.load(str(dest / "adapters.safetensors"))
        filled = {k: mx.full(w.shape, value) for k, w in weights.items()}
        mx.save_safetensors(str(dest / "adapters.safetensors"), filled)
    if config is not None:
        body = json.loads((dest / "adapter_config.json").read_text())
        body["lora_parameters"].update(config)
        (dest / "adapter_config.json").write_text(json.dumps(body))  # json writes NaN as NaN
    return dest


def make_runner(base, adapters: dict, **kwargs):
    from mlxgw.worker.model.adapters.bank import AdapterSet
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    options = dict(context_length=None, max_num_seqs=8, prefill_step_size=16, cache_bytes=64 << 20)
    options |= dict(speculative=SpeculativeConfig(mode="off"))
    bounds = {k: kwargs.pop(k) for k in ("max_resident", "max_bytes") if k in kwargs}
    return build_mlx_runner(
        base, **{**options, **kwargs}, adapters=AdapterSet({k: str(v) for k, v in adapters.items()}, **bounds)
    )


def run_together(runner, jobs: list[tuple[list[int], str | None]]) -> list[tuple[list[int], SequenceGuard]]:
    """Every (prompt, adapter) in one batch, stepped until each ends; a row whose guard
    records an error is removed, as the scheduler does (worker/schedule/scheduler.py)."""
    rows = {}
    for i, (prompt, adapter) in enumerate(jobs):
        guard = SequenceGuard(f"r{i}")
        uid, _ = runner.insert(Row(prompt, TOKENS, GREEDY, guard=guard, adapter=adapter))
        rows[uid] = (i, [], guard)
    live = set(rows)
    while live:
        out = runner.step()
        faulted = [uid for uid in live if rows[uid][2].faulted]
        runner.remove(faulted)
        live -= set(faulted)
        for t in out.tokens:
            if t.uid in live:
                rows[t.uid][1].append(t.token)
                if t.finish is not None:
                    live.discard(t.uid)
    return [(tokens, guard) for _, tokens, guard in sorted(rows.values(), key=lambda r: r[0])]


def test_base_rows_beside_an_overflowing_adapter_row_decode_as_alone_and_that_row_ends_with_its_error(home, llama):
    base, a, _ = llama
    huge = planted(a, home / "adapters" / "huge", value=1e30)  # finite in float32; its product is not
    runner = make_runner(base, {"huge": huge, "A": a})
    prompts = [runner.tokenizer.encode(p) for p in PROMPTS]
    alone = [run_together(runner, [(p, None)])[0][0] for p in prompts]
    # huge loads first: position 0 of its stack group, where rows outside the group once pointed.
    got = run_together(runner, [(prompts[0], None), (prompts[1], "huge"), (prompts[2], None), (prompts[0], "A")])
    with_a = run_together(runner, [(prompts[0], "A")])[0][0]
    assert got[0][0] == alone[0] and got[2][0] == alone[2], "a base row changed beside the overflowing adapter"
    assert got[3][0] == with_a, "another adapter's row changed beside the overflowing adapter"
    assert all(not got[i][1].faulted for i in (0, 2, 3))
    error = got[1][1].error
    assert isinstance(error, ServiceError) and error.status == 400, error
    assert "stopped being finite" in str(error) and "'huge'" in str(error)


@pytest.mark.parametrize(
    "value, config, why",
    [
        (float("nan"), None, "holds NaN or infinite values"),
        (float("inf"), None, "holds NaN or infinite values"),
        (None, {"scale": float("nan")}, "'lora_parameters.scale' must be a finite number"),
        (None, {"scale": "2"}, "'lora_parameters.scale' must be a number"),
    ],
)
def test_an_adapter_with_non_finite_weights_or_scale_is_refused_naming_what(home, llama, value, config, why):
    base, a, _ = llama
    bad = planted(a, home / "adapters" / "non-finite", value=value, config=config)
    runner = make_runner(base, {"bad": bad})
    prompt = runner.tokenizer.encode("hello there")
    with pytest.raises(ServiceError) as refused:
        runner.insert(Row(prompt, TOKENS, GREEDY, adapter="bad"))
    assert refused.value.status == 400 and why in str(refused.value)
    if value is not None:  # the tensor is named
        assert "tensor 'model.layers." in str(refused.value) and ".lora_a'" in str(refused.value)


def test_the_byte_bound_holds_again_once_a_bursts_rows_end(llama):
    base, a, c = llama  # the same rank: the same bytes
    one = sum(w.nbytes for w in mx.load(str(a / "adapters.safetensors")).values())
    runner = make_runner(base, {"A": a, "C": c}, max_bytes=int(1.5 * one))
    prompt = runner.tokenizer.encode("one two three four five")
    run_together(runner, [(prompt, "A"), (prompt, "C")])  # both resident while both run: over the bound
    stats = runner.adapters.stats()
    assert stats["resident_bytes"] <= stats["max_bytes"] and len(stats["resident"]) == 1, stats


def test_models_yaml_refuses_an_adapter_named_latest_and_model_colon_latest_is_the_model():
    with pytest.raises(ConfigError, match="'latest' is reserved"):
        parse_registry({"models": [{"name": "m", "adapters": [{"name": "latest", "path": "/a"}]}]})
    registry = parse_registry({"models": [{"name": "m", "adapters": [{"name": "bot", "path": "/a"}]}]})
    assert registry.adapter("m:latest") is None and registry.adapter("m:bot") is not None


# -- through `mlxgw up` -------------------------------------------------------------------------

KEYS = {"ops": "sk-iso-ops", "glob": "sk-iso-glob", "adapters": "sk-iso-adapters"}


@pytest.fixture(scope="module")
def gateway(home, llama):
    base, a, _ = llama
    allowed = home / "iso-adapters"
    allowed.mkdir(exist_ok=True)
    entry = {"name": "iso", "source": base.name, "preload": True, "max_num_seqs": 8}
    entry["adapters"] = [{"name": "hr-bot", "path": str(a)}]
    config = {"manager": {"auto_discover": False, "allowed_import_paths": [str(allowed)]}, "models": [entry]}
    keys = [
        {"name": "ops", "sha256": hash_key(KEYS["ops"]), "admin": True},
        {"name": "glob", "sha256": hash_key(KEYS["glob"]), "models": ["iso*"]},
        {"name": "adapters", "sha256": hash_key(KEYS["adapters"]), "models": ["iso:*"]},
    ]
    keys_path = home / "iso-keys.yaml"
    keys_path.write_text(yaml.safe_dump({"keys": keys}))
    gw = start_gateway(home, config, "adapter-isolation", extra_args=("--keys", str(keys_path)))
    gw.allowed = allowed
    yield gw
    gw.stop()


def call(gw, method: str, path: str, key: str = "ops", body: dict | None = None):
    return http(f"{gw.url}{path}", method, body, headers={"Authorization": f"Bearer {KEYS[key]}"})


def complete(gw, model: str, prompt: str, key: str = "ops") -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    status, _, out = call(gw, "POST", "/v1/completions", key, body)
    return status, out


def worker(gw) -> dict:
    models = call(gw, "GET", "/v1/status")[2]["models"]
    (found,) = next(m for m in models if m["name"] == "iso")["workers"]
    return found


def add(gw, name: str, path) -> tuple[int, dict]:
    status, _, out = call(gw, "POST", "/v1/adapters", body={"model": "iso", "name": name, "path": str(path)})
    return status, out


def test_over_http_base_answers_beside_an_overflowing_adapter_are_those_alone(gateway, llama):
    _, a, _ = llama
    huge = planted(a, gateway.allowed / "huge", value=1e30)
    alone = [complete(gateway, "iso", p) for p in PROMPTS]
    assert all(status == 200 for status, _ in alone), alone
    assert add(gateway, "huge", huge)[0] == 201
    jobs = [("iso", PROMPTS[0]), ("huge", PROMPTS[1]), ("iso", PROMPTS[2]), ("iso", PROMPTS[1])]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:  # one batch: they arrive together
        got = list(pool.map(lambda job: complete(gateway, *job), jobs))
    texts = {p: out["choices"][0]["text"] for p, (_, out) in zip(PROMPTS, alone)}
    for (model, prompt), (status, out) in zip(jobs, got):
        if model == "iso":
            assert status == 200 and out["choices"][0]["text"] == texts[prompt], (prompt, out)
    status, out = got[1]
    assert status == 400 and "stopped being finite" in out["error"]["message"], out


@pytest.mark.parametrize(
    "value, config, why",
    [
        (float("nan"), None, "holds NaN or infinite values"),
        (None, {"scale": float("nan")}, "'lora_parameters.scale' must be a finite number"),
    ],
)
def test_over_http_non_finite_adapters_are_refused_when_added_and_the_worker_lives(gateway, llama, value, config, why):
    _, a, _ = llama
    pid = worker(gateway)["pid"]
    status, out = add(gateway, "poison", planted(a, gateway.allowed / "poison", value=value, config=config))
    assert status == 400 and why in out["error"]["message"], out
    assert complete(gateway, "poison", "hi")[0] == 404
    assert complete(gateway, "iso", "hi")[0] == 200 and worker(gateway)["pid"] == pid


def test_a_peft_adapter_of_rank_0_is_a_400_naming_r(gateway):
    folder = gateway.allowed / "rank0"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_model.safetensors").write_bytes(b"")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 0, "lora_alpha": 8}))
    status, out = add(gateway, "rank0", folder)
    assert status == 400 and "'r' must be a positive rank" in out["error"]["message"], out


def test_no_adapter_is_named_latest_and_model_colon_latest_stays_the_model(gateway, llama):
    _, a, _ = llama
    status, out = add(gateway, "latest", a)
    assert status == 400 and "reserved" in out["error"]["message"], out
    body = {"model": "iso:latest", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    status, _, out = call(gateway, "POST", "/api/generate", body=body)
    assert status == 200 and out["model"] in ("iso", "iso:latest"), out


def test_a_key_for_model_names_does_not_reach_their_adapters_and_one_with_a_colon_does(gateway):
    assert complete(gateway, "iso", "hi", key="glob")[0] == 200
    assert complete(gateway, "hr-bot", "hi", key="glob")[0] == 403
    assert complete(gateway, "iso:hr-bot", "hi", key="glob")[0] == 403
    listed = {m["id"] for m in call(gateway, "GET", "/v1/models", key="glob")[2]["data"]}
    assert "iso" in listed and "hr-bot" not in listed
    assert complete(gateway, "iso:hr-bot", "hi", key="adapters")[0] == 200
    assert complete(gateway, "hr-bot", "hi", key="adapters")[0] == 200  # the same adapter by its own name
    assert complete(gateway, "iso", "hi", key="adapters")[0] == 403
    listed = {m["id"] for m in call(gateway, "GET", "/v1/models", key="adapters")[2]["data"]}
    assert "hr-bot" in listed and "iso" not in listed


def test_an_adapter_folder_outside_the_allowed_folders_is_refused(gateway, llama, home):
    _, a, _ = llama
    outside = home / "outside-adapters" / "a"
    shutil.copytree(a, outside, dirs_exist_ok=True)
    link = gateway.allowed / "link-out"
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    for path in (outside, link, "/etc"):
        status, out = add(gateway, "escape", path)
        assert status == 403 and "outside the folders the operator allows" in out["error"]["message"], (path, out)
    assert add(gateway, "escape", "relative/dir")[0] == 400
    assert complete(gateway, "escape", "hi")[0] == 404


def test_resident_adapters_are_taken_out_of_the_kv_budget(gateway, llama):
    _, _, c = llama

    def kv_and_adapters():
        # The worker reports its stats each tick; until its first tick after loading they hold no "kv".
        stats = worker(gateway)["stats"]
        return stats.get("kv") or {}, stats.get("adapters") or {}

    def resident(name):
        now = kv_and_adapters()
        return now if now[0] and name in now[1].get("resident", []) else None

    assert complete(gateway, "hr-bot", "hello")[0] == 200
    kv, adapters = wait_for(lambda: resident("hr-bot"), timeout=30)
    assert kv["taken_bytes"] == adapters["resident_bytes"] > 0, (kv, adapters)
    assert "less resident adapters" in kv["source"]
    shutil.copytree(c, gateway.allowed / "second", dirs_exist_ok=True)
    assert add(gateway, "second", gateway.allowed / "second")[0] == 201  # loaded by the worker as it is added
    one = sum(w.nbytes for w in mx.load(str(c / "adapters.safetensors")).values())

    grown = wait_for(lambda: resident("second"), timeout=30)
    assert grown[0]["taken_bytes"] == grown[1]["resident_bytes"] == adapters["resident_bytes"] + one, grown
    assert grown[0]["budget_bytes"] == kv["budget_bytes"] - one, (kv, grown[0])  # the KV budget gave up its bytes
