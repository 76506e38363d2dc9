"""The prefix cache survives unloads and restarts: a stopping worker writes its hottest
entries' KV under $MLXGW_HOME/prefix-cache/<model>, the next worker reads them back.

Real `mlxgw up` processes and worker processes with the tiny random-weight model; cache
hits are read from `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from helpers import NO_EOS, http, openai_client, start_gateway, wait_for
from helpers.gateway import GatewayProcess

from mlxgw.shared.config import ConfigError, parse_registry
from mlxgw.shared.protocol import SamplingParams

BOUND_MB = 1  # disk-bound's bound; its prompts make entries of ~0.4 MB: two fit, three do not


def _words(salt: str, n: int) -> str:
    return " ".join(f"{salt}{i % 89}" for i in range(n))


class Gateways:
    """The module's gateway, which one test restarts (same home, same config)."""

    def __init__(self, home: Path, config: dict):
        self.home, self.config = home, config
        self.gw = start_gateway(home, config, "prefix-disk-gateway")

    def restart(self) -> None:
        assert self.gw.stop() == 0
        self.gw = start_gateway(self.home, self.config, "prefix-disk-gateway")


@pytest.fixture(scope="module")
def gateways(home, tiny_dir):
    models = home / "models"
    shutil.copytree(tiny_dir, models / "tiny-disk-a", dirs_exist_ok=True)
    shutil.copytree(tiny_dir, models / "tiny-disk-b", dirs_exist_ok=True)
    shutil.rmtree(home / "prefix-cache", ignore_errors=True)
    entry = {"source": "tiny-disk-a", "max_num_seqs": 2, "prefill_step_size": 256}
    config = {
        "manager": {"auto_discover": False},
        "models": [
            {"name": "disk-idle", **entry, "idle_unload_s": 1},
            {"name": "disk-restart", **entry},
            {"name": "disk-corrupt", **entry},
            {"name": "disk-bound", **entry, "cache": {"prefix_disk_mb": BOUND_MB}},
            {"name": "disk-changed", **entry, "source": "tiny-disk-b"},
            {"name": "disk-off", **entry, "cache": {"prefix_disk_mb": 0}},
        ],
    }
    g = Gateways(home, config)
    yield g
    g.gw.stop()


def _ask(gw: GatewayProcess, model: str, content: str, max_tokens: int = 8) -> tuple[str, int, int]:
    """Greedy answer, prompt tokens, prompt tokens served from the prefix cache."""
    r = openai_client(gw).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"logit_bias": NO_EOS},
    )
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def _unload(gw: GatewayProcess, model: str) -> None:
    """A planned stop; answers once the worker has exited (its save is done)."""
    status, _, body = http(f"{gw.url}/v1/models/{model}/unload", "POST", {})
    assert status == 200 and body["loaded"] is False, body


def _stored(home: Path, model: str) -> list[Path]:
    folder = home / "prefix-cache" / model
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def test_a_long_prompts_kv_survives_an_idle_unload(gateways):
    gw, prompt = gateways.gw, _words("idle", 500)
    answer, prompt_tokens, cached = _ask(gw, "disk-idle", prompt)
    assert prompt_tokens > 1000 and cached == 0
    wait_for(lambda: gw.model_status("disk-idle")["unloads"] >= 1, timeout=60)
    assert gw.model_status("disk-idle")["state"] == "unloaded"
    again, _, cached = _ask(gw, "disk-idle", prompt)
    assert cached >= prompt_tokens - 1
    assert again == answer
    (stats,) = http(f"{gw.url}/v1/cache/stats?model=disk-idle")[2]["models"]["disk-idle"]
    disk = stats["disk"]
    assert disk["restored_entries"] == 1 and disk["restored_tokens"] > prompt_tokens


def test_a_long_prompts_kv_survives_a_gateway_restart(gateways):
    prompt = _words("restart", 500)
    answer, prompt_tokens, cached = _ask(gateways.gw, "disk-restart", prompt)
    assert cached == 0
    gateways.restart()  # SIGTERM: every worker drains, saves, exits
    again, _, cached = _ask(gateways.gw, "disk-restart", prompt)
    assert cached >= prompt_tokens - 1
    assert again == answer


def test_entries_written_for_a_changed_model_are_refused(gateways, home, smollm2_dir):
    from tiny_model import build_tiny_model

    gw, prompt = gateways.gw, _words("changed", 400)
    _ask(gw, "disk-changed", prompt)
    _unload(gw, "disk-changed")
    (old,) = _stored(home, "disk-changed")
    time.sleep(0.05)  # a later mtime even on coarse clocks
    build_tiny_model(home / "models" / "tiny-disk-b", smollm2_dir, seed=1)  # re-imported, new weights
    _, _, cached = _ask(gw, "disk-changed", prompt)
    assert cached == 0
    assert not old.exists()
    assert gw.log().count("were written for a different version of the model; deleted") == 1


def test_a_corrupt_or_truncated_entry_is_skipped_and_the_others_restored(gateways, home):
    gw = gateways.gw
    short, long = _words("intact", 300), _words("damaged", 600)
    _ask(gw, "disk-corrupt", short)
    _, long_tokens, _ = _ask(gw, "disk-corrupt", long)
    _unload(gw, "disk-corrupt")
    files = sorted(_stored(home, "disk-corrupt"), key=lambda p: p.stat().st_size)
    assert len(files) == 2
    data = files[1].read_bytes()
    files[1].write_bytes(data[: len(data) // 2])  # the long prompt's entry, truncated
    (files[0].parent / ("0" * 32 + ".safetensors")).write_bytes(b"not a safetensors file" * 10)
    _, short_tokens, cached_short = _ask(gw, "disk-corrupt", short)
    _, _, cached_long = _ask(gw, "disk-corrupt", long)
    assert cached_short >= short_tokens - 1
    assert cached_long < 100
    status = gw.model_status("disk-corrupt")
    assert status["restarts"] == 0 and status["state"] == "ready"
    log = gw.log()
    assert log.count(f"skipped {files[1].name}") == 1 and log.count("skipped " + "0" * 32) == 1


def test_the_disk_bound_keeps_reused_prefixes_before_more_recent_ones(gateways, home):
    """Hot = reused first, then most recent: with room for two entries, the prompt asked
    twice and the latest one-off are kept, the two older one-offs are not."""
    gw = gateways.gw
    prompts = {name: _words(name, 280) for name in ("reused", "older", "old", "latest")}
    _ask(gw, "disk-bound", prompts["reused"], max_tokens=4)
    for name in ("reused", "older", "old", "latest"):
        _ask(gw, "disk-bound", prompts[name], max_tokens=4)
    _unload(gw, "disk-bound")
    files = _stored(home, "disk-bound")
    assert sum(f.stat().st_size for f in files) <= BOUND_MB << 20
    assert len(files) == 2
    for name, kept in (("reused", True), ("latest", True), ("older", False), ("old", False)):
        _, prompt_tokens, cached = _ask(gw, "disk-bound", prompts[name], max_tokens=1)
        assert (cached >= prompt_tokens - 1) if kept else (cached < 100), (name, cached, prompt_tokens)


def test_prefix_cache_disk_mb_0_writes_nothing(gateways, home):
    _ask(gateways.gw, "disk-off", _words("off", 200))
    _unload(gateways.gw, "disk-off")
    assert not (home / "prefix-cache" / "disk-off").exists()


def test_a_negative_disk_bound_is_a_config_error():
    with pytest.raises(ConfigError, match="prefix_disk_mb"):
        parse_registry({"models": [{"name": "m", "prefix_cache_disk_mb": -1}]})


# -- the store in-process: what the gateway cannot make happen on purpose ---------------------------
@pytest.fixture
def runner_with_store(tiny_dir, tmp_path):
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    store = PrefixStore(tmp_path / "store", model_fingerprint(tiny_dir), 64 << 20)
    runner = build_mlx_runner(
        tiny_dir, context_length=None, max_num_seqs=2, prefill_step_size=256, cache_bytes=64 << 20, prefix_store=store
    )
    for salt in ("one", "two"):
        uid, _ = runner.insert(runner.encode_text(_words(salt, 200)), 2, SamplingParams(temperature=0.0))
        while runner._covered:
            runner.step()
    return runner, store


def test_a_save_past_its_time_budget_writes_nothing_more_and_leaves_no_temporary_file(runner_with_store):
    runner, store = runner_with_store
    report = store.save(runner.prefix_cache, budget_s=0)
    assert report["written_entries"] == 0
    assert [p.name for p in store.dir.iterdir()] == ["index.json"]


def test_a_temporary_file_left_by_a_killed_save_is_removed_at_the_next_start(runner_with_store):
    from mlxgw.worker.model.cache.prefix_cache import PrefixCache

    runner, store = runner_with_store
    store.save(runner.prefix_cache)
    leftover = store.dir / "tmp-0123-99.safetensors"
    leftover.write_bytes(b"half written")
    report = store.restore(PrefixCache(64 << 20))
    assert report["restored_entries"] == 2 and report["skipped"] == 0
    assert not leftover.exists()


def test_clearing_the_cache_clears_its_disk_copy(runner_with_store):
    from mlxgw.worker.model.cache.prefix_cache import PrefixCache

    runner, store = runner_with_store
    store.save(runner.prefix_cache)
    assert len(list(store.dir.glob("*.safetensors"))) == 2
    runner.cache_clear()  # DELETE /v1/cache
    assert store.restore(PrefixCache(64 << 20))["restored_entries"] == 0


def test_restoring_stops_at_the_in_memory_bound(runner_with_store):
    from mlxgw.worker.model.cache.prefix_cache import PrefixCache

    runner, store = runner_with_store
    store.save(runner.prefix_cache)
    one_entry = max(e.nbytes for e in runner.prefix_cache.entries())
    small = PrefixCache(one_entry + 1024)
    assert store.restore(small)["restored_entries"] == 1
    assert small.nbytes <= small.max_bytes


def test_the_restart_and_live_tiers_share_one_disk_bound(tiny_dir, tmp_path):
    """cache.prefix_disk_mb bounds both tiers together: a stop's entries are reserved out of
    it, and blocks evicted afterwards fit in the rest (before, each tier had the whole bound)."""
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(
        tiny_dir, context_length=None, max_num_seqs=2, prefill_step_size=256, cache_bytes=64 << 20
    )
    runner.insert(runner.encode_text(_words("bound", 300)), 2, SamplingParams(temperature=0.0))
    while runner._covered:
        runner.step()
    probe = PrefixStore(tmp_path / "probe", model_fingerprint(tiny_dir), 64 << 20)
    probe.save(runner.prefix_cache)
    entry = sum(p.stat().st_size for p in probe.dir.glob("*.safetensors"))
    bound = int(1.5 * entry)
    store = PrefixStore(tmp_path / "store", model_fingerprint(tiny_dir), bound)
    store.restore(runner.prefix_cache)  # attaches the live tier, under the same bound
    store.save(runner.prefix_cache)  # a stop: the entry takes two thirds of the bound
    runner.prefix_cache.trim_to(0)  # then its blocks leave memory for the live tier
    files = list(store.dir.rglob("*.safetensors"))
    assert any(p.parent.name == "blocks" for p in files)
    on_disk = sum(p.stat().st_size for p in files)
    assert on_disk <= bound, f"{on_disk} bytes on disk under a bound of {bound}"


def test_the_disk_bound_defaults_to_a_tenth_of_free_disk(home, tiny_dir):
    from mlxgw.worker.model.cache.prefix_store import store_for

    (entry,) = parse_registry({"models": [{"name": "m"}]}).models
    assert entry.cache.prefix_disk_mb is None  # not a fixed 1 GB
    store = store_for("default-bound", tiny_dir, entry.cache.prefix_disk_mb)
    expected = min(64 << 30, shutil.disk_usage(home).free // 10)
    assert store is not None and abs(store.max_bytes - expected) < max(expected // 20, 64 << 20)
