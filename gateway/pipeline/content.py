"""Content other than plain text and images in messages: documents (text and PDF), and what a
text-only model is sent instead of an image in a tool result.

PDFs are read with pypdf in a child process (gateway/pipeline/pdf_job.py) that keeps a budget of
pages, content bytes and operators and is killed at its deadline: a small PDF can be hours of
work, and a thread could not be stopped. What cannot be read (not a PDF,
encrypted, no text layer, over the budget) is a clear 400; what a model cannot take in a tool
result (an image for a text-only model) becomes a short placeholder named in the
`x-mlxgw-omitted-content` response header, never a 400: an agent resends every earlier turn,
so one refusal would end its session."""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...shared.errors import invalid
from ..web.work_pools import JobFailed, JobTimeout, run_process_job
from .images import ImageLimits

PDF_TIMEOUT_S = 60.0
IMAGE_PLACEHOLDER = "[image omitted: this model does not accept images]"
_DATA_URL = re.compile(r"^data:(?P<type>[^;,]*)(?:;[^;,]*)*,(?P<data>.*)$", re.S)


@dataclass
class ContentPolicy:
    """What the model takes, and what the request's converters found along the way."""

    images: ImageLimits | None  # None: a text-only model
    documents: dict[int, str] = field(default_factory=dict)  # id(block) -> the text of its PDF, read beforehand
    omitted: list[str] = field(default_factory=list)  # kinds of content replaced by a placeholder

    def image_placeholder(self) -> str:
        self.omitted.append("image")
        return IMAGE_PLACEHOLDER


def b64decode(data, where: str, param: str) -> bytes:
    if not isinstance(data, str):
        raise invalid(f"{where}: the data must be a base64 string", param)
    try:
        return base64.b64decode(re.sub(r"\s+", "", data), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}: the data is not valid base64", param) from None


async def pdf_text(data: bytes, where: str, param: str) -> str:
    """The text of a PDF, or a 400 that says why it cannot be read."""
    if not data.startswith(b"%PDF-"):
        raise invalid(f"{where}: the document is not a PDF file", param)
    try:
        text = await run_process_job("mlxgw.gateway.pipeline.pdf_job", data, PDF_TIMEOUT_S)
    except JobTimeout:
        raise invalid(f"{where}: reading the PDF took longer than {PDF_TIMEOUT_S:.0f} s", param) from None
    except JobFailed as e:
        raise invalid(f"{where}: the PDF could not be read: {e}", param) from None
    if not text:
        raise invalid(
            f"{where}: the PDF has no text layer (scanned pages need OCR, which this server does not do)", param
        )
    return text


async def read_pdfs(found: Iterable[tuple[dict, bytes, str]], policy: ContentPolicy, param: str) -> None:
    """Read every PDF of a request (block, its bytes, where it is) into policy.documents."""
    found = list(found)
    texts = await asyncio.gather(*(pdf_text(data, where, param) for _, data, where in found))
    for (block, _, _), text in zip(found, texts):
        policy.documents[id(block)] = text


def data_url(url: str) -> tuple[str, str] | None:
    """(media type, base64 data) of a data: URL, or None for anything else."""
    match = _DATA_URL.match(url)
    return (match["type"].lower(), match["data"]) if match else None


def text_file(data: bytes, where: str, param: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(f"{where}: only PDF and UTF-8 text documents can be read", param) from None


def titled(text: str, title) -> str:
    return f"Document: {title}\n\n{text}" if isinstance(title, str) and title else text


def blocks_of(messages, content_key: str = "content") -> Iterable[tuple[int, int, dict]]:
    """(message index, block index, block) for every content block of a message list,
    including the blocks nested one level down in tool results."""
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        content = m.get(content_key) if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, block in enumerate(content):
            if not isinstance(block, dict):
                continue
            yield i, j, block
            inner = block.get("content")
            if isinstance(inner, list):
                for nested in inner:
                    if isinstance(nested, dict):
                        yield i, j, nested
