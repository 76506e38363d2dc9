"""models.yaml: the gateway: section, flags over it, one suffix for seconds, Literal types,
and range checks that name the file, the model and the field."""

from __future__ import annotations

import dataclasses
import logging

import click
import pytest
import yaml

from mlxgw.gateway.cli.config_flags import with_flags
from mlxgw.gateway.cli.serve import up
from mlxgw.gateway.web.state import GatewaySettings
from mlxgw.shared.config import ConfigError, load_registry, parse_registry
from mlxgw.shared.gateway_config import GatewayConfig
from mlxgw.shared.resources import default_config


def write(tmp_path, data: dict):
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("manager", "heartbeat_s", 0),
        ("manager", "liveness", 0),
        ("manager", "max_loaded_models", 0),
        ("manager", "memory_budget", "-50%"),
        ("manager", "load_timeout_s", -1),
        ("manager", "restart_backoff_s", 0),
        ("gateway", "max_body_bytes", -1),
        ("gateway", "port", 70000),
        ("gateway", "request_timeout_s", 0),
        ("gateway", "max_connections", 0),
    ],
)
def test_out_of_range_settings_are_refused_naming_file_section_and_field(tmp_path, section, field, value):
    path = write(tmp_path, {section: {field: value}, "models": []})
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    message = str(info.value)
    assert str(path) in message and section in message and repr(field) in message


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_num_seqs", 0), ("context_length", 8), ("idle_unload_s", -5), ("kind", "video"), ("engine", "gguf")],
)
def test_out_of_range_model_fields_are_refused_naming_the_model(tmp_path, field, value):
    path = write(tmp_path, {"models": [{"name": "m1", field: value}]})
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    message = str(info.value)
    assert str(path) in message and "(m1)" in message and repr(field) in message


def test_policy_fields_accept_only_their_listed_values():
    with pytest.raises(ConfigError, match="wait, fail"):
        parse_registry({"manager": {"contention": "maybe"}})
    with pytest.raises(ConfigError, match="clamp, reject"):
        parse_registry({"models": [{"name": "m", "max_tokens_policy": "truncate"}]})
    with pytest.raises(ConfigError, match="text, json"):
        parse_registry({"gateway": {"log_format": "xml"}})


def test_old_seconds_spellings_are_accepted_with_a_deprecation_note(caplog):
    with caplog.at_level(logging.WARNING, "mlxgw.shared"):
        reg = parse_registry(
            {
                "manager": {"wait_timeout_seconds": 7, "request_timeout_seconds": 9, "max_body_bytes": 1000},
                "models": [{"name": "m", "idle_unload_seconds": 3}],
            }
        )
    assert reg.manager.wait_timeout_s == 7 and reg.models[0].idle_unload_s == 3
    assert reg.gateway.request_timeout_s == 9 and reg.gateway.max_body_bytes == 1000
    assert "deprecated" in caplog.text and "wait_timeout_s" in caplog.text


def test_a_field_set_under_both_spellings_is_an_error():
    with pytest.raises(ConfigError, match="old spelling"):
        parse_registry({"manager": {"wait_timeout_seconds": 7, "wait_timeout_s": 8}})


def test_the_gateway_section_sets_the_http_settings_and_flags_override_it():
    reg = parse_registry(
        {
            "gateway": {
                "host": "127.0.0.2",
                "port": 9000,
                "request_timeout_s": 50,
                "max_body_bytes": 2048,
                "max_connections": 10,
                "cors_origins": ["http://a"],
                "max_tokens_cap": 100,
                "max_tokens_default": 20,
                "max_image_mb": 2,
                "allow_image_urls": True,
                "log_format": "json",
            }
        }
    )
    flags = up.make_context("up", ["--port", "9100", "--cors-origins", "http://b, http://c"]).params
    gw = with_flags(reg.gateway, flags)
    assert (gw.host, gw.port, gw.cors_origins) == ("127.0.0.2", 9100, ["http://b", "http://c"])
    settings = GatewaySettings.from_config(gw)
    assert settings.request_timeout_s == 50 and settings.max_body_bytes == 2048 and settings.max_connections == 10
    assert settings.max_tokens_cap == 100 and settings.max_tokens_default == 20 and settings.log_format == "json"
    assert settings.images.max_bytes == 2 << 20 and settings.images.allow_urls is True


def test_every_flagged_gateway_field_is_an_up_flag_with_help_that_names_its_key():
    options = {p.name: p for p in up.params}
    flagged = [f for f in dataclasses.fields(GatewayConfig) if f.metadata["flag"]]
    # the 15 flags `mlxgw up` had before they were generated, --default-cache-group, and sign-in's
    # --oidc-issuer, --oidc-client-id, --public-url
    assert len(flagged) == 19
    for f in flagged:
        option = options[f.name]
        assert f.metadata["flag"] in option.opts and f"[gateway.{f.name}" in option.help
    assert all(p.help for p in up.params if isinstance(p, click.Option))


@pytest.mark.parametrize(
    ("args", "field", "value"),
    [
        (["--host", "0.0.0.0"], "host", "0.0.0.0"),
        (["--timeout", "12"], "request_timeout_s", 12.0),
        (["--prefill-timeout", "34"], "prefill_timeout_s", 34.0),
        (["--log-format", "json"], "log_format", "json"),
        (["--no-log-prompts"], "log_prompts", False),
        (["--log-prompts"], "log_prompts", True),
        (["--max-tokens-cap", "64"], "max_tokens_cap", 64),
        (["--max-connections", "3"], "max_connections", 3),
        (["--header-timeout", "0.5"], "header_timeout_s", 0.5),
        (["--allow-image-urls"], "allow_image_urls", True),
        (["--max-image-mb", "1.5"], "max_image_mb", 1.5),
    ],
)
def test_each_up_flag_overrides_its_gateway_key(args, field, value):
    base = parse_registry({"gateway": {"log_prompts": True, "host": "127.0.0.3"}}).gateway
    gw = with_flags(base, up.make_context("up", args).params)
    assert getattr(gw, field) == value
    assert with_flags(base, up.make_context("up", []).params) == base  # no flag: the file's values


def test_up_flags_refuse_values_outside_their_range():
    for args in (["--max-connections", "0"], ["--idle-timeout", "0"], ["--log-format", "xml"]):
        with pytest.raises(click.BadParameter):
            up.make_context("up", args)


def test_runtime_settings_extend_the_gateway_section_without_restating_it():
    declared = {f.name for f in dataclasses.fields(GatewayConfig)}
    runtime = {f.name for f in dataclasses.fields(GatewaySettings)} - declared
    assert runtime == {"write_timeout_s", "keepalive_s", "keys_path", "metrics_token"}
    assert GatewaySettings().request_timeout_s == GatewayConfig().request_timeout_s


def test_the_shipped_configs_load_without_deprecation_notes(caplog):
    from mlxgw.shared.resources import shipped_file

    with caplog.at_level(logging.WARNING, "mlxgw.shared"):
        load_registry(default_config())
        load_registry(shipped_file("config", "models.example.yaml"))
        assert load_registry(shipped_file("config", "agents.yaml")).models[0].chat.tool_name_guard
    assert "deprecated" not in caplog.text


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"kv_bits": 4}, "field 'kv_bits' moved: write `cache: {kv_bits: 4}`"),
        ({"cache_memory_mb": 64}, "field 'cache_memory_mb' moved: write `cache: {prefix_memory_mb: 64}`"),
        ({"tool_parser": "hermes"}, "field 'tool_parser' moved: write `chat: {tool_parser: 'hermes'}`"),
        ({"truncate": True, "kind": "embedding"}, "field 'truncate' moved: write `encoder: {truncate: True}`"),
        ({"kv_bits": 8, "cache": {"kv_bits": 4}}, "field 'kv_bits' moved: write `cache: {kv_bits: 8}`"),
    ],
)
def test_a_flat_key_from_before_the_sections_is_refused_naming_its_section(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_registry({"models": [{"name": "m1", **raw}]})
    assert "(m1)" in str(info.value) and message in str(info.value)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"cache": {"kv_bits": 5}}, "kv_bits"),
        ({"cache": {"prefix_memory_mb": 0}}, "prefix_memory_mb"),
        ({"encoder": {"max_batch_tokens": 100}}, "max_batch_tokens"),
        ({"chat": {"tool_parsr": "x"}}, "tool_parsr"),
        ({"fim": {"max_tokens": 0}}, "fim.max_tokens"),
        ({"fim": {"kv_shift_min_tokens": -1}}, "fim.kv_shift_min_tokens"),
    ],
)
def test_a_bad_section_field_is_refused_naming_the_model_and_the_field(raw, field):
    with pytest.raises(ConfigError) as info:
        parse_registry({"models": [{"name": "m1", **raw}]})
    assert "(m1)" in str(info.value) and repr(field) in str(info.value)


def test_an_entry_reaches_its_worker_whole():
    from dataclasses import asdict

    from mlxgw.shared.model_sections import ModelEntry
    from mlxgw.shared.schema import from_mapping

    raw = {"name": "m", "cache": {"kv_bits": 4}, "chat": {"system": "be brief"}}
    entry = parse_registry({"models": [raw]}).models[0]
    assert from_mapping(ModelEntry, asdict(entry), "worker m") == entry  # gateway/models/rank_group.py's --entry
