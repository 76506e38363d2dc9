"""The fields of OpenAI's Images API (/v1/images/generations as JSON, /v1/images/edits as a
multipart form), checked once into one `ImageAsk`, and the uploads of an edit decoded and
bounded off the event loop before anything reaches a worker."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Annotated, Any

from aiohttp import web

from ....shared.errors import ErrorCode, ServiceError, invalid
from ...pipeline.body import form_parts, read_capped
from ...pipeline.fields import INT32_MAX, M, ModelField

MAX_PROMPT_CHARS = 32000  # OpenAI's limit for its image models
MAX_N = 10
MAX_SIDE = 2048  # pixels a side (FLUX.2's bound; a family may ask less and says so)
SIDE_STEP = 16  # every mlx-vlm family draws in multiples of 16 pixels
DEFAULT_SIZE = (1024, 1024)  # OpenAI's default
MAX_UPLOAD_BYTES = 25 * 1024 * 1024
MAX_UPLOAD_PIXELS = 4096 * 4096  # an upload is refused past this before it is decoded
MAX_FIELD_BYTES = 64 * 1024
_SIZE = re.compile(r"^\s*(\d{1,5})\s*[x×]\s*(\d{1,5})\s*$")
# OpenAI's fields that choose among its own models' options: accepted, no effect here.
IGNORED = ("quality", "style", "user", "background", "moderation", "output_compression", "input_fidelity")


class ImageFields(ModelField):
    """POST /v1/images/generations (and the edit form's text fields, converted)."""

    prompt: str | None = None
    n: Annotated[int, M(ge=1, le=MAX_N)] | None = None
    size: str | None = None
    response_format: str | None = None
    output_format: str | None = None
    stream: bool | None = None
    partial_images: Annotated[int, M(ge=0, le=3)] | None = None
    # mlx-vlm's own extras (its server takes the same names)
    seed: Annotated[int, M(ge=0, le=INT32_MAX)] | None = None
    steps: Annotated[int, M(ge=1, le=500)] | None = None
    guidance: Annotated[float, M(ge=0.0, le=100.0)] | None = None


@dataclass
class ImageAsk:
    """One checked request of either route."""

    model: str
    prompt: str
    n: int
    size: tuple[int, int] | None  # None: an edit's source size
    stream: bool
    seed: int | None
    steps: int | None
    guidance: float | None


def check(f: ImageFields) -> ImageAsk:
    if not f.model:
        raise invalid("missing required parameter: 'model'", "model")
    if f.prompt is None or not f.prompt.strip():
        raise invalid("missing required parameter: 'prompt'", "prompt")
    if len(f.prompt) > MAX_PROMPT_CHARS:
        raise invalid(f"'prompt' is longer than {MAX_PROMPT_CHARS} characters", "prompt")
    if f.response_format == "url":
        raise invalid(
            "response_format 'url' is not served: this gateway does not host image files; "
            "use response_format 'b64_json' (the default)",
            "response_format",
        )
    if f.response_format not in (None, "b64_json"):
        raise invalid("'response_format' must be 'b64_json'", "response_format")
    if f.output_format not in (None, "png"):
        raise invalid("'output_format' must be 'png'", "output_format")
    return ImageAsk(f.model, f.prompt, f.n or 1, parse_size(f.size), bool(f.stream), f.seed, f.steps, f.guidance)


def parse_size(size: str | None) -> tuple[int, int] | None:
    if size is None or size == "auto":
        return None
    m = _SIZE.match(size) if isinstance(size, str) else None
    sides = (int(m[1]), int(m[2])) if m else None
    if sides is None or not all(SIDE_STEP <= s <= MAX_SIDE and s % SIDE_STEP == 0 for s in sides):
        raise invalid(
            f"'size' must be 'auto' or WIDTHxHEIGHT with each side a multiple of {SIDE_STEP} "
            f"from {SIDE_STEP} to {MAX_SIDE} (e.g. 1024x1024), got {size!r}",
            "size",
        )
    return sides


async def read_edit_form(request: web.Request) -> tuple[dict[str, Any], list[bytes], bytes | None]:
    """(text fields as JSON would carry them, image uploads, mask upload) of an edit's form."""
    text: dict[str, Any] = {}
    images: list[bytes] = []
    mask = None
    known = set(ImageFields.__struct_fields__) | set(IGNORED)
    async for part in form_parts(request, "an edit", "image"):
        name = part.name or ""
        if name in ("image", "image[]"):
            images.append(await _read(part, MAX_UPLOAD_BYTES, "image"))
        elif name == "mask":
            mask = await _read(part, MAX_UPLOAD_BYTES, "mask")
        elif name in known:
            text[name] = _typed(name, (await _read(part, MAX_FIELD_BYTES, name)).decode("utf-8", "replace"))
        else:
            raise invalid(f"unrecognized form field {name!r} (known: image, mask, {', '.join(sorted(known))})", name)
    return text, images, mask


def _typed(name: str, raw: str) -> Any:
    """A form field's text as the JSON value the generation route would get."""
    if name in ("n", "partial_images", "seed", "steps"):
        try:
            return int(raw)
        except ValueError:
            raise invalid(f"'{name}' must be an integer, got {raw!r}", name) from None
    if name == "guidance":
        try:
            return float(raw)
        except ValueError:
            raise invalid(f"'{name}' must be a number, got {raw!r}", name) from None
    if name == "stream":
        if raw.lower() not in ("true", "false", "1", "0"):
            raise invalid("'stream' must be true or false", "stream")
        return raw.lower() in ("true", "1")
    return raw


async def _read(part, cap: int, name: str) -> bytes:
    data = await read_capped(part, cap)
    if data is None:
        raise ServiceError(ErrorCode.BODY_TOO_LARGE, f"'{name}' is larger than {cap} bytes", param=name)
    return data


def decode_upload(data: bytes, name: str, need_alpha: bool = False):
    """The upload as a Pillow image, refused (400) when it is no image, too many pixels to
    decode, or (a mask) without the transparency that marks what may change."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        if image.width * image.height > MAX_UPLOAD_PIXELS:
            raise invalid(f"'{name}' is {image.width}x{image.height}: at most {MAX_UPLOAD_PIXELS} pixels", name)
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise invalid(f"'{name}' is not a readable image (PNG, JPEG or WebP): {e}", name) from None
    if need_alpha and "A" not in image.getbands() and "transparency" not in image.info:
        raise invalid(f"'{name}' must have an alpha channel: its transparent pixels mark what to edit", name)
    return image


def prepare_edit(image: bytes, mask: bytes | None, size: tuple[int, int] | None) -> tuple[bytes, bytes | None, tuple]:
    """(source PNG, mask PNG, output size): the uploads decoded, checked and re-encoded, so a
    worker only ever opens a PNG the gateway made. Without a size, the source's own, rounded
    down to the model's step and within the bounds."""
    source = decode_upload(image, "image")
    if size is None:
        size = tuple(max(SIDE_STEP, min(MAX_SIDE, s - s % SIDE_STEP)) for s in source.size)
    mask_png = None
    if mask is not None:
        m = decode_upload(mask, "mask", need_alpha=True)
        if m.size != source.size:
            raise invalid(f"'mask' is {m.width}x{m.height} but 'image' is {source.width}x{source.height}", "mask")
        mask_png = _png(m.convert("RGBA"))
    return _png(source.convert("RGB")), mask_png, size


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
