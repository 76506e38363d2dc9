"""Speculative decoding with a draft model (worker/model/speculation/draft_model.py): greedy outputs are
token-identical to plain decoding whatever the draft proposes, the target as its own draft
has every draft accepted, and a draft that cannot serve the target is refused at load."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import openai_client, wait_for
from helpers.runner_jobs import generate_together, speculative_runner

from mlxgw.shared.config import ConfigError, parse_registry
from mlxgw.shared.model_sections import SpeculativeConfig
from mlxgw.worker.model.runners.mlx_runner import MLXRunner
from mlxgw.worker.model.speculation.draft_model import DraftModelDrafter
from mlxgw.worker.model.speculation.speculative import DraftRequest

COPY_TEXT = "def add(a, b):\n    return a + b\n\n" * 4


def _draft(path: Path, max_draft: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(mode="draft", draft_model=str(path), max_draft=max_draft)


@pytest.fixture(scope="module")
def other_draft_dir(home, smollm2_dir) -> Path:
    """A second tiny model: same tokenizer, other random weights (its drafts mostly miss)."""
    from tiny_model import build_tiny_model

    return build_tiny_model(home / "models" / "tiny-draft-seed1", smollm2_dir, seed=1)


@pytest.fixture(scope="module")
def runners(tiny_dir, other_draft_dir) -> dict[str, MLXRunner]:
    return {
        "off": speculative_runner(tiny_dir, SpeculativeConfig(mode="off")),
        "self": speculative_runner(tiny_dir, _draft(tiny_dir)),
        "other": speculative_runner(tiny_dir, _draft(other_draft_dir)),
    }


def _jobs(runner: MLXRunner) -> list[tuple[list[int], int]]:
    return [
        (runner.encode_text("Copy this code:\n" + COPY_TEXT), 29),
        (runner.encode_text("one two three one two"), 17),
        (runner.encode_text("Hello"), 23),
    ]


@pytest.mark.parametrize("draft", ["self", "other"])
def test_a_greedy_request_is_token_identical_with_a_draft_model(runners, draft):
    job = _jobs(runners["off"])[:1]
    assert generate_together(runners[draft], job) == generate_together(runners["off"], job)


@pytest.mark.parametrize("draft", ["self", "other"])
def test_a_batch_of_greedy_requests_is_token_identical_with_a_draft_model(runners, draft):
    jobs = _jobs(runners["off"])
    assert generate_together(runners[draft], jobs) == generate_together(runners["off"], jobs)


def test_the_target_as_its_own_draft_has_its_drafts_accepted(tiny_dir):
    runner = speculative_runner(tiny_dir, _draft(tiny_dir))
    generate_together(runner, _jobs(runner))
    stats = runner.stats()["speculative"]
    assert stats["mode"] == "draft" and stats["draft_model"] == str(tiny_dir)
    assert stats["drafted_tokens"] > 0 and stats["acceptance_rate"] >= 0.95, stats


def test_after_a_rejection_the_draft_continues_as_if_fed_from_scratch(other_draft_dir):
    from mlx_lm import load

    model, _ = load(str(other_draft_dir))
    context = list(range(100, 140))
    drafter = DraftModelDrafter(model, vocab_limit=1 << 20)
    first = drafter.propose([DraftRequest(1, context, 5)])[0]
    # The target kept one drafted token, then chose another than the draft's second.
    rejected = (first[1] + 1) % 1000
    later = context + first[:1] + [rejected, 7, 8]
    assert drafter.propose([DraftRequest(1, later, 4)]) == DraftModelDrafter(model, 1 << 20).propose(
        [DraftRequest(2, later, 4)]
    )
    assert drafter.rows[1].cache[0].offset == len(later) + 3  # the context and all but the last draft


def test_rows_drafted_together_draft_what_each_drafts_alone(other_draft_dir):
    from mlx_lm import load

    model, _ = load(str(other_draft_dir))
    contexts = {1: list(range(100, 140)), 2: list(range(300, 310)), 3: list(range(500, 570))}
    ks = {1: 5, 2: 2, 3: 4}

    def alone(uid: int, context: list[int]) -> list[int]:
        return DraftModelDrafter(model, 1 << 20).propose([DraftRequest(uid, context, ks[uid])])[0]

    together = DraftModelDrafter(model, 1 << 20)
    first = together.propose([DraftRequest(uid, c, ks[uid]) for uid, c in contexts.items()])
    assert first == [alone(uid, c) for uid, c in contexts.items()]
    # Then each row's split cache continues after a rejection (row 2 was fed less: k=2).
    later = {uid: c + d[:1] + [(d[-1] + 1) % 1000] for (uid, c), d in zip(contexts.items(), first)}
    second = together.propose([DraftRequest(uid, c, ks[uid]) for uid, c in later.items()])
    assert second == [alone(uid, c) for uid, c in later.items()]


def test_a_finished_rows_draft_cache_is_freed(runners):
    runner = runners["self"]
    generate_together(runner, _jobs(runner)[:2])
    generate_together(runner, [(runner.encode_text("Hi"), 4)])
    assert len(runner.speculator.drafter.rows) <= 1


def test_a_draft_model_from_models_yaml_serves_the_same_greedy_text_and_reports_its_mode(tiny_gateway):
    client = openai_client(tiny_gateway)
    messages = [{"role": "user", "content": "Copy this code:\n" + COPY_TEXT}]

    def ask(model: str) -> str:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
        return reply.choices[0].message.content

    assert ask("tiny-drafted") == ask("tiny")

    def speculative() -> dict:  # the stats arrive with the worker's heartbeats
        workers = tiny_gateway.model_status("tiny-drafted")["workers"]
        return (workers[0]["stats"].get("speculative") if workers else None) or {}

    wait_for(lambda: (speculative().get("accepted_tokens") or 0) > 0, 15)
    assert speculative()["mode"] == "draft" and speculative()["draft_model"] == "tiny"


def _shrink_vocabulary(source: Path, dest: Path, size: int) -> Path:
    """A copy of a tiny model whose embedding (tied output) covers only `size` tokens."""
    import shutil

    shutil.copytree(source, dest, dirs_exist_ok=True)
    weights = mx.load(str(dest / "model.safetensors"))
    weights = {k: (v[:size] if k.endswith("embed_tokens.weight") else v) for k, v in weights.items()}
    mx.save_safetensors(str(dest / "model.safetensors"), weights)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(dict(config, vocab_size=size)))
    return dest


def test_a_draft_with_another_vocabulary_is_refused_at_load(home, tiny_dir):
    small = _shrink_vocabulary(tiny_dir, home / "models" / "tiny-draft-small-vocab", 1000)
    with pytest.raises(ConfigError, match="vocabulary of 1000 tokens"):
        speculative_runner(tiny_dir, _draft(small))


def test_a_draft_model_named_by_its_models_dir_folder_is_found(tiny_dir, other_draft_dir):
    runner = speculative_runner(tiny_dir, _draft(Path(other_draft_dir.name)))
    assert runner.speculator.enabled and runner.speculator.drafter.vocab_limit == runner.vocab_size


def test_a_missing_draft_model_is_refused_at_load(home, tiny_dir):
    with pytest.raises(ConfigError, match="no model at"):
        speculative_runner(tiny_dir, _draft(home / "models" / "no-such-draft"))


def test_a_draft_model_is_configured_per_model():
    reg = parse_registry({"models": [{"name": "a", "speculative": {"mode": "draft", "draft_model": "small"}}]})
    spec = reg.models[0].speculative
    assert spec.mode == "draft" and spec.draft_model_path(Path("/m")) == Path("/m/small")
    assert spec.draft_model_path(Path("/m")) != SpeculativeConfig(draft_model="/abs/small").draft_model_path(Path("/m"))


def test_mode_draft_without_a_draft_model_is_a_config_error():
    with pytest.raises(ConfigError, match="draft_model"):
        parse_registry({"models": [{"name": "a", "speculative": {"mode": "draft"}}]})


def test_a_draft_model_without_mode_draft_is_a_config_error():
    with pytest.raises(ConfigError, match="mode: draft"):
        parse_registry({"models": [{"name": "a", "speculative": {"draft_model": "small"}}]})
