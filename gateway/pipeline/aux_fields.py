"""The fields of the APIs that generate no text (embeddings, rerank, tokenize, speech),
declared once and decoded in one pass by msgspec like the generating APIs' (fields.py):
a failure is a 400 naming the field in the words of fields._refusal. Fields whose shapes
need their own messages (inputs, documents, messages, token ids) are taken as sent and
checked by the route from the decoded struct. Each struct declares `model` (ModelField),
so serving.open_fields reads the whole body in one decode; `required` says a field is missing in the
words every API uses."""

from __future__ import annotations

from typing import Annotated, Any

from ...shared.errors import invalid
from .fields import INT32_MAX, M, ModelField

Positive = Annotated[int, M(ge=1, le=INT32_MAX)]


def required(value: Any, name: str) -> Any:
    """The value; a 400 when it was not sent (or sent as null)."""
    if value is None:
        raise invalid(f"missing required parameter: '{name}'", name)
    return value


class EmbeddingsFields(ModelField):
    """POST /v1/embeddings."""

    input: Any = None  # a string, token ids, or a list of either (openai_embeddings.parse_inputs)
    encoding_format: str | None = None  # "float" (the default) or "base64"
    dimensions: Positive | None = None
    priority: Annotated[int, M(ge=-100, le=100)] | None = None


class RerankFields(ModelField):
    """POST /v1/rerank and /v2/rerank."""

    query: str | None = None
    documents: Any = None  # strings or {"text": ...} objects (rerank.parse_documents)
    top_n: Positive | None = None
    return_documents: bool | None = None


class TokenizeFields(ModelField):
    """POST /tokenize: a prompt, or chat messages through the chat template."""

    prompt: str | None = None
    add_special_tokens: bool | None = None
    messages: Any = None  # OpenAI chat messages (pipeline/messages.py)
    tools: list | None = None
    chat_template_kwargs: dict | None = None


class DetokenizeFields(ModelField):
    """POST /detokenize."""

    tokens: Any = None  # token ids, checked by tokenize.detokenize in one message


class SpeechFields(ModelField):
    """POST /v1/audio/speech."""

    input: str | None = None
    response_format: str | None = None  # "mp3" when not sent
    voice: str | None = None
    speed: Annotated[float, M(ge=0.25, le=4.0)] | None = None
