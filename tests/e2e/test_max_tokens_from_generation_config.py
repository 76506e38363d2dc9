"""max_tokens for a client that sends none: the model's own
generation_config.json (`max_new_tokens`) where its authors set one, overridable per model
(`defaults.max_tokens`) and server-wide (`--max-tokens-default`); else 4096
(tests/e2e/test_openai_api.py covers that fallback and the per-model default)."""

from __future__ import annotations

import json

import pytest
from helpers import openai_client
from helpers.gateway import start_gateway

MESSAGES = [{"role": "user", "content": "Go on forever."}]


@pytest.fixture(scope="module")
def genconfig_gateway(home, tmp_path_factory):
    folder = tmp_path_factory.mktemp("model-with-generation-config")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 11, "eos_token_id": 2}))
    config = {
        "manager": {"auto_discover": False},
        "models": [
            {"name": "authored", "engine": "null", "source": str(folder), "preload": True},
            {"name": "overridden", "engine": "null", "source": str(folder), "defaults": {"max_tokens": 5}},
        ],
    }
    gw = start_gateway(home, config, "genconfig-gateway")
    yield gw
    gw.stop()


def test_without_max_tokens_the_models_generation_config_bounds_the_answer(genconfig_gateway):
    out = openai_client(genconfig_gateway).chat.completions.create(model="authored", messages=MESSAGES)
    assert out.usage.completion_tokens == 11 and out.choices[0].finish_reason == "length"


def test_a_models_entry_default_overrides_its_generation_config(genconfig_gateway):
    out = openai_client(genconfig_gateway).chat.completions.create(model="overridden", messages=MESSAGES)
    assert out.usage.completion_tokens == 5


def test_a_clients_max_tokens_overrides_both(genconfig_gateway):
    out = openai_client(genconfig_gateway).chat.completions.create(model="authored", messages=MESSAGES, max_tokens=3)
    assert out.usage.completion_tokens == 3
