"""Choosing a worker: every worker of one model (local replicas, remote workers) is one pool.

The pool routes a request to the replica that holds the longest prefix of its prompt (the
hash chains of gateway/link/route_key.py, recorded per worker as requests are routed there,
as SGLang's approximate radix-tree router does), unless that replica's load exceeds the least
loaded one's by the model's load margin. Where no replica holds more than the shared head
(tools, system prompt), the session's anchor (the client's session id, else the session's
first turn) picks the replica by rendezvous hashing: a session's turns meet on one replica
without any state, so a gateway restart, which empties the index, keeps them where they were.

The index starts as a guess (what was routed where, recorded at routing time, since the
worker reports a prompt only once it stored it) and is corrected by the workers: each reports,
in the chain entries its requests carried, which prompts it stored and which left its cache
(memory and disk tier) for good (PREFIXES, worker/model/cache/prefix_events.py), and after
each WELCOME all it holds, which replaces what the index had for it: a session whose prefix a
replica evicted is placed by its anchor again, and a restarted gateway knows at once where
each session lives.

A replica that fails requests while it answers heartbeats is taken out for a while (circuit
breaker): it gets nothing new until its cool-down ends, then one request probes it."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable

from ...shared.errors import ErrorCode
from ...shared.events import Usage
from .route_key import RouteKey, rendezvous
from .worker_conn import ConnState, WorkerConn

INDEX_ENTRIES = 65536  # chain entries remembered per worker (least recently routed go first)
SESSIONS = 65536  # session ids remembered (the anchor's hash decides for the others)
BREAKER_FAILURES = 3  # worker-side failures in a row that open a replica's breaker
BREAKER_COOL_S = 10.0  # first cool-down; doubles each time it opens again without a success
BREAKER_COOL_MAX_S = 300.0
# Errors that are the worker's fault, not the request's (a bad request fails on every replica).
WORKER_FAULTS = frozenset({ErrorCode.INTERNAL, ErrorCode.TIMEOUT})
COLD_MIN_TOKENS = 64  # a prompt shorter than two cache blocks says little about a cold turn
Route = RouteKey | Callable[[], RouteKey | None] | None


class Pool:
    """Routing over the workers the registry knows (`conns`: identity -> WorkerConn)."""

    def __init__(self, conns: dict[bytes, WorkerConn]) -> None:
        self.conns = conns
        # worker id -> chain entries it holds, each with when it was last recorded (monotonic)
        self._index: dict[str, OrderedDict[bytes, float]] = {}
        self._holders: dict[bytes, set[str]] = {}  # chain entry -> worker ids holding it
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> worker id
        self._turn = itertools.count()

    # -- what the manager asks --------------------------------------------------------------------
    def workers(self, model: str) -> list[WorkerConn]:
        return [c for c in self.conns.values() if c.model == model]

    def ready_workers(self, model: str) -> list[WorkerConn]:
        return _ready(self.workers(model))

    def in_flight(self, model: str) -> int:
        return sum(c.load for c in self.workers(model))

    def least_loaded(self, model: str) -> WorkerConn | None:
        ready = self.ready_workers(model)
        return min(ready, key=lambda c: c.load) if ready else None

    def pick(self, model: str, route: Route, policy: str = "prefix", margin: int = 4) -> WorkerConn | None:
        """The worker for a request, recorded as holding its prefix from now on; None when
        no worker of the model is ready. route: its key, or what makes it (called only for
        a model with more than one worker: a lone worker needs no hashing)."""
        workers = self.workers(model)  # listed once: pick runs on every request
        ready = _ready(workers)
        if not ready:
            return None
        if callable(route):
            route = route() if len(workers) > 1 else None
        now = time.monotonic()
        closed = [c for c in ready if c.replica.open_until <= now] or ready  # all open: the breaker yields
        least = min(closed, key=lambda c: c.load)
        if policy == "round_robin" and len(closed) > 1:
            choice, how = sorted(closed, key=lambda c: c.replica.label)[next(self._turn) % len(closed)], "load"
        elif policy == "load" or route is None or len(closed) == 1:
            choice, how = least, "load"
        else:
            choice, how = self._by_prefix(closed, route)
            if choice.load > least.load + margin:
                choice, how = least, "load"
        if route is not None:  # a generation (not a tokenize call or an adapter push)
            self._forget_gone()
            setattr(choice.replica, f"by_{how}", getattr(choice.replica, f"by_{how}") + 1)
            self._record(choice, route)
        return choice

    def _by_prefix(self, ready: list[WorkerConn], route: RouteKey) -> tuple[WorkerConn, str]:
        by_id = {c.worker_id: c for c in ready}
        for entry in reversed(route.chain[route.lead :]):  # the longest match first
            holders = [by_id[w] for w in self._holders.get(entry, ()) if w in by_id]
            if holders:
                return min(holders, key=lambda c: c.load), "prefix"
        home = self._sessions.get(route.session) if route.session else None
        if home in by_id:
            return by_id[home], "session"
        return max(ready, key=lambda c: rendezvous(route.anchor, c.replica.label or c.worker_id)), "session"

    def _record(self, conn: WorkerConn, route: RouteKey) -> None:
        self._hold(conn.worker_id, route.chain)
        if route.session:
            self._sessions[route.session] = conn.worker_id
            self._sessions.move_to_end(route.session)
            while len(self._sessions) > SESSIONS:
                self._sessions.popitem(last=False)

    def _hold(self, worker_id: str, entries) -> None:
        held = self._index.setdefault(worker_id, OrderedDict())
        now = time.monotonic()
        for entry in entries:
            if entry not in held:
                self._holders.setdefault(entry, set()).add(worker_id)
            held[entry] = now
            held.move_to_end(entry)
        while len(held) > INDEX_ENTRIES:
            old, _ = held.popitem(last=False)
            self._unhold(old, worker_id)

    def _unhold(self, entry: bytes, worker_id: str) -> None:
        holders = self._holders.get(entry)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[entry]

    def _forget_gone(self) -> None:
        """A worker that left takes its cache with it: its entries route nothing any more (a
        replica restarted under the same label is a new worker id with an empty index)."""
        live = {c.worker_id for c in self.conns.values()}
        for worker_id in [w for w in self._index if w not in live]:
            for entry in self._index.pop(worker_id):
                self._unhold(entry, worker_id)

    # -- what the workers report ----------------------------------------------------------------------
    def reported(self, conn: WorkerConn, held: list[bytes], evicted: list[bytes], snapshot: bool) -> None:
        """A worker's PREFIXES message. A snapshot replaces what the index had for it, except
        what was routed to it since it connected (its answer, and its report, come later)."""
        index = self._index.setdefault(conn.worker_id, OrderedDict())
        if snapshot:
            keep = set(held)
            stale = [e for e, at in index.items() if at < conn.connected_at and e not in keep]
            evicted = [*evicted, *stale]
            conn.replica.snapshots += 1
        for entry in evicted:
            if index.pop(entry, None) is not None:
                self._unhold(entry, conn.worker_id)
        self._hold(conn.worker_id, held)
        conn.replica.reported_held += len(held)
        conn.replica.reported_evicted += len(evicted)

    # -- outcomes -----------------------------------------------------------------------------------
    def finished(self, conn: WorkerConn, prompt_tokens: int, cached_tokens: int) -> None:
        stats = conn.replica
        stats.prompt_tokens += prompt_tokens
        stats.cached_tokens += cached_tokens
        stats.failures = 0
        stats.open_until = 0.0
        stats.opened = 0

    def observed(self, conn: WorkerConn, route: RouteKey, usage: Usage) -> None:
        """A later turn of a session (its chain goes past its first turn) that read less than
        half its prompt from the cache (a shared system prompt at most): its prefix was not
        where it went (evicted, a restarted replica or gateway, a session moved by load).
        Counted per replica: a session pinned to a replica that lost its cache shows here,
        not as a slow turn nobody explains."""
        later = len(route.chain) > route.lead + 1
        if later and usage.prompt_tokens >= COLD_MIN_TOKENS and usage.cached_tokens * 2 < usage.prompt_tokens:
            conn.replica.cold_warm_turns += 1

    def failed(self, conn: WorkerConn, code: ErrorCode) -> None:
        """A worker-side failure; BREAKER_FAILURES in a row take the replica out for a while."""
        if code not in WORKER_FAULTS:
            return
        stats = conn.replica
        stats.failures += 1
        if stats.failures >= BREAKER_FAILURES:
            cool = min(BREAKER_COOL_S * 2**stats.opened, BREAKER_COOL_MAX_S)
            stats.open_until = time.monotonic() + cool
            stats.opened += 1
            stats.failures = BREAKER_FAILURES - 1  # after the cool-down one more failure reopens it

    def report(self, model: str) -> list[dict]:
        """Per replica, for /v1/status and /metrics."""
        now = time.monotonic()
        out = []
        for c in sorted(self.workers(model), key=lambda c: c.replica.label or c.worker_id):
            r = c.replica
            rate = r.hit_rate
            out.append({
                "replica": r.label or c.worker_id, "worker_id": c.worker_id, "remote": c.remote,
                "state": c.state.value, "load": c.load, "routed_by_prefix": r.by_prefix,
                "routed_by_session": r.by_session, "routed_by_load": r.by_load,
                "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                "cache_bytes": (c.stats.get("cache") or {}).get("bytes", 0),
                "cache_hit_rate": None if rate is None else round(rate, 4),
                "cold_warm_turns": r.cold_warm_turns,
                "breaker_open_s": round(max(0.0, r.open_until - now), 1),
                "indexed_prefixes": len(self._index.get(c.worker_id, ())),
                "reported_held": r.reported_held, "reported_evicted": r.reported_evicted,
                "index_snapshots": r.snapshots,
            })  # fmt: skip
        return out


def _ready(workers: list[WorkerConn]) -> list[WorkerConn]:
    return [c for c in workers if c.state is ConnState.READY and c.reachable]
