"""The small interfaces the engine loop is written against.

A worker serves one model with one runner (execution) and one scheduler (policy):
- TextRunner: text generation (the MLX runner, the vision runner, the null and echo engines);
- EmbeddingRunner: embedding and cross-encoder models (the encoders);
- Scheduler: sequences over a TextRunner, or input batches over an EmbeddingRunner.
The engine only needs ModelRunner and Scheduler; each scheduler needs its runner kind."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from mlxgw.shared.protocol import Event, GenerateRequest, SamplingParams


class ModelRunner(Protocol):
    """What the engine asks of every runner."""

    def encode(self, req: GenerateRequest) -> list[int]: ...  # token count calls; encoders refuse

    def stats(self) -> dict: ...

    def cache_stats(self) -> dict: ...

    def cache_clear(self) -> None: ...


class TextRunner(ModelRunner, Protocol):
    context_length: int
    vocab_size: int | None  # None: no native code behind token ids (null and echo engines)

    def encode_text(self, text: str) -> list[int]: ...

    def new_detokenizer(self) -> Any: ...

    def make_constraint(self, req: GenerateRequest) -> Any: ...

    def make_parser(self, req: GenerateRequest, prompt: list[int]) -> Any: ...

    def insert(
        self, prompt: list[int], max_tokens: int, sampling: SamplingParams, constraint=None, guard=None
    ) -> tuple[int, int]: ...

    def step(self) -> Any: ...  # runner.StepOutput

    def remove(self, uids: list[int]) -> None: ...


class EmbeddingRunner(ModelRunner, Protocol):
    dim: int
    cross_encoder: bool

    def tokenize(self, item: str | list[int], index: int, truncate: bool | None = None) -> list[int]: ...

    def tokenize_pair(self, query: str, document: str) -> tuple[list[int], list[int]]: ...

    def embed(self, batch: list[list[int]], dimensions: list[int | None] | None = None) -> list: ...

    def score(self, batch: list[tuple[list[int], list[int]]]) -> list[float]: ...


class Scheduler(Protocol):
    request_type: ClassVar[type]
    finished: int

    def submit(self, req: Any) -> list[Event]: ...

    def cancel(self, rid: str) -> list[Event]: ...

    def has_work(self) -> bool: ...  # something to step now

    def preparing(self) -> int: ...  # requests being prepared off the engine thread

    def poll_prepared(self) -> list[Event]: ...

    def step(self) -> list[Event]: ...

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    def requests(self) -> list[dict]: ...

    def counters(self) -> dict: ...  # lifetime counters for the stats (generated_tokens, ...)
