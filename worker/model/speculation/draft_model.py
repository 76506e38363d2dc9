"""A draft model for speculative decoding (`speculative: {mode: draft, draft_model: ...}`):
a smaller model sharing the target's tokenizer decodes each speculating row's draft greedily;
the target verifies it in the batch's forward pass (worker/model/speculation/spec_verify.py), so outputs stay
exactly the target's greedy outputs whatever the draft proposes.

The draft keeps no persistent batch cache: each speculating row has its own draft KV cache
holding the row's tokens so far. Before drafting, the positions it drafted that the target
rejected are trimmed away and the cache catches up with what the target accepted (each row
alone: their contexts differ in length). Then the draft's tokens are decoded greedily, one
position per pass; when several rows draft, their caches are merged into one batch cache
for those passes and split again after (a copy of their KV, cheaper than a pass per row)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ....shared.config import ConfigError
from ....shared.model_sections import SpeculativeConfig
from .. import model_info
from .speculative import DraftRequest

PREFILL_CHUNK = 512  # context tokens fed to the draft per forward pass when it catches up


@dataclass
class DraftRow:
    cache: list
    fed: list[int] = field(default_factory=list)  # the tokens in `cache`, in order


@dataclass
class DraftModelDrafter:
    model: object
    vocab_limit: int  # drafted ids at or past this are not the target's tokens: cut there
    rows: dict[int, DraftRow] = field(default_factory=dict)  # uid -> its draft KV

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each row catches up alone (contexts differ in length), then the rows that draft
        more than one token decode together, one batched pass per drafted position."""
        drafts = [self._start(r) for r in requests]
        fed: list[list[int]] = [[] for _ in requests]  # draft tokens fed into each row's cache
        more = [i for i, r in enumerate(requests) if drafts[i] and r.k > 1]
        rows = [self.rows[requests[i].uid] for i in more]
        if len(rows) > 1 and all(type(c) is KVCache for row in rows for c in row.cache):
            ks = [requests[i].k for i in more]
            self._decode_together(rows, ks, [drafts[i] for i in more], [fed[i] for i in more])
        else:
            for i, row in zip(more, rows):
                self._decode_alone(row.cache, requests[i].k, drafts[i], fed[i])
        for r, tokens in zip(requests, fed):
            self.rows[r.uid].fed = r.context + tokens
        return drafts

    def retain(self, live: set[int]) -> None:
        if len(self.rows) > len(live) or any(uid not in live for uid in self.rows):
            self.rows = {uid: row for uid, row in self.rows.items() if uid in live}

    def _start(self, request: DraftRequest) -> list[int]:
        """Bring the row's cache to its context; the first draft token (none if invalid)."""
        row = self.rows.get(request.uid)
        if row is None:
            row = self.rows[request.uid] = DraftRow(make_prompt_cache(self.model))
        kept = self._rewind(row, request.context)
        logits = self._feed(row.cache, request.context[kept:])
        token = mx.argmax(logits[0, -1]).item()
        return [token] if token < self.vocab_limit else []

    def _decode_alone(self, cache: list, k: int, draft: list[int], fed: list[int]) -> None:
        while len(draft) < k:
            fed.append(draft[-1])
            token = mx.argmax(self.model(mx.array([[draft[-1]]]), cache=cache)[0, -1]).item()
            if token >= self.vocab_limit:
                return
            draft.append(token)

    def _decode_together(
        self, rows: list[DraftRow], ks: list[int], drafts: list[list[int]], fed: list[list[int]]
    ) -> None:
        """Merge the rows' caches into one batch cache, decode, and split it again. A row
        that is done keeps being fed its last token (the pass is batched); `fed` records it
        and the next rewind trims it."""
        layers = len(rows[0].cache)
        batch = [BatchKVCache.merge([row.cache[layer] for row in rows]) for layer in range(layers)]
        going = [len(d) < k for d, k in zip(drafts, ks)]
        while any(going):
            last = [d[-1] for d in drafts]
            logits = self.model(mx.array(last)[:, None], cache=batch)
            chosen = mx.argmax(logits[:, -1], axis=-1).tolist()
            for j, token in enumerate(chosen):
                fed[j].append(last[j])
                if not going[j]:
                    continue
                if token >= self.vocab_limit:
                    going[j] = False
                    continue
                drafts[j].append(token)
                going[j] = len(drafts[j]) < ks[j]
        for j, row in enumerate(rows):
            row.cache = [c.extract(j) for c in batch]

    def _rewind(self, row: DraftRow, context: list[int]) -> int:
        """Trim the row's cache to the longest prefix it shares with context, leaving at least
        the last context token to feed (its logits give the first draft token). Returns that
        prefix's length."""
        n = min(len(row.fed), len(context) - 1)
        if row.fed[:n] != context[:n]:  # a rejection further back than the last draft (rare)
            n = next(i for i, (a, b) in enumerate(zip(row.fed, context)) if a != b)
        extra = len(row.fed) - n
        if extra:
            if can_trim_prompt_cache(row.cache):
                trim_prompt_cache(row.cache, extra)
            else:  # a cache that cannot be cut (rotating window, SSM state): start over
                row.cache, n = make_prompt_cache(self.model), 0
        row.fed = row.fed[:n]
        return n

    def _feed(self, cache: list, tokens: list[int]) -> mx.array:
        """Feed tokens (at least one) into the cache; the logits of the last pass."""
        logits = None
        for start in range(0, len(tokens), PREFILL_CHUNK):
            logits = self.model(mx.array([tokens[start : start + PREFILL_CHUNK]]), cache=cache)
            if start + PREFILL_CHUNK < len(tokens):
                mx.eval([c.state for c in cache])
        return logits


def load_drafter(
    config: SpeculativeConfig, target_path: Path, target_tokenizer, target_vocab_size: int
) -> DraftModelDrafter | None:
    """The draft model of a `mode: draft` config, checked against the target's tokenizer;
    None for the other modes. A draft that cannot serve the target is a ConfigError."""
    if config.mode != "draft":
        return None
    from mlx_lm import load

    path = _draft_path(config, target_path)
    if not (path / "config.json").exists():
        raise ConfigError(f"speculative.draft_model: no model at {path} ({config.draft_model!r})")
    model, tokenizer = load(str(path))
    target_vocab, draft_vocab = _vocabulary(target_tokenizer), _vocabulary(tokenizer)
    if draft_vocab != target_vocab:
        raise ConfigError(
            f"speculative.draft_model {config.draft_model!r} does not share the model's tokenizer "
            f"vocabulary ({len(draft_vocab)} tokens vs {len(target_vocab)}): a draft must use the same tokenizer"
        )
    draft_size = model_info.vocab_size(model, tokenizer)
    if draft_size < len(target_vocab):
        raise ConfigError(
            f"speculative.draft_model {config.draft_model!r} has a vocabulary of {draft_size} tokens, "
            f"the model's tokenizer has {len(target_vocab)}: a draft must cover the same vocabulary"
        )
    return DraftModelDrafter(model, vocab_limit=min(target_vocab_size, draft_size))


def _draft_path(config: SpeculativeConfig, target_path: Path) -> Path:
    """A name resolves in the models dir; the gateway's (manager.models_dir) may not be the
    worker's default, but the target usually lies in it, so its folder is tried too."""
    from ....shared.paths import models_dir

    path = config.draft_model_path(models_dir())
    assert path is not None
    beside = config.draft_model_path(Path(target_path).parent)
    return beside if not path.exists() and beside is not None and beside.exists() else path


def _vocabulary(tokenizer) -> dict[str, int]:
    return dict(tokenizer.get_vocab())
