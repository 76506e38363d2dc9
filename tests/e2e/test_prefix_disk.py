"""The prefix cache survives unloads and restarts: a stopping worker writes the blocks it
holds in memory to the disk tier under $MLXGW_HOME/prefix-cache/<model>/blocks, the next
worker indexes them and reads them back on a hit.

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
from mlxgw.worker.model.interfaces import Row

BOUND_MB = 1  # disk-bound's bound; each of its prompts makes ~0.4 MB of block files: two fit, three do not


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
def gateways(home, tiny_dir, smollm2_dir):
    from helpers.family_models import build_family_model

    models = home / "models"
    build_family_model("gemma3_text", models / "fam-gemma3_text", smollm2_dir)  # sliding-window layers
    shutil.copytree(tiny_dir, models / "tiny-disk-a", dirs_exist_ok=True)
    shutil.copytree(tiny_dir, models / "tiny-disk-b", dirs_exist_ok=True)
    shutil.rmtree(home / "prefix-cache", ignore_errors=True)
    entry = {"source": "tiny-disk-a", "max_num_seqs": 2, "prefill_step_size": 256}
    config = {
        "manager": {"auto_discover": False},
        "models": [
            {"name": "disk-idle", **entry, "idle_unload_s": 1},
            {"name": "disk-restart", **entry},
            {"name": "disk-restart-sliding", **entry, "source": "fam-gemma3_text"},
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
    """The model's block files on disk."""
    folder = home / "prefix-cache" / model / "blocks"
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def _cache_stats(gw: GatewayProcess, model: str) -> dict:
    (stats,) = http(f"{gw.url}/v1/cache/stats?model={model}")[2]["models"][model]
    return stats


def _chains(files: list[Path]) -> dict[Path, list[Path]]:
    """Block files by the sequence they belong to: first block -> its chain's files."""
    import mlx.core as mx

    parent = {}
    for f in files:
        meta = mx.load(str(f), return_metadata=True)[1]
        parent[meta["key"]] = meta["parent"]
    by_key = {f.stem: f for f in files}
    out: dict[Path, list[Path]] = {}
    for f in files:
        root = f.stem
        while parent.get(root):
            root = parent[root]
        out.setdefault(by_key[root], []).append(f)
    return out


def test_a_long_prompts_kv_survives_an_idle_unload(gateways):
    gw, prompt = gateways.gw, _words("idle", 500)
    answer, prompt_tokens, cached = _ask(gw, "disk-idle", prompt)
    assert prompt_tokens > 1000 and cached == 0
    wait_for(lambda: gw.model_status("disk-idle")["unloads"] >= 1, timeout=60)
    assert gw.model_status("disk-idle")["state"] == "unloaded"
    again, _, cached = _ask(gw, "disk-idle", prompt)
    assert cached >= prompt_tokens - 1
    assert again == answer
    disk = _cache_stats(gw, "disk-idle")["disk"]
    assert disk["indexed_blocks"] > 0 and disk["indexed_tokens"] > prompt_tokens


def test_a_restarted_worker_serves_a_prompt_from_the_blocks_its_predecessor_saved(gateways, home):
    """A graceful stop writes the blocks memory holds to the block tier (one file per block,
    no whole-sequence files), and the next worker reads the prompt's prefix back from them
    on its first hit: cached tokens reported, the same greedy answer. For a full-attention
    and a sliding-window family (its state checkpoints travel in the blocks), one restart."""
    prompt, models = _words("restart", 500), ("disk-restart", "disk-restart-sliding")
    before = {model: _ask(gateways.gw, model, prompt) for model in models}
    assert all(cached == 0 for _, _, cached in before.values())
    gateways.restart()  # SIGTERM: every worker drains, saves, exits
    for model, (answer, prompt_tokens, _) in before.items():
        folder = home / "prefix-cache" / model
        assert [p.name for p in folder.iterdir()] == ["blocks"] and len(_stored(home, model)) > prompt_tokens // 32
        again, _, cached = _ask(gateways.gw, model, prompt)
        assert cached >= prompt_tokens - 1, model
        assert again == answer, model
        tier = _cache_stats(gateways.gw, model)["disk_tier"]
        assert tier["read"] >= prompt_tokens // 32 and tier["tokens_brought_back"] >= prompt_tokens - 1, (model, tier)


def test_entries_written_for_a_changed_model_are_refused(gateways, home, smollm2_dir):
    from tiny_model import build_tiny_model

    gw, prompt = gateways.gw, _words("changed", 400)
    _ask(gw, "disk-changed", prompt)
    _unload(gw, "disk-changed")
    old = _stored(home, "disk-changed")
    assert old
    time.sleep(0.05)  # a later mtime even on coarse clocks
    build_tiny_model(home / "models" / "tiny-disk-b", smollm2_dir, seed=1)  # re-imported, new weights
    _, _, cached = _ask(gw, "disk-changed", prompt)
    assert cached == 0
    assert not any(p.exists() for p in old)
    assert gw.log().count("were written for a different version of the model; deleted") == 1


def test_a_torn_or_corrupt_block_file_is_skipped_and_the_others_served(gateways, home):
    """A block file torn by a crash mid-write (cut short under its own name), a file that is
    not a block, FIFOs and a temporary file left by a killed write: each is skipped when the
    next worker indexes the folder (the FIFOs without blocking it), the others serve."""
    import os

    gw = gateways.gw
    short, long = _words("intact", 300), _words("damaged", 600)
    _ask(gw, "disk-corrupt", short)
    _, long_tokens, _ = _ask(gw, "disk-corrupt", long)
    _unload(gw, "disk-corrupt")
    chains = sorted(_chains(_stored(home, "disk-corrupt")).items(), key=lambda c: len(c[1]))
    assert len(chains) == 2
    torn = chains[1][0]  # the long prompt's first block
    data = torn.read_bytes()
    torn.write_bytes(data[: len(data) // 2])
    folder = torn.parent
    (folder / ("0" * 32 + ".safetensors")).write_bytes(b"not a safetensors file" * 10)
    os.mkfifo(folder / ("1" * 32 + ".safetensors"))
    (folder / "uses.json").unlink()
    os.mkfifo(folder / "uses.json")  # the blocks keep the use their headers hold
    (folder / "tmp-0123-99.safetensors").write_bytes(data[:100])
    _, short_tokens, cached_short = _ask(gw, "disk-corrupt", short)
    _, _, cached_long = _ask(gw, "disk-corrupt", long)
    assert cached_short >= short_tokens - 1
    assert cached_long < 100
    status = gw.model_status("disk-corrupt")
    assert status["restarts"] == 0 and status["state"] == "ready"
    log = gw.log()
    assert log.count(f"skipped block file {torn.name}") == 1 and log.count("skipped block file " + "0" * 32) == 1
    assert log.count("skipped block file " + "1" * 32) == 1
    assert not torn.exists() and not (folder / "tmp-0123-99.safetensors").exists()


def test_the_disk_bound_keeps_reused_prefixes_before_more_recent_ones(gateways, home):
    """Hot = reused first, then most recent: with room for two sequences' blocks, the prompt
    asked twice and the latest one-off are kept, the two older one-offs are not."""
    gw = gateways.gw
    prompts = {name: _words(name, 280) for name in ("reused", "older", "old", "latest")}
    _ask(gw, "disk-bound", prompts["reused"], max_tokens=4)
    for name in ("reused", "older", "old", "latest"):
        _ask(gw, "disk-bound", prompts[name], max_tokens=4)
    _unload(gw, "disk-bound")
    files = _stored(home, "disk-bound")
    assert sum(f.stat().st_size for f in files) <= BOUND_MB << 20
    assert len(_chains(files)) == 2
    for name, kept in (("reused", True), ("latest", True), ("older", False), ("old", False)):
        _, prompt_tokens, cached = _ask(gw, "disk-bound", prompts[name], max_tokens=1)
        assert (cached >= prompt_tokens - 1) if kept else (cached < 100), (name, cached, prompt_tokens)


def test_prefix_cache_disk_mb_0_writes_nothing(gateways, home):
    _ask(gateways.gw, "disk-off", _words("off", 200))
    _unload(gateways.gw, "disk-off")
    assert not (home / "prefix-cache" / "disk-off").exists()


def test_a_negative_disk_bound_is_a_config_error():
    with pytest.raises(ConfigError, match="prefix_disk_mb"):
        parse_registry({"models": [{"name": "m", "cache": {"prefix_disk_mb": -1}}]})


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
        uid, _ = runner.insert(Row(runner.encode_text(_words(salt, 200)), 2, SamplingParams(temperature=0.0)))
        while runner._rows:
            runner.step()
    return runner, store


def test_a_save_past_its_time_budget_writes_nothing_more_and_leaves_no_temporary_file(runner_with_store):
    runner, store = runner_with_store
    report = store.save(runner.prefix_cache, budget_s=0)
    assert report["written_blocks"] == 0
    assert [p.name for p in (store.dir / "blocks").iterdir()] == ["uses.json"]


def test_a_temporary_file_left_by_a_killed_save_is_removed_at_the_next_start(runner_with_store):
    from mlxgw.worker.model.cache.prefix_cache import PrefixCache

    runner, store = runner_with_store
    saved = store.save(runner.prefix_cache)["saved_blocks"]
    leftover = store.dir / "blocks" / "tmp-0123-99.safetensors"
    leftover.write_bytes(b"half written")
    report = store.restore(PrefixCache(64 << 20))
    assert report["indexed_blocks"] == saved and report["skipped"] == 0
    assert not leftover.exists()


def test_clearing_the_cache_clears_its_disk_copy(runner_with_store):
    from mlxgw.worker.model.cache.prefix_cache import PrefixCache

    runner, store = runner_with_store
    store.save(runner.prefix_cache)
    assert len(list((store.dir / "blocks").glob("*.safetensors"))) > 2
    runner.cache_clear()  # DELETE /v1/cache
    assert store.restore(PrefixCache(64 << 20))["indexed_blocks"] == 0


def test_loading_reads_no_kv_until_a_lookup_reaches_its_blocks(runner_with_store, tiny_dir):
    """The next worker indexes the block files' headers only: its memory stays empty until a
    prompt's lookup reads that prompt's blocks back (the other sequence's stay on disk)."""
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner, store = runner_with_store
    store.save(runner.prefix_cache)
    again = build_mlx_runner(
        tiny_dir, context_length=None, max_num_seqs=2, prefill_step_size=256, cache_bytes=64 << 20,
        prefix_store=PrefixStore(store.dir, model_fingerprint(tiny_dir), 64 << 20),
    )  # fmt: skip
    report = again.prefix_store.restore(again.prefix_cache)
    assert report["indexed_blocks"] == len(runner.prefix_cache.tree.blocks)
    assert again.prefix_cache.nbytes == 0
    prompt = again.encode_text(_words("one", 200))
    cache, covered = again.prefix_cache.longest_match(prompt)
    assert covered == len(prompt) - 1
    assert 0 < again.prefix_cache.nbytes < runner.prefix_cache.nbytes  # "two" is still on disk only


def test_a_blocks_hits_since_it_was_written_survive_a_restart_without_writing_it_again(runner_with_store):
    """The eviction order on disk weighs hits: a block already on disk that served lookups
    afterwards keeps them across a stop (in uses.json), and its KV is not written twice."""
    from mlxgw.worker.model.cache.prefix_cache import PrefixCache

    runner, store = runner_with_store
    store.save(runner.prefix_cache)
    prompt = runner.encode_text(_words("one", 200))
    runner.insert(Row(prompt, 2, SamplingParams(temperature=0.0)))  # a hit on "one"'s blocks
    while runner._rows:
        runner.step()
    report = store.save(runner.prefix_cache)
    assert report["written_blocks"] <= 1  # at most the new tail its answer added
    cache = PrefixCache(64 << 20)
    store.restore(cache)
    first = next(h for h in cache.disk_tier.index.values() if h.start == 0 and h.tokens == tuple(prompt[:32]))
    assert first.hits >= 1


def test_the_disk_bound_holds_for_a_stop_and_the_evictions_after_it(tiny_dir, tmp_path):
    """cache.prefix_disk_mb bounds the one block tier: a stop writes the hottest sequence
    that fits, and blocks evicted afterwards still leave the folder within the bound."""
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(
        tiny_dir, context_length=None, max_num_seqs=2, prefill_step_size=256, cache_bytes=64 << 20
    )
    for salt in ("bound", "other"):
        runner.insert(Row(runner.encode_text(_words(salt, 300)), 2, SamplingParams(temperature=0.0)))
        while runner._rows:
            runner.step()
    probe = PrefixStore(tmp_path / "probe", model_fingerprint(tiny_dir), 64 << 20)
    probe.save(runner.prefix_cache)
    both = sum(p.stat().st_size for p in (probe.dir / "blocks").glob("*.safetensors"))
    bound = int(0.75 * both)
    store = PrefixStore(tmp_path / "store", model_fingerprint(tiny_dir), bound)
    report = store.save(runner.prefix_cache)  # a stop: one sequence fits, not both
    assert 0 < report["saved_blocks"] < len(runner.prefix_cache.tree.blocks)
    runner.prefix_cache.trim_to(0)  # then its blocks leave memory for the same tier
    on_disk = sum(p.stat().st_size for p in (store.dir / "blocks").glob("*.safetensors"))
    assert on_disk <= bound, f"{on_disk} bytes on disk under a bound of {bound}"


def test_a_folder_of_the_whole_sequence_format_is_cleared_at_load(tiny_dir, tmp_path, caplog):
    """Entries of the old restart format (a whole sequence per file, index.json) are not read:
    they are deleted with one log line, and the blocks beside them are indexed."""
    from mlxgw.worker.model.cache.prefix_cache import PrefixCache
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint

    folder = tmp_path / "store"
    (folder / "blocks").mkdir(parents=True)
    old = [folder / ("ab" * 16 + ".safetensors"), folder / "index.json"]
    for path in old:
        path.write_bytes(b"{}")
    store = PrefixStore(folder, model_fingerprint(tiny_dir), 64 << 20)
    with caplog.at_level("WARNING"):
        assert store.restore(PrefixCache(64 << 20))["indexed_blocks"] == 0
    assert not any(p.exists() for p in old) and (folder / "blocks").is_dir()
    assert sum("whole-sequence format" in r.message for r in caplog.records) == 1


def test_the_disk_bound_defaults_to_a_tenth_of_free_disk(home, tiny_dir):
    from mlxgw.worker.model.cache.prefix_store import store_for

    (entry,) = parse_registry({"models": [{"name": "m"}]}).models
    assert entry.cache.prefix_disk_mb is None  # not a fixed 1 GB
    store = store_for("default-bound", tiny_dir, entry.cache.prefix_disk_mb)
    expected = min(64 << 30, shutil.disk_usage(home).free // 10)
    assert store is not None and abs(store.max_bytes - expected) < max(expected // 20, 64 << 20)
