"""Block files changed under a running worker's disk tier, and a full disk.

The worker has indexed its block files; then a file is torn (cut short), overwritten with
garbage behind its own valid header, replaced by a block of other shapes or dtype (its
digest recomputed, as a forger would), by a block written for another model, or by a
symlink to a copy elsewhere. Each is skipped with a log line and deleted, and the prompt is
computed again: the same greedy answer as with no cache, the same worker. A disk that fills
up (a 96 KB tmpfs under the model's store; root only) stops the writes with one line, and
serving and the worker's stop go on. Real `mlxgw up`, real workers, the tiny model."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import NO_EOS, http, openai_client, start_gateway

from mlxgw.worker.model.cache import block_file as bf

CASES = ("dtype", "torn", "garbage", "shapes", "foreign", "symlink")


def _ask(gw, model: str, content: str) -> tuple[str, int]:
    r = openai_client(gw).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        temperature=0,
        extra_body={"logit_bias": NO_EOS},
    )
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def _unload(gw, model: str) -> None:
    status, _, body = http(f"{gw.url}/v1/models/{model}/unload", "POST", {})
    assert status == 200 and body["loaded"] is False, body


def _files(home: Path, model: str) -> set[Path]:
    folder = home / "prefix-cache" / model / "blocks"
    return set(folder.glob("*.safetensors")) if folder.is_dir() else set()


def _heads(files: set[Path], cases, tokenizer) -> dict[str, Path]:
    """Each case's first block file of its own: the first of its prompt's chain of blocks
    (named by the text the chain decodes to) that no other prompt's chain holds (the
    template's blocks are every prompt's). One stop writes every prompt's blocks at once."""
    metas = {f: mx.load(str(f), return_metadata=True)[1] for f in files}
    by_key = {m["key"]: f for f, m in metas.items()}
    parents = {m["parent"] for m in metas.values()}
    chains: dict[str, list[Path]] = {}
    for leaf in (f for f, m in metas.items() if m["key"] not in parents):
        chain = [leaf]
        while metas[chain[-1]]["parent"] in by_key:
            chain.append(by_key[metas[chain[-1]]["parent"]])
        chain.reverse()
        text = tokenizer.decode([t for f in chain for t in json.loads(metas[f]["tokens"])])
        (case,) = [c for c in cases if f"{c}0 {c}1 {c}2" in text]
        assert case not in chains, case
        chains[case] = chain
    assert set(chains) == set(cases), (sorted(chains), cases)

    def own(f: Path, case: str) -> bool:
        return not any(f in chain for other, chain in chains.items() if other != case)

    return {case: next(f for f in chain if own(f, case)) for case, chain in chains.items()}


def _rewrite(path: Path, change) -> None:
    """The block file with its arrays changed by `change`, a digest that matches them, and
    metadata padded to the size it had (a forger's file passes every check but the layers)."""
    size = path.stat().st_size
    arrays, meta = mx.load(str(path), return_metadata=True)
    arrays = {k: change(v) for k, v in arrays.items()}
    meta["digest"] = bf.digest(arrays)
    path.unlink()
    assert "." in meta["used_at"]
    for pad in range(size):  # trailing zeros: the same number
        mx.save_safetensors(str(path), arrays, {**meta, "used_at": meta["used_at"] + "0" * pad})
        if path.stat().st_size >= size:
            break
    assert path.stat().st_size == size


def _tamper(case: str, head: Path, elsewhere: Path, foreign: Path) -> None:
    data = head.read_bytes()
    if case == "torn":
        head.write_bytes(data[: len(data) * 2 // 3])
    elif case == "garbage":  # its header as written, other bytes behind it
        header = 8 + struct.unpack("<Q", data[:8])[0]
        head.write_bytes(data[:header] + bytes((i * 7 + 3) % 251 for i in range(len(data) - header)))
    elif case == "shapes":  # the same bytes as twice the heads of half the width
        _rewrite(head, lambda a: a.reshape(*a.shape[:-3], a.shape[-3] * 2, a.shape[-2], a.shape[-1] // 2))
    elif case == "dtype":
        _rewrite(head, lambda a: a.astype(mx.float16))
    elif case == "foreign":  # another model's block under this one's name
        head.write_bytes(foreign.read_bytes())
    elif case == "symlink":
        copy = elsewhere / head.name
        shutil.copy(head, copy)
        head.unlink()
        head.symlink_to(copy)


@pytest.fixture(scope="module")
def gateway(home, tiny_dir):
    shutil.copytree(tiny_dir, home / "models" / "tiny-tamper", dirs_exist_ok=True)
    shutil.rmtree(home / "prefix-cache", ignore_errors=True)
    entry = {"source": "tiny-tamper", "max_num_seqs": 2, "prefill_step_size": 256}
    config = {
        "manager": {"auto_discover": False},
        "models": [{"name": "tamper", **entry}, {"name": "tamper-other", **entry}],
    }
    gw = start_gateway(home, config, "prefix-tamper-gateway")
    yield gw
    gw.stop()


def test_tampered_block_files_are_skipped_and_the_prompt_computed_again(gateway, home, tmp_path, smollm2_tokenizer):
    gw = gateway
    prompts = {case: " ".join(f"{case}{i % 83}" for i in range(260)) for case in ("decoy", *CASES)}
    _ask(gw, "tamper-other", "another model's block")  # its blocks stand for a foreign model's
    _unload(gw, "tamper-other")
    foreign = sorted(_files(home, "tamper-other"))[0]
    answers = {}
    before = _files(home, "tamper")
    for case, prompt in prompts.items():
        answers[case], cached = _ask(gw, "tamper", prompt)
        assert cached < 64  # nothing of it was cached before (the template's blocks at most)
    _unload(gw, "tamper")  # the stop writes every prompt's blocks
    heads = _heads(_files(home, "tamper") - before, tuple(prompts), smollm2_tokenizer)
    # The next worker indexes the store and reads the decoy's blocks back (a block sharing
    # only the template would be read for another prompt): memory holds this model's layout.
    assert _ask(gw, "tamper", prompts.pop("decoy"))[1] > 700
    pid = gw.worker_pid("tamper")
    for case in CASES:
        _tamper(case, heads[case], tmp_path, foreign)
    for case, prompt in prompts.items():
        answer, cached = _ask(gw, "tamper", prompt)
        assert answer == answers[case], case  # never other tokens
        assert cached < 64, (case, cached)  # its first own block was refused: computed again
        assert not heads[case].exists() and not heads[case].is_symlink(), case
    status = gw.model_status("tamper")
    assert status["restarts"] == 0 and gw.worker_pid("tamper") == pid
    log = gw.log()
    for case in CASES:
        assert log.count(f"skipped block file {heads[case].name}") == 1, (case, log[-3000:])
    assert (tmp_path / heads["symlink"].name).exists()  # the link's target is not touched


@pytest.fixture
def full_disk(home):
    folder = home / "prefix-cache" / "full-disk"
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here (root only): {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_stops_the_writes_with_one_line_and_serving_goes_on(home, tiny_dir, full_disk):
    shutil.copytree(tiny_dir, home / "models" / "tiny-full", dirs_exist_ok=True)
    entry = {"source": "tiny-full", "max_num_seqs": 2, "prefill_step_size": 256, "cache": {"prefix_memory_mb": 1}}
    config = {"manager": {"auto_discover": False}, "models": [{"name": "full-disk", **entry}]}
    gw = start_gateway(home, config, "prefix-full-gateway")
    try:
        prompts = [" ".join(f"full{j}x{i % 83}" for i in range(400)) for j in range(6)]
        first = [_ask(gw, "full-disk", p)[0] for p in prompts]  # 1 MB of memory: blocks go to the disk
        pid = gw.worker_pid("full-disk")
        _unload(gw, "full-disk")  # the stop's writes meet the full disk too
        again = [_ask(gw, "full-disk", p)[0] for p in prompts]
        status = gw.model_status("full-disk")
        log = gw.log()
    finally:
        gw.stop()
    assert again == first
    assert status["crashes"] == 0 and status["restarts"] == 0, status
    assert pid  # served, stopped cleanly, served again
    assert "the disk is full" in log and "Traceback" not in log, log[-3000:]
    stored = json.dumps(sorted(p.name for p in full_disk.rglob("*")))
    assert "tmp-" not in stored, stored  # no temporary file left by a failed write
