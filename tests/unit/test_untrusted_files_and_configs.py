"""Untrusted files and settings, in process: the PDF reader's own budget, the registry's refusals, folder import
and hub discovery of files that reach outside their folder."""

from __future__ import annotations

import os

import pytest
from helpers.pdf import pdf_bomb, pdf_with_text


def test_the_pdf_reader_keeps_its_operator_budget_in_process(monkeypatch):
    """The operator budget is the parser's own: it stops mid-document, not at the deadline."""
    from mlxgw.gateway.pipeline import pdf_job

    assert pdf_job.pdf_text(pdf_with_text("hello budget")) == "hello budget"
    monkeypatch.setattr(pdf_job, "MAX_OPERATORS", 1000)
    with pytest.raises(pdf_job.OverBudget, match="drawing operators"):
        pdf_job.pdf_text(pdf_bomb(pages=3, operators=2000))
    monkeypatch.setattr(pdf_job, "MAX_CONTENT_BYTES", 10_000)
    with pytest.raises(pdf_job.OverBudget, match="MB of content"):
        pdf_job.pdf_text(pdf_bomb(pages=3, operators=2000))


BAD_CONFIGS = [
    ({"defaults": {"temperature": 5}}, "temperature"),
    ({"defaults": {"top_p": 3}}, "top_p"),
    ({"defaults": {"max_tokens": -4}}, "max_tokens"),
    ({"aliases": [""]}, "aliases"),
    ({"source": "../../../../etc"}, "source"),
]


@pytest.mark.parametrize("extra,field", BAD_CONFIGS, ids=[c[1] for c in BAD_CONFIGS])
def test_config_refuses_values_no_request_could_send(extra, field):
    from mlxgw.shared.config import ConfigError, parse_registry

    with pytest.raises(ConfigError, match=field):
        parse_registry({"models": [{"name": "m", "engine": "null", **extra}]})


def test_config_refuses_a_negative_usage_retention():
    from mlxgw.shared.config import ConfigError, parse_registry

    with pytest.raises(ConfigError, match="usage_retention_days"):
        parse_registry({"manager": {"usage_retention_days": -1}, "models": []})


def test_folder_import_refuses_a_hard_link(tmp_path):
    """On main a root-prepared folder with a hard link to /etc/shadow imported it, mode 644."""
    from mlxgw.worker.importers.folder_import import safe_manifest
    from mlxgw.worker.importers.gguf.importer import ImportError_

    outside = tmp_path / "secret"
    outside.write_text("root:x:0:0")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    os.link(outside, folder / "tokenizer.json")
    with pytest.raises(ImportError_, match="hard-linked"):
        safe_manifest(folder)


def test_hub_discovery_does_not_list_a_snapshot_linking_outside_the_hub_cache(tmp_path):
    from mlxgw.shared.discovery import discover

    outside = tmp_path / "shadow"
    outside.write_text("secret")
    snapshot = tmp_path / "hub" / "models--org--evil" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (snapshot / "model.safetensors").symlink_to(outside)
    (found,) = discover([tmp_path / "hub"])
    assert found.error is not None and "outside" in found.error, found
