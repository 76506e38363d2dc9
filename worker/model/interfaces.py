"""The small interfaces the engine loop is written against: the one runner contract.

A worker serves one model with one runner (execution) and one scheduler (policy):
- TextRunner: text generation (the MLX runner, the vision runner, the null and echo engines);
- EmbeddingRunner: embedding and cross-encoder models (the encoders);
- Scheduler: sequences over a TextRunner, or input batches over an EmbeddingRunner.
The engine only needs ModelRunner and Scheduler; each scheduler needs its runner kind.

TextRunner is a Protocol with defaults: a runner either subclasses it (and inherits the
defaults of what it does not do: no constraints, no parser, no chunked prefill) or matches
it structurally (worker/process/lockstep.py wraps another runner). What a runner can do beyond the
basics is said by its `supports_*` flags, never probed for."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ...shared.errors import invalid
from ...shared.protocol import Event, GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from .memory.kv_budget import KVProfile
    from .runners.prompt_logprobs import PromptScorer


@dataclass
class TokenOut:
    uid: int
    token: int
    finish: str | None  # "stop" (end-of-sequence token) or "length"
    logprobs: dict | None = None  # for sequences inserted with logprobs (worker/model/runners/logprobs.py)


@dataclass(eq=False)
class Row:
    """One sequence in a runner's batch (as nano-vllm's Sequence): what the scheduler inserts,
    then what the runner keeps about it until it finishes or is removed."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    constraint: Any = None  # a logits processor enforcing the request's constraint
    guard: Any = None  # a SequenceGuard: an exception in its samplers ends this row only
    logprobs: int | None = None  # alternatives per token, for those that ask (supports_choices)
    keep_prompt: bool = False  # its prompt KV is stored once prefilled (supports_choices, publish_prompt)
    adapter: str | None = None  # a LoRA adapter's name; None: the one its request named, if any
    hold_s: float | None = None  # a client's caching hint, seconds (supports_cache_hints)
    namespace: str | None = None  # its request's cache namespace (supports_cache_scopes)
    route: list[bytes] | None = None  # its request's route entries (worker/model/cache/prefix_events.py)
    # The runner's, from insert on:
    covered: int = 0  # prompt tokens its cache lookup covered
    scope: int = 0  # its prefix-cache scope (worker/model/cache/scopes.py; 0: the base's)
    checkpoints: Any = None  # the state checkpoints taken so far (worker/model/cache/state_checkpoints.py)
    boundaries: set[int] = field(default_factory=set)  # its prompt's message boundaries


@dataclass
class StepOutput:
    tokens: list[TokenOut] = field(default_factory=list)
    prefill: list[tuple[int, int, int]] = field(default_factory=list)  # uid, done, total
    # seconds of the step spent reading prompt chunks (None: the runner does not time them);
    # the rest of the step is decoding, which paces the prompt budget (worker/schedule/prefill_plan.py)
    prompt_s: float | None = None


class ModelRunner(Protocol):
    """What the engine asks of every runner."""

    def encode(self, req: GenerateRequest) -> list[int]: ...  # token count calls; encoders refuse

    def stats(self) -> dict: ...

    def cache_stats(self) -> dict: ...

    def cache_clear(self) -> None: ...


class TextRunner(ModelRunner, Protocol):
    context_length: int
    vocab_size: int | None = None  # the logits' width; None where no native code sees token ids
    # Whether insert() obeys a Row's logprobs and keep_prompt (per-token logprobs, n > 1 choices).
    supports_choices: bool = False
    # Whether prompt_scorer() works (prompt logprobs: an extra forward pass over a prompt).
    supports_prompt_logprobs: bool = False
    # Whether set_prefill_chunk() is obeyed (the scheduler then shares a per-step prompt budget).
    supports_prefill_chunk: bool = False
    # Whether `model` is an in-process MLX model whose decoder layers step_progress can mark
    # (a long prefill step then shows the watchdog progress; worker/process/main.py installs it).
    supports_layer_progress: bool = False
    # Whether publish_prompt(uid) puts a row's prompt KV in the prefix cache at its first token,
    # so prompts sharing that prefix wait for it instead of reading it again (worker/schedule/prefix_inflight.py).
    supports_shared_prefill: bool = False
    # Whether insert() obeys a Row's hold_s (a client's caching hint: keep this prompt's KV longer).
    supports_cache_hints: bool = False
    # Whether insert() and prompt_scorer() obey a namespace (a request's cache namespace: its row
    # reads and writes only that scope's prefix-cache blocks, worker/model/cache/scopes.py).
    # A runner without it must keep no prefix cache shared between requests.
    supports_cache_scopes: bool = False

    @abstractmethod
    def encode(self, req: GenerateRequest) -> list[int]: ...

    @abstractmethod
    def new_detokenizer(self) -> Any: ...

    @abstractmethod
    def insert(self, row: Row) -> tuple[int, int]:
        """Queue a row's prompt for execution; return (uid, prompt tokens served from the cache).
        Its guard wraps the sequence's samplers and logits processors, so an exception in them
        ends this sequence only; the options beyond are obeyed as the supports_* flags say."""

    @abstractmethod
    def step(self) -> StepOutput: ...

    @abstractmethod
    def remove(self, uids: list[int]) -> None: ...

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a piece of text, without special tokens."""
        return list(text.encode())

    def make_constraint(self, req: GenerateRequest) -> Any:
        """A logits processor enforcing req.constraint (raises a 400 for a bad one), or None."""
        if req.constraint is not None:
            # name the field that asked for it: a forced tool call is tool_choice's doing
            param = "tool_choice" if req.constraint.get("type") == "tool_call" else "response_format"
            raise invalid("constrained decoding is not available for this engine", param)
        return None

    def make_parser(self, req: GenerateRequest, prompt: list[int]) -> Any:
        """An OutputParser when the model reasons or the request offers tools, else None."""
        return None

    def prompt_scorer(self, prompt: list[int], top: int) -> PromptScorer:
        """A PromptScorer for one request's prompt logprobs (supports_prompt_logprobs)."""
        raise invalid("this model's engine does not support prompt logprobs (echo with logprobs)", "echo")

    def set_prefill_chunk(self, tokens: int) -> None:
        """Prompt tokens each prefilling row reads in the next step (supports_prefill_chunk)."""
        return None

    def release_idle_memory(self) -> None:
        """Nothing runs any more: give back what is only kept for speed."""
        return None

    def kv_profile(self) -> KVProfile | None:
        """What a row's KV costs per layer (worker/model/memory/kv_budget.py); None: rows are admitted by count."""
        return None

    def prefix_ready(self, prompt: list[int], namespace: str | None = None) -> bool:
        """Whether a prompt's cached prefix can be looked up without waiting on the disk;
        False starts reading it off the engine thread (the row waits, the others step)."""
        return True

    def cached_tokens(self, prompt: list[int], namespace: str | None = None) -> int:
        """How many of a prompt's tokens its prefix cache holds now (an estimate: the
        waiting queue reads the shortest prompts first); 0 without one."""
        return 0

    def limit_prefix_cache(self, max_bytes: int) -> None:
        """Evict prefix-cache entries until it holds at most max_bytes (what the admitted rows
        leave of the KV budget), and keep it there until told otherwise."""
        return None

    def stats(self) -> dict:
        return {}

    def cache_stats(self) -> dict:
        return {}

    def cache_clear(self) -> None:
        return None


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
