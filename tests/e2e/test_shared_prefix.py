"""A team's sessions on one worker: the shared prefix held once, prefilled once, and kept on
disk when memory evicts it (worker/model/cache/kv_blocks.py, worker/schedule/prefix_inflight.py,
worker/model/cache/block_disk.py; three regression checks, on the tiny model: the behaviour
does not depend on the weights)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from helpers import openai_client, start_gateway
from helpers.runner_jobs import generate_together, run_alone

from mlxgw.shared.events import EventKind
from mlxgw.shared.protocol import GenerateRequest, SamplingParams

SYSTEM_WORDS = 600  # about 1,200 tokens of system prompt
OWN_WORDS = 90


def _runner(model_dir, cache_bytes: int, prefix_store=None):
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(
        model_dir,
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=256,
        cache_bytes=cache_bytes,
        prefix_store=prefix_store,
    )


def _words(runner, salt: str, n: int) -> list[int]:
    return runner.encode_text(" ".join(f"{salt}{i % 89}" for i in range(n)))


def _run(runner, prompt: list[int], max_tokens: int = 4) -> tuple[list[int], int]:
    return run_alone(runner, prompt, max_tokens)


def _distinct_tokens(sequences: list[list[int]]) -> int:
    """Positions of the trie the sequences form: each shared prefix counted once."""
    return len({tuple(s[: i + 1]) for s in sequences for i in range(len(s))})


def test_six_sessions_sharing_a_system_prompt_hold_it_once(tiny_dir):
    from mlxgw.worker.model.cache.kv_blocks import piece_arrays

    runner = _runner(tiny_dir, 256 << 20)
    system = _words(runner, "sys", SYSTEM_WORDS)
    assert len(system) >= 1100
    prompts = [system + _words(runner, f"own{k}-", OWN_WORDS) for k in range(6)]
    for p in prompts:
        _run(runner, p)
    stored = [e.tokens for e in runner.prefix_cache.entries()]
    assert len(stored) == 6
    block = next(b for b in runner.prefix_cache.tree.blocks.values() if b.full)
    per_token = sum(a.nbytes for p in block.pieces for a in piece_arrays(p)) / len(block.tokens)
    distinct = _distinct_tokens(stored)
    ratio = runner.prefix_cache.nbytes / (distinct * per_token)
    assert ratio <= 1.2, f"{ratio:.2f}x the KV of the {distinct} distinct tokens"


def test_a_session_evicted_from_memory_comes_back_from_disk_with_the_same_tokens(tiny_dir, tmp_path):
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint

    store = PrefixStore(tmp_path / "store", model_fingerprint(tiny_dir), 256 << 20)
    probe = _runner(tiny_dir, 256 << 20)
    first = _words(probe, "session-a", 500)
    _run(probe, first)
    one_session = probe.prefix_cache.nbytes
    runner = _runner(tiny_dir, int(one_session * 1.5), prefix_store=store)
    store.restore(runner.prefix_cache)  # attaches the live disk tier
    expected, cached = _run(runner, first)
    assert cached == 0
    for k in range(4):  # four other sessions push it out of memory
        _run(runner, _words(runner, f"other{k}-", 500))
    assert not any(e.tokens[:50] == first[:50] for e in runner.prefix_cache.entries()), "still in memory"
    again, cached = _run(runner, first)
    assert cached >= 0.9 * len(first), f"{cached} of {len(first)} cached"
    assert again == expected
    tier = runner.cache_stats()["disk_tier"]
    assert tier["read"] > 0 and tier["tokens_brought_back"] >= 0.9 * len(first)


def test_a_torn_block_file_is_skipped_and_deleted(tiny_dir, tmp_path):
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint

    store = PrefixStore(tmp_path / "store", model_fingerprint(tiny_dir), 256 << 20)
    runner = _runner(tiny_dir, 256 << 20, prefix_store=store)
    store.restore(runner.prefix_cache)
    prompt = _words(runner, "torn", 300)
    expected, _ = _run(runner, prompt)
    runner.prefix_cache.trim_to(0)  # everything to disk
    files = sorted((tmp_path / "store" / "blocks").glob("*.safetensors"))
    assert files
    first_block = next(f for f in files if runner.prefix_cache.disk_tier.index[bytes.fromhex(f.stem)].start == 0)
    first_block.write_bytes(first_block.read_bytes()[:100])  # a write cut by a crash
    while not runner.prefix_ready(prompt):  # read off the engine thread, as admission does
        time.sleep(0.01)
    again, cached = _run(runner, prompt)
    assert cached == 0 and again == expected  # nothing reachable past the torn first block
    assert not first_block.exists() and runner.cache_stats()["disk_tier"]["skipped"] == 1


SLOW_READ_S = 3.0  # the slow disk: a block file whose bytes arrive this late
NO_EOS = SamplingParams(temperature=0, logit_bias={0: -100, 2: -100})


def _through(sched, rid: str, prompt: list[int], max_tokens: int) -> None:
    req = GenerateRequest(rid=rid, prompt_tokens=prompt, max_tokens=max_tokens, sampling=NO_EOS)
    ((_, ev),) = sched.submit(req)
    assert ev.KIND == EventKind.ACCEPTED, ev


def _answer(events: list) -> tuple[str, int]:
    """A request's text and cached prompt tokens, from its events."""
    finish = next(e for e in events if e.KIND == EventKind.FINISH)
    return "".join(getattr(e, "text", None) or "" for e in events), finish.usage.cached_tokens


def test_a_prefix_read_from_a_slow_disk_does_not_stall_another_rows_decode(tiny_dir, tmp_path, monkeypatch):
    """The block files of a prefix on disk are read off the engine thread while the row
    waits in the queue: a decoding row keeps stepping through a 3 s read (before, the read
    ran inside admission and every row waited for it), and the answer is unchanged."""
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint
    from mlxgw.worker.schedule.scheduler import Scheduler

    store = PrefixStore(tmp_path / "store", model_fingerprint(tiny_dir), 256 << 20)
    runner = _runner(tiny_dir, 256 << 20, prefix_store=store)
    store.restore(runner.prefix_cache)
    sched = Scheduler(runner, max_num_seqs=8, max_queue=16)
    prompt = _words(runner, "slowdisk", 300)
    events: dict[str, list] = {}

    def step() -> None:
        for rid, ev in sched.step():
            events.setdefault(rid, []).append(ev)

    _through(sched, "cold", prompt, 6)
    while sched.has_work():
        step()
    expected, cached = _answer(events["cold"])
    assert cached == 0
    runner.prefix_cache.trim_to(0)  # the whole prefix to the disk tier
    first = next(h.path for h in runner.prefix_cache.disk_tier.index.values() if h.start == 0)
    _through(sched, "decoding", _words(runner, "busy", 40), 10_000)
    while not any(e.KIND == EventKind.DELTA for e in events.get("decoding", [])):
        step()
    # A slow disk: the first block's bytes come SLOW_READ_S late (a FIFO stood in for it
    # before block files had to be regular files; the reader thread sleeps as a disk would).
    from mlxgw.worker.model.cache import block_reader

    read = block_reader.read_regular

    def slow_disk(path, size=None):
        if path == first:
            time.sleep(SLOW_READ_S)
        return read(path, size)

    monkeypatch.setattr(block_reader, "read_regular", slow_disk)
    _through(sched, "from-disk", prompt, 6)
    started, longest, decoded = time.monotonic(), 0.0, len(events["decoding"])
    while not any(e.KIND == EventKind.FINISH for e in events.get("from-disk", [])):
        at = time.monotonic()
        step()
        longest = max(longest, time.monotonic() - at)
        assert time.monotonic() - started < 60, "the row never came back from disk"
    assert longest < SLOW_READ_S / 2, f"a step took {longest:.2f} s: the decoding row waited on the disk"
    assert len(events["decoding"]) - decoded >= 5
    text, cached = _answer(events["from-disk"])
    assert text == expected and cached >= 0.9 * len(prompt), f"{cached} of {len(prompt)} cached"
    assert runner.cache_stats()["disk_tier"]["prefetched"] >= 1
    sched.cancel("decoding")


def test_a_request_arriving_while_the_leader_decodes_reuses_the_prefix_it_read(tiny_dir):
    """The row that read a shared prefix is decoding (its blocks would reach the store only
    when it ends): a request arriving now has it publish them and reads only its own part,
    with the answer a cold read gives."""
    from mlxgw.worker.schedule.prefix_inflight import shared_prefix
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner = _runner(tiny_dir, 256 << 20)
    sched = Scheduler(runner, max_num_seqs=8, max_queue=16)
    system = _words(runner, "teamsys", 300)
    leader, follower = system + _words(runner, "lead", 20), system + _words(runner, "follow", 20)
    events: dict[str, list] = {}

    def step() -> None:
        for rid, ev in sched.step():
            events.setdefault(rid, []).append(ev)

    _through(sched, "leader", leader, 10_000)
    while not any(e.KIND == EventKind.DELTA for e in events.get("leader", [])):
        step()
    _through(sched, "follower", follower, 6)
    while not any(e.KIND == EventKind.FINISH for e in events.get("follower", [])):
        step()
    text, cached = _answer(events["follower"])
    shared = shared_prefix(leader, follower)
    assert shared >= 600 and cached >= shared, f"{cached} of the {shared} shared tokens cached"
    sched.cancel("leader")
    runner.cache_clear()
    _through(sched, "cold", follower, 6)
    while sched.has_work():
        step()
    assert _answer(events["cold"]) == (text, 0)


def _layers(length: int) -> list:
    """A two-layer KV cache of `length` positions (what a row holds; values do not matter here)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for _ in range(2):
        layer = KVCache()
        layer.update_and_fetch(mx.zeros((1, 2, length, 8)), mx.zeros((1, 2, length, 8)))
        out.append(layer)
    return out


LONG_SESSION = list(range(1000, 1640))  # 20 blocks
SHORT_CHAT = list(range(5000, 5096))  # 3 blocks


def _stored_blocks(cache, tokens: list[int]) -> int:
    """How many of a sequence's blocks are in memory."""
    node, _ = cache.tree.walk(tokens)
    return len(node.chain()) if node is not None else 0


def test_under_a_memory_bound_a_long_sessions_deep_blocks_outlive_a_short_chats():
    """Equally recent (the long one used just before), the short chat's blocks cost less to
    compute again: they leave memory first."""
    from mlxgw.worker.model.cache.prefix_cache import PrefixCache

    cache = PrefixCache(1 << 30)
    cache.insert(LONG_SESSION, _layers(len(LONG_SESSION)))
    cache.insert(SHORT_CHAT, _layers(len(SHORT_CHAT)))
    per_block = cache.nbytes // 23
    cache.trim_to(cache.nbytes - 3 * per_block)
    assert _stored_blocks(cache, LONG_SESSION) == 20 and _stored_blocks(cache, SHORT_CHAT) == 0


def test_under_the_disk_bound_a_long_sessions_deep_blocks_outlive_a_short_chats(tmp_path):
    """As in memory: the disk tier's bound deletes the short chat's blocks first (those no
    other block continues, so what stays is a chain readable from its first block)."""
    from mlxgw.worker.model.cache.block_disk import BlockDisk
    from mlxgw.worker.model.cache.prefix_cache import PrefixCache

    probe = PrefixCache(1 << 30)  # the size of a block's file
    probe.disk_tier = BlockDisk(tmp_path / "probe", "fingerprint", 1 << 30)
    probe.insert(SHORT_CHAT, _layers(len(SHORT_CHAT)))
    probe.trim_to(0)
    per_file = probe.disk_tier.nbytes / 3  # headers differ by a few bytes: a half file of slack below
    cache = PrefixCache(1 << 30)
    cache.disk_tier = disk = BlockDisk(tmp_path / "blocks", "fingerprint", int(21.5 * per_file))
    cache.insert(LONG_SESSION, _layers(len(LONG_SESSION)))
    cache.insert(SHORT_CHAT, _layers(len(SHORT_CHAT)))
    cache.trim_to(0)  # all of it to disk, where 21 of the 23 blocks fit
    long_keys = [b.start for b in disk.index.values() if b.tokens[0] in LONG_SESSION]
    short_keys = [b.start for b in disk.index.values() if b.tokens[0] in SHORT_CHAT]
    assert len(long_keys) == 20 and sorted(short_keys) == [0], (sorted(long_keys), sorted(short_keys))


def test_a_block_read_that_hangs_is_computed_instead(tiny_dir, tmp_path):
    """A block file that never yields its bytes (a hung disk) counts as a failed read after
    the reader's timeout: the row is admitted and computes the prefix, with the same answer."""
    from mlxgw.worker.model.cache.block_reader import BlockReader
    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint

    store = PrefixStore(tmp_path / "store", model_fingerprint(tiny_dir), 256 << 20)
    runner = _runner(tiny_dir, 256 << 20, prefix_store=store)
    store.restore(runner.prefix_cache)
    prompt = _words(runner, "hung", 300)
    expected, _ = _run(runner, prompt)
    runner.prefix_cache.trim_to(0)
    disk = runner.prefix_cache.disk_tier
    disk.reader = BlockReader(timeout_s=0.5)
    first = next(h.path for h in disk.index.values() if h.start == 0)
    first.unlink()
    os.mkfifo(first)  # nobody ever writes it: the read never ends
    started = time.monotonic()
    while not runner.prefix_ready(prompt):
        time.sleep(0.01)
    assert time.monotonic() - started < 5
    again, cached = _run(runner, prompt)
    assert cached == 0 and again == expected
    assert disk.reader.counts["failed"] == 1 and not first.exists()


def test_a_fifo_among_the_block_files_does_not_block_the_disk_tiers_start(tmp_path):
    from mlxgw.worker.model.cache.block_disk import BlockDisk

    folder = tmp_path / "blocks"
    folder.mkdir()
    os.mkfifo(folder / ("ab" * 16 + ".safetensors"))  # nobody writes it: reading it would never end
    disk = BlockDisk(folder, "fingerprint", 1 << 20)
    assert disk.counts["skipped"] == 1 and not any(folder.iterdir())


def test_concurrent_requests_with_one_fresh_prefix_prefill_it_once(home, tiny_dir):
    """Four requests reach a cold model together (they queue behind its load, so all four
    are waiting when it is ready): the first reads the prefix, the others wait for its KV.
    Small prefill chunks keep the first row reading long enough on a fast host; on the
    shared tiny model, a request arriving after the first had read its prompt found it
    decoding, not prefilling, and read the prefix again (CI: cached [3, 3, 1740, 1740])."""
    config = {
        "manager": {"auto_discover": False},
        "models": [{"name": "tiny-prefix-once", "source": "tiny", "prefill_step_size": 32, "max_num_seqs": 8}],
    }
    gw = start_gateway(home, config, "prefix-once")
    try:
        _ask_together(gw)
    finally:
        gw.stop()


def _ask_together(gw) -> None:
    client = openai_client(gw)
    system = " ".join(f"team{i % 89}" for i in range(SYSTEM_WORDS))
    usage: list = [None] * 4

    def ask(k: int) -> None:
        answer = client.chat.completions.create(
            model="tiny-prefix-once",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"question {k} " * 20}],
            max_tokens=2,
            temperature=0,
        )
        usage[k] = answer.usage

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cached = sorted(u.prompt_tokens_details.cached_tokens for u in usage)
    assert usage[0].prompt_tokens > 1100
    assert all(c >= 1000 for c in cached[1:]), f"cached tokens per request: {cached}"


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text", "falcon_h1"])
def test_a_hybrid_family_resumes_from_disk_with_its_checkpoints(family, tmp_path, home, smollm2_dir):
    from helpers.family_models import build_family_model

    from mlxgw.worker.model.cache.prefix_store import PrefixStore, model_fingerprint

    model_dir = build_family_model(family, home / "models" / f"fam-{family}", smollm2_dir)
    store = PrefixStore(tmp_path / "store", model_fingerprint(model_dir), 256 << 20)
    runner = _runner(model_dir, 256 << 20, prefix_store=store)
    store.restore(runner.prefix_cache)
    prompt = runner.encode_text("the quick brown fox jumps over the lazy dog " * 30)
    (expected,) = generate_together(runner, [(prompt, 4)])
    runner.prefix_cache.trim_to(0)
    assert runner.prefix_cache.nbytes == 0
    while not runner.prefix_ready(prompt):  # read off the engine thread, as admission does
        time.sleep(0.01)
    again, cached = _run(runner, prompt)
    assert cached == len(prompt) - 1 and again == expected
    assert runner.cache_stats()["disk_tier"]["prefetched"] > 0  # parsed from the bytes read


@pytest.fixture(scope="module")
def tiered_gateway(home, tiny_dir):
    from helpers import start_gateway

    # 1 MB of memory holds about one 1,000-token session of the tiny model (512 bytes a token).
    model = {"name": "tiny-tiered", "source": "tiny", "preload": True, "max_num_seqs": 4}
    model["cache"] = {"prefix_memory_mb": 1, "prefix_disk_mb": 64}
    gw = start_gateway(home, {"manager": {"auto_discover": False}, "models": [model]}, "tiered")
    yield gw
    gw.stop()


def test_through_the_api_a_session_evicted_by_four_others_resumes_from_disk(tiered_gateway):
    from helpers import wait_for

    client = openai_client(tiered_gateway)

    def ask(salt: str):
        system = " ".join(f"{salt}{i % 89}" for i in range(450))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "go on"}]
        return client.chat.completions.create(model="tiny-tiered", messages=messages, max_tokens=2, temperature=0)

    first = ask("alpha")
    for k in range(4):
        ask(f"beta{k}-")
    again = ask("alpha")
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.9 * again.usage.prompt_tokens, f"{cached} of {again.usage.prompt_tokens} cached"
    assert again.choices[0].message.content == first.choices[0].message.content

    def tier() -> dict:
        workers = [w for w in tiered_gateway.model_status("tiny-tiered")["workers"] if w["state"] == "ready"]
        return ((workers[0].get("stats") or {}).get("cache") or {}).get("disk_tier") or {} if workers else {}

    wait_for(lambda: tier().get("read", 0) > 0, 15)
    assert tier()["written"] > 0 and tier()["prefetched"] > 0  # read off the engine thread


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text"])
def test_a_hybrid_family_keeps_a_checkpoint_where_a_prompt_left_a_stored_one(family, home, smollm2_dir):
    """Raw prompts sharing a prefix that ends off every checkpoint: the second reads it in
    full but keeps a checkpoint at the junction, and the third resumes there."""
    from helpers.family_models import build_family_model

    model_dir = build_family_model(family, home / "models" / f"fam-{family}", smollm2_dir)
    runner = _runner(model_dir, 256 << 20)
    shared = runner.encode_text("a shared preamble of plain words " * 12)
    prompts = [shared + runner.encode_text(f" then {tail} goes its own way") for tail in ("alpha", "beta", "gamma")]
    _run(runner, prompts[0])
    junction = next(i for i, (a, b, c) in enumerate(zip(*prompts)) if len({a, b, c}) > 1)
    assert junction >= len(shared)
    _, second = _run(runner, prompts[1])
    assert second < junction  # nothing stored at the junction yet
    third, cached = _run(runner, prompts[2])
    assert cached == junction
    fresh, _ = _run(_runner(model_dir, 0), prompts[2])
    assert third == fresh


def test_a_prompt_a_client_asked_to_keep_leaves_memory_after_every_other():
    """A caching hint (cache_control, prompt_cache_retention) holds a prompt's blocks: under
    the bound they leave only after every block nobody asked to keep, even when those are
    more recent and dearer to compute again."""
    from mlxgw.worker.model.cache.prefix_cache import PrefixCache

    cache = PrefixCache(1 << 30)
    cache.insert(SHORT_CHAT, _layers(len(SHORT_CHAT)), hold_s=3600)
    cache.insert(LONG_SESSION, _layers(len(LONG_SESSION)))
    per_block = cache.nbytes // 23
    cache.trim_to(cache.nbytes - 3 * per_block)
    assert _stored_blocks(cache, SHORT_CHAT) == 3 and _stored_blocks(cache, LONG_SESSION) == 17
    expired = PrefixCache(1 << 30)
    expired.insert(SHORT_CHAT, _layers(len(SHORT_CHAT)), hold_s=1e-9)  # a hold that has ended
    expired.insert(LONG_SESSION, _layers(len(LONG_SESSION)))
    expired.trim_to(expired.nbytes - 3 * per_block)
    assert _stored_blocks(expired, SHORT_CHAT) == 0


def test_a_hinted_request_holds_its_prompt_through_the_runner(tiny_dir):
    """The hint travels from the request to the blocks: a finished row under a hint leaves
    its prompt's blocks held for the time asked."""
    import time

    from mlxgw.shared.protocol import GenerateRequest, SamplingParams
    from mlxgw.worker.schedule.scheduler import Scheduler

    runner = _runner(tiny_dir, 256 << 20)
    sched = Scheduler(runner, max_num_seqs=2, max_queue=4)
    prompt = list(range(10, 10 + 3 * 32 + 5))
    sched.submit(
        GenerateRequest(
            rid="kept",
            prompt_tokens=prompt,
            max_tokens=2,
            sampling=SamplingParams(temperature=0),
            cache_retention_s=600,
        )
    )
    while sched.has_work():
        sched.step()
    node, _ = runner.prefix_cache.tree.walk(prompt)
    held = [b.held_until - time.time() for b in node.chain()]
    assert len(held) == 3 and all(500 < h <= 600 for h in held), held
