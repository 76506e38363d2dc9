"""Image inputs for vision models, shared by the OpenAI, Anthropic and Responses modules.

The API parsers turn each image into a message part {"type": "image", "source": ...}
holding the decoded bytes (data: URLs, Anthropic base64 blocks) or an http(s) URL;
`collect_images` then fetches the URLs and moves every image out of the messages into the
request's `images` list, leaving {"type": "image"} where the chat template expects it.

Checked here, before a worker sees anything: media type, base64, size, count, and the
file signature. The worker decodes the pixels (a corrupt file is a 400 from there).
URLs are fetched only when the gateway was started with --allow-image-urls, with size and
time limits, never from loopback, private, link-local or other non-public addresses (the
check runs on every resolved address and on every redirect hop)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import re
import socket
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from ...shared.errors import invalid
from ..web.state import ImageLimits

MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp", "image/bmp"}
_DATA_URL = re.compile(r"^data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)$", re.S)
MAX_REDIRECTS = 3


def _sniff(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data.startswith(b"BM"):
        return "bmp"
    return None


def _checked(data: bytes, where: str, limits: ImageLimits) -> bytes:
    if not data:
        raise invalid(f"{where}: the image is empty", where)
    if len(data) > limits.max_bytes:
        raise invalid(f"{where}: the image is {len(data)} bytes; the limit is {limits.max_bytes} bytes", where)
    if _sniff(data) is None:
        raise invalid(f"{where}: the data is not a PNG, JPEG, GIF, WebP or BMP image", where)
    return data


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(re.sub(r"\s+", "", data), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}: the image data is not valid base64", where) from None


def _media_type(media_type: str, where: str) -> None:
    if media_type.lower() not in MEDIA_TYPES:
        allowed = ", ".join(sorted(MEDIA_TYPES - {"image/jpg"}))
        raise invalid(f"{where}: unsupported image type {media_type!r} (supported: {allowed})", where)


def from_base64(media_type: str, data, where: str, limits: ImageLimits) -> dict:
    """An Anthropic-style base64 image."""
    if not isinstance(data, str) or not isinstance(media_type, str):
        raise invalid(f"{where}: an image needs a media_type and base64 data", where)
    _media_type(media_type, where)
    return {"type": "image", "source": _checked(_b64(data, where), where, limits)}


def from_bare_base64(data, where: str, limits: ImageLimits, sniff: bool = True) -> dict:
    """An image as bare base64 without a media type (Ollama's `images`): the type is sniffed
    (sniff False: only decoded, for a caller that tells images from videos itself)."""
    if not isinstance(data, str) or not data:
        raise invalid(f"{where}: an image must be a non-empty base64 string", where)
    raw = _b64(data, where)
    return {"type": "image", "source": _checked(raw, where, limits) if sniff else raw}


def from_url(url, where: str, limits: ImageLimits) -> dict:
    """An image given as a URL: data: URLs always, http(s) only when fetching is enabled."""
    if not isinstance(url, str) or not url:
        raise invalid(f"{where}: the image URL must be a non-empty string", where)
    match = _DATA_URL.match(url)
    if match:
        if ";base64" not in match["params"].lower():
            raise invalid(f"{where}: data: URLs must be base64-encoded", where)
        _media_type(match["type"] or "application/octet-stream", where)
        return {"type": "image", "source": _checked(_b64(match["data"], where), where, limits)}
    if url.lower().startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise invalid(
                f"{where}: image URLs are not fetched by this server; send the image inline as a data: URL", where
            )
        return {"type": "image", "source": url}
    raise invalid(
        f"{where}: the image must be a data: URL" + (" or an http(s) URL" if limits.allow_urls else ""), where
    )


def from_openai_part(part: dict, where: str, limits: ImageLimits | None, param: str) -> dict:
    """An OpenAI image part (`image_url` in Chat Completions, `input_image` in Responses):
    its URL is a string or {"url": ...}; `limits` is None for models that take no images."""
    if limits is None:
        raise invalid("this model does not accept images; use a vision model", param)
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if url is None and part.get("file_id"):
        raise invalid(f"{where}: images by file_id are not supported; send a data: URL", param)
    return from_url(url, where, limits)


def media_parts(messages: list[dict], kind: str) -> list[dict]:
    """Every part of `kind` ("image", "video", "audio") in the messages, in order."""
    return [
        part
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == kind
    ]


def with_placeholders(messages: list[dict], kind: str) -> list[dict]:
    """The messages with each `kind` part reduced to its placeholder (the media travel beside
    them); the input messages are not modified."""
    stripped = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [{"type": kind} if p.get("type") == kind else p for p in content]}
        stripped.append(m)
    return stripped


async def collect_images(messages: list[dict], limits: ImageLimits | None) -> tuple[list[dict], list[bytes] | None]:
    """The messages as the worker takes them, and the images in order (None: no images).
    The input messages are not modified (the Responses store keeps them, images included)."""
    sources = [part.get("source") for part in media_parts(messages, "image")]
    if not sources or limits is None:
        return messages, None
    if len(sources) > limits.max_images:
        raise invalid(f"the request has {len(sources)} images; the limit is {limits.max_images}", "messages")
    fetched = await asyncio.gather(*(_fetch(s, limits) for s in sources if isinstance(s, str)))
    urls = iter(fetched)
    images = [next(urls) if isinstance(s, str) else s for s in sources]
    return with_placeholders(messages, "image"), images


# -- fetching (only with --allow-image-urls) ---------------------------------------------------


def _public(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return addr.is_global and not addr.is_multicast


class PublicOnlyResolver(AbstractResolver):
    """Resolves like the default resolver, but refuses a name if any of its addresses is not
    public, so a DNS answer cannot point the gateway at its own network."""

    def __init__(self) -> None:
        self._inner = DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        results: list[ResolveResult] = await self._inner.resolve(host, port, family)
        if not results or any(not _public(r["host"]) for r in results):
            raise OSError(f"{host} resolves to a non-public address")
        return results

    async def close(self) -> None:
        await self._inner.close()


def _check_target(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise invalid(f"image URL {url!r}: only http(s) URLs with a host are fetched", "messages")
    try:
        literal = ipaddress.ip_address(parts.hostname)
    except ValueError:
        if parts.hostname.lower() in ("localhost",) or parts.hostname.lower().endswith(".localhost"):
            raise invalid(f"image URL {url!r}: loopback addresses are not fetched", "messages") from None
        return  # a name: checked by the resolver at connect time
    if not _public(str(literal)):
        raise invalid(f"image URL {url!r}: non-public addresses are not fetched", "messages")


async def _fetch(url: str, limits: ImageLimits, check=None, max_bytes: int | None = None) -> bytes:
    """The body at a public URL; `check` (default: the image checks) and `max_bytes` (default:
    the image limit) let video parts (video.py) share the fetching and its guards."""
    max_bytes = max_bytes or limits.max_bytes
    timeout = aiohttp.ClientTimeout(total=limits.fetch_timeout_s)
    connector = aiohttp.TCPConnector(resolver=PublicOnlyResolver(), limit=4)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for _ in range(MAX_REDIRECTS + 1):
                _check_target(url)  # IP literals never reach the resolver: check every hop
                async with session.get(url, allow_redirects=False, headers={"User-Agent": "mlxgw"}) as r:
                    if r.status in (301, 302, 303, 307, 308) and r.headers.get("Location"):
                        url = urljoin(url, r.headers["Location"])
                        continue
                    if r.status != 200:
                        raise invalid(f"image URL {url!r}: the server answered HTTP {r.status}", "messages")
                    data = bytearray()
                    async for chunk in r.content.iter_chunked(1 << 16):
                        data += chunk
                        if len(data) > max_bytes:
                            raise invalid(f"media URL {url!r}: larger than {max_bytes} bytes", "messages")
                    if check is not None:
                        return check(bytes(data), f"media URL {url!r}")
                    return _checked(bytes(data), f"image URL {url!r}", limits)
            raise invalid(f"image URL: more than {MAX_REDIRECTS} redirects", "messages")
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        raise invalid(f"image URL {url!r} could not be fetched: {e or type(e).__name__}", "messages") from None


def join_content(pieces: list) -> str | list[dict]:
    """Message content from text pieces (str) and image parts, in order: a plain string when
    there is no image (what every chat template handles), else a list of typed parts."""
    if not any(isinstance(x, dict) for x in pieces):
        return "\n".join(pieces)
    return [x if isinstance(x, dict) else {"type": "text", "text": x} for x in pieces]
