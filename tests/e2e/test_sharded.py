"""Sharded models: one model over two local ranks on MLX's distributed layer (ring
backend over 127.0.0.1), served through `mlxgw up` like any other model.

A tiny random-weight qwen2 runs pipeline-parallel (llama has no pipeline in mlx-lm) and the
tiny llama (4 heads, 2 KV heads) tensor-parallel; each is compared with the same weights in
one process."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest
from helpers import NO_EOS, openai_client, start_gateway, wait_for
from helpers.http import http

from mlxgw.shared.config import ConfigError, parse_registry

PROMPTS = ["Tell me about the sea.", "List three colours.", "What is two plus two?"]
MAX_TOKENS = 10

QWEN2 = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 64, "rope_theta": 1000000.0}


def pipeline(**extra) -> dict:
    return {"strategy": "pipeline", "ranks": 2, **extra}


def tensor(**extra) -> dict:
    return {"strategy": "tensor", "ranks": 2, **extra}


@pytest.fixture(scope="module")
def qwen_dir(home, smollm2_dir) -> Path:
    from tiny_model import build_tiny_model

    return build_tiny_model(home / "models" / "tiny-qwen2", smollm2_dir, overrides=QWEN2)


@pytest.fixture(scope="module")
def gw(home, qwen_dir, tiny_dir):
    config = {
        "manager": {"auto_discover": False, "max_loaded_models": 8, "restart_backoff_s": 0.1},
        "models": [
            # preloaded: the gateway loads them side by side while it starts (where cores allow)
            {"name": "qwen-one", "source": "tiny-qwen2", "preload": True},
            {"name": "qwen-pipe", "source": "tiny-qwen2", "distributed": pipeline(), "preload": True},
            {"name": "tiny-one", "source": "tiny", "preload": True},
            {"name": "tiny-tensor", "source": "tiny", "distributed": tensor(), "preload": True},
            {"name": "tiny-pipe", "source": "tiny", "distributed": pipeline()},
        ],
    }
    gateway = start_gateway(home, config, "sharded-gateway")
    yield gateway
    gateway.stop()


def complete(gw, model: str, prompt: str, stream: bool) -> str:
    kwargs = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0)
    client = openai_client(gw, timeout=120)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def answers(gw, model: str) -> list[str]:
    """Every prompt twice, streaming and not, all at once (one batch on the worker)."""
    jobs = [(p, s) for p in PROMPTS for s in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: complete(gw, model, *job), jobs))


def rank_processes(gw, model: str) -> list[psutil.Process]:
    found = []
    for pid in gw.descendants():
        try:
            proc = psutil.Process(pid)
            if model in proc.cmdline() and "MLX_RANK" in proc.environ():
                found.append(proc)
        except psutil.Error:
            continue
    return found


def rank_of(proc: psutil.Process) -> int:
    return int(proc.environ()["MLX_RANK"])


def test_pipeline_outputs_are_token_identical_to_one_process(gw):
    sharded = answers(gw, "qwen-pipe")
    assert sharded == answers(gw, "qwen-one")
    assert all(sharded)


def test_tensor_outputs_are_token_identical_to_one_process(gw):
    sharded = answers(gw, "tiny-tensor")
    assert sharded == answers(gw, "tiny-one")
    assert all(sharded)


def test_constrained_output_is_identical_to_one_process(gw):
    """A grammar masks logits on rank 0 only: the other ranks take rank 0's tokens."""

    def ask(model: str) -> str:
        return (
            openai_client(gw, timeout=120)
            .chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Give me a JSON object."}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                response_format={"type": "json_object"},
            )
            .choices[0]
            .message.content
        )

    sharded = ask("qwen-pipe")
    assert sharded == ask("qwen-one")
    assert sharded.lstrip().startswith("{")


def test_a_repeated_prompt_reuses_the_prefix_cache_on_every_rank(gw):
    client = openai_client(gw, timeout=120)
    kwargs = dict(
        model="qwen-pipe",
        messages=[{"role": "user", "content": "Name a large animal that lives in the ocean."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].message.content == first.choices[0].message.content


def test_a_sharded_model_runs_as_two_local_rank_processes(gw):
    complete(gw, "qwen-pipe", PROMPTS[0], stream=False)
    assert sorted(rank_of(p) for p in rank_processes(gw, "qwen-pipe")) == [0, 1]


def test_each_rank_holds_less_than_the_whole_model(gw, qwen_dir, tiny_dir):
    """RSS of these tiny models is mostly the Python/MLX runtime (~200 MB a process), so the
    per-rank comparison is of the parameter bytes each rank holds; the gateway's memory
    budget counts the RSS of every rank."""
    for model, folder in (("qwen-pipe", qwen_dir), ("tiny-tensor", tiny_dir)):
        complete(gw, model, PROMPTS[0], stream=False)
        whole = sum(f.stat().st_size for f in folder.glob("*.safetensors"))

        def stats(model=model):
            workers = gw.model_status(model)["workers"]
            return workers and workers[0]["stats"].get("rank_param_bytes") and workers[0]["stats"]

        s = wait_for(stats, timeout=30)
        assert len(s["rank_param_bytes"]) == 2
        assert all(0 < b < whole for b in s["rank_param_bytes"]), (model, s["rank_param_bytes"], whole)
        assert len(s["rank_rss_bytes"]) == 2
        assert s["rss_bytes"] == sum(s["rank_rss_bytes"])


def test_unloading_a_sharded_model_ends_every_rank(gw):
    complete(gw, "tiny-tensor", PROMPTS[0], stream=False)
    ranks = rank_processes(gw, "tiny-tensor")
    assert len(ranks) == 2
    status, _, _ = http(f"{gw.url}/v1/models/tiny-tensor/unload", "POST", {})
    assert status == 200
    assert not rank_processes(gw, "tiny-tensor")
    assert "killing them" not in gw.log()  # rank 0 drained and led the others out


def test_killing_rank_1_mid_stream_ends_the_stream_with_an_error_and_the_group_restarts(gw):
    client = openai_client(gw, timeout=120)
    stream = client.chat.completions.create(
        model="qwen-pipe",
        messages=[{"role": "user", "content": "Write a very long story."}],
        max_tokens=5000,
        stream=True,
        extra_body={"logit_bias": NO_EOS},
    )
    chunks = iter(stream)
    next(chunks)
    old = rank_processes(gw, "qwen-pipe")
    assert sorted(rank_of(p) for p in old) == [0, 1]
    leader = next(p for p in old if rank_of(p) == 0)
    next(p for p in old if rank_of(p) == 1).send_signal(signal.SIGKILL)
    with pytest.raises(openai.APIError, match="peer was lost"):
        for _ in chunks:
            pass
    wait_for(lambda: gw.worker_pid("qwen-pipe") != leader.pid, timeout=60)
    assert complete(gw, "qwen-pipe", PROMPTS[0], stream=False) == complete(gw, "qwen-one", PROMPTS[0], stream=False)
    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in old), timeout=30)
    new = rank_processes(gw, "qwen-pipe")
    assert sorted(rank_of(p) for p in new) == [0, 1]
    assert not {p.pid for p in new} & {p.pid for p in old}


def test_pipeline_on_an_architecture_without_it_is_refused_with_a_clear_error(gw):
    with pytest.raises(openai.APIStatusError) as err:
        complete(gw, "tiny-pipe", PROMPTS[0], stream=False)
    assert err.value.status_code == 503
    assert "pipeline is not available for 'llama'" in str(err.value)
    assert not rank_processes(gw, "tiny-pipe")  # refused before any rank started


def test_tensor_heads_not_divisible_by_the_ranks_are_refused(home, tiny_dir):
    from mlxgw.shared.model_sections import DistributedConfig
    from mlxgw.worker.process.distributed import ShardingError, check_support

    with pytest.raises(ShardingError, match="num_attention_heads = 4 does not divide by 3 ranks"):
        check_support(tiny_dir, DistributedConfig(strategy="tensor", ranks=3))


def test_a_backend_that_cannot_initialise_is_named_with_what_it_needs():
    from mlxgw.shared.model_sections import DistributedConfig
    from mlxgw.worker.process.distributed import ShardingError, init_group

    with pytest.raises(ShardingError, match="mpi backend could not initialise.*backend: ring"):
        init_group(DistributedConfig(backend="mpi"))


@pytest.mark.parametrize(
    "distributed, message",
    [
        ({"ranks": 1}, "must be between 2 and 16"),
        ({"strategy": "data"}, "must be one of pipeline, tensor"),
        ({"backend": "nccl"}, "must be one of ring, jaccl, mpi"),
        ({"ranks": 2, "hosts": ["10.0.0.1:5000"]}, "needs one host:port per rank"),
        ({"ranks": 2, "hosts": ["10.0.0.1", "10.0.0.2:5000"]}, "expected host:port"),
        ({"ranks": 2, "hosts": ["10.0.0.1:5000", "10.0.0.2:5000"]}, "max_num_seqs.*other hosts"),
    ],
)
def test_a_bad_distributed_section_is_a_config_error(distributed, message):
    with pytest.raises(ConfigError, match=message):
        parse_registry({"models": [{"name": "m", "distributed": distributed}]})
