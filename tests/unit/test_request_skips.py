"""What a plain request does not pay for (the gateway's CPU per request: bench/overhead/
capacity.py): a text-only chat that sets max_tokens is built without looking for media parts
and without reading the model's folder. The calls are watched with a profile hook around the
real build_request; a request with a content list and no max_tokens shows that the hook sees
the same functions when they do run."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from mlxgw.gateway.pipeline.fields import ChatFields
from mlxgw.gateway.pipeline.translate import ParsedRequest, build_request
from mlxgw.gateway.web.state import CACHE_SECRET, MANAGER, SETTINGS, GatewaySettings
from mlxgw.shared.model_sections import ModelEntry

# request["rid"]: the gateway's own str key, as its middleware sets it
pytestmark = pytest.mark.filterwarnings("ignore::aiohttp.web_exceptions.NotAppKeyWarning")
SKIPPED = {"collect_images", "collect_videos", "collect_audio", "media_parts", "model_max_new_tokens"}


def called_while_building(tmp_path, parsed: ParsedRequest) -> set[str]:
    app = web.Application()
    app[SETTINGS] = GatewaySettings()
    app[MANAGER] = SimpleNamespace(registry=SimpleNamespace(models_dir=tmp_path))
    app[CACHE_SECRET] = b"s" * 32
    request = make_mocked_request("POST", "/v1/chat/completions", app=app)
    request["rid"] = "r1"
    slot = SimpleNamespace(entry=ModelEntry(name="m"), decode_tokens_per_s=None)
    seen: set[str] = set()

    def hook(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_name)

    async def build():
        sys.setprofile(hook)
        try:
            return await build_request(request, slot, parsed)
        finally:
            sys.setprofile(None)

    req = asyncio.run(build())
    assert req.messages == parsed.messages and req.max_tokens
    return seen


def fields() -> ChatFields:
    return msgspec.convert({"model": "m"}, ChatFields)


def test_a_text_chat_with_max_tokens_looks_for_no_media_and_reads_no_model_folder(tmp_path):
    parsed = ParsedRequest(sampling=fields(), messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert not called_while_building(tmp_path, parsed) & SKIPPED


def test_content_parts_and_no_max_tokens_still_take_both_paths(tmp_path):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    parsed = ParsedRequest(sampling=fields(), messages=messages)
    assert called_while_building(tmp_path, parsed) >= SKIPPED
