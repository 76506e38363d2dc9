"""The fields of Ollama's bodies (/api/chat, /api/generate, /api/embed(dings), /api/show),
declared once and decoded in one pass by msgspec like every other API's (fields.py): the
top level as one struct per route, then `options`, whose sampling fields are the ones every
API shares (CommonFields), with Ollama's names for them. A failure is a 400 naming the
field in the words of fields._refusal, sent in Ollama's shape ({"error": "..."}).

Fields whose shapes need their own messages (messages, tools, images, format, think,
keep_alive) are taken as sent and checked by ollama.py / ollama_common.py from the
decoded struct, so each field is read once."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ...pipeline.fields import INT32_MAX, CommonFields, M, Stop

RepetitionPenalty = Annotated[float, M(ge=0.01, le=10)]


class OllamaOptions(CommonFields):
    """`options`: the sampling fields every API shares, plus Ollama's own."""

    MAX_TOKENS = ("num_predict",)
    num_predict: Annotated[int, M(ge=-2, le=INT32_MAX)] | None = None  # -1, -2: no limit of its own
    num_ctx: Annotated[int, M(ge=1, le=INT32_MAX)] | None = None
    stop: Stop = None
    repeat_penalty: RepetitionPenalty | None = None  # Ollama's name for repetition_penalty

    def __post_init__(self) -> None:
        if self.repeat_penalty is not None:
            self.repetition_penalty = self.repeat_penalty

    def requested_max_tokens(self) -> int | None:
        return self.num_predict if self.num_predict and self.num_predict > 0 else None


class OllamaBody(msgspec.Struct):
    """What every Ollama route reads: the model (or its older spelling `name`)."""

    model: str | None = None
    name: str | None = None
    keep_alive: Any = None  # seconds or a Go duration (ollama_common.parse_duration)
    options: dict | None = None  # decoded as OllamaOptions (ollama_common.parse_options)

    def model_name(self) -> str | None:
        return self.model or self.name


class OllamaGenerating(OllamaBody):
    """The fields /api/chat and /api/generate share."""

    stream: bool | None = None  # Ollama streams unless told not to
    format: Any = None  # "json" or a JSON schema (ollama_common.format_constraint)
    think: Any = None  # true/false or an effort (ollama_common.think_kwargs)
    template: Any = None  # refused when set: a Go template is not run here

    def streams(self) -> bool:
        return self.stream is not False


class OllamaChatBody(OllamaGenerating):
    messages: Any = None  # checked by ollama.parse_messages
    tools: Any = None  # checked by ollama.parse_tools


class OllamaGenerateBody(OllamaGenerating):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    images: Any = None  # bare base64 strings (ollama._images)
    suffix: Any = None  # the code after the cursor: fill in the middle (ollama.parse_generate)


class OllamaEmbedBody(OllamaBody):
    input: Any = None  # /api/embed: a string or a list of strings (ollama_models._inputs)
    prompt: Any = None  # /api/embeddings: one string
    truncate: bool | None = None  # the model's entry decides (truncate: in models.yaml)
    dimensions: Annotated[int, M(ge=1, le=INT32_MAX)] | None = None
