"""The image kind's pure parts: its config entry, its wire request and finish, the Images API's
size rule, and admission by the weights of a Diffusers-layout folder."""

from __future__ import annotations

import msgpack
import pytest

from mlxgw.gateway.api.openai.image_fields import parse_size
from mlxgw.gateway.models.residency import _weights_bytes
from mlxgw.shared import protocol as p
from mlxgw.shared.config import parse_registry
from mlxgw.shared.errors import ServiceError
from mlxgw.shared.events import Finish, FinishReason, Usage, event_from_wire
from mlxgw.shared.model_sections import ModelKind
from mlxgw.shared.schema import ConfigError


def test_an_image_entry_is_its_own_kind_on_the_mlx_engine():
    registry = parse_registry({"models": [{"name": "z", "kind": "image"}]})
    assert registry.models[0].kind == ModelKind.IMAGE
    with pytest.raises(ConfigError, match="default engine"):
        parse_registry({"models": [{"name": "z", "kind": "image", "engine": "echo"}]})


def test_an_image_request_and_its_pngs_cross_the_wire():
    req = p.ImageRequest(rid="r", prompt="a cat", n=2, width=64, height=48, seed=7, image=b"\x89PNG", mask=None)
    wire = msgpack.unpackb(msgpack.packb(req.to_wire()))
    assert p.ImageRequest.from_wire(wire) == req
    done = Finish(FinishReason.STOP, Usage(prompt_tokens=5), images=[b"one", b"two"])
    assert event_from_wire(msgpack.unpackb(msgpack.packb(done.to_wire()))) == done


def test_sizes_are_multiples_of_16_within_bounds():
    assert parse_size("64x48") == (64, 48)
    assert parse_size("auto") is None and parse_size(None) is None
    for bad in ("100x100", "0x16", "4096x16", "64", "axb"):
        with pytest.raises(ServiceError):
            parse_size(bad)


def test_a_diffusers_layout_is_admitted_by_its_parts_weights(tmp_path):
    for part, size in (("transformer", 3000), ("text_encoder", 2000), ("vae", 1000)):
        (tmp_path / part).mkdir()
        (tmp_path / part / "model.safetensors").write_bytes(b"\0" * size)
    assert _weights_bytes(tmp_path) == 6000
