"""Who runs next: the admission policy of a generating worker (the scheduler executes it).

Requests wait per tenant (a stable hash of the API key the gateway passes, never its name).
A free decode row goes to the most urgent priority class first (interactive -100..100, then
background: service_tier "flex" and batch jobs); within a class, to the tenant holding the
fewest running rows per unit of its weight (keys.yaml `weight`, default 1), so a key with one
request gets its turn ahead of another key's 32nd; within a tenant (and between tenants
holding as many), the earliest deadline first: arrival + its latency class's target
(worker/schedule/latency.py), so a keystroke overtakes queued agent turns and batch work.
With one tenant waiting, it may take every row: an idle machine is never held back.

Within one latency class of one tenant, the prompt with the fewest tokens left to read (its
length less what the prefix cache holds of it when it was queued) goes first, so a warm turn
whose conversation is cached does not queue behind new sessions' long reads (an agent's warm
turn reads ~100 tokens where a new session reads ~400). Shortest-first alone starves long
prompts while short ones keep coming, so the oldest goes next whenever no row of the class is
reading a prompt longer than the shortest waiting one: a long read is always in progress
beside the short ones (SGLang orders by the longest cached prefix, with no such bound).

The prompt budget is shared the same way (`may_start_prefill`): while another key has a
prompt to read, a key starts prompt-reading rows only within its weighted share of them, so
a key holding fewer decode rows does not take the whole prompt budget from one holding more.

Admission order alone leaves a late key waiting until a row ends. `victim` names a running
row to preempt: a background row as soon as an interactive request waits, or a row of a
less urgent latency class once a waiting request has used half its class's target
(worker/schedule/latency.py), or a row of the tenant most over its share, at once for a
tenant with no row running and once a waiting request has been starved beyond `starve_s`
otherwise. The scheduler pauses
that row (its KV goes to the prefix cache) and re-queues it to resume where it stopped.

`MLXGW_FAIR_SHARE=off` in the gateway's environment turns tenants off (one FIFO by
(priority, arrival), as before) for A/B measurements."""

from __future__ import annotations

import heapq
import math
import os
from collections import Counter
from dataclasses import dataclass

from ...shared.protocol import BACKGROUND_PRIORITY

STARVE_S = 0.25  # a waiting request older than this may preempt a row over its share
MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0


def enabled_by_env() -> bool:
    return os.environ.get("MLXGW_FAIR_SHARE", "on").strip().lower() not in ("off", "0", "false", "no")


def clean_weight(weight: object) -> float:
    """A weight the policy can divide by: finite, within [MIN_WEIGHT, MAX_WEIGHT], else 1."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        return 1.0
    return min(MAX_WEIGHT, max(MIN_WEIGHT, float(weight)))


@dataclass
class Waiting:
    """One queued request, ordered within its tenant by priority, then deadline (arrival +
    its latency class's target: worker/schedule/latency.py), then arrival."""

    priority: int
    arrival: int
    rid: str
    tenant: str = ""
    weight: float = 1.0
    since: float = 0.0  # when it (re)joined the queue
    due: float = 0.0  # when its first token is owed (time.monotonic())
    target_s: float = 0.0  # its class's target time to first token
    left: int = 0  # prompt tokens it has to read (less the cached prefix, when queued)

    def __lt__(self, other: Waiting) -> bool:
        return (self.priority, self.due, self.arrival) < (other.priority, other.due, other.arrival)


@dataclass
class Row:
    """What the policy needs to know of a running row to pick a preemption victim."""

    rid: str
    tenant: str
    weight: float
    priority: int
    generated: int
    preemptible: bool
    prefilling: bool = False  # still reading its prompt (it takes a share of the prompt budget)
    target_s: float = 0.0  # its latency class's target time to first token
    reading: int = 0  # prompt tokens it has left to read


class FairQueue:
    """The waiting requests of one worker, per tenant."""

    def __init__(self, enabled: bool | None = None, starve_s: float = STARVE_S):
        self.enabled = enabled_by_env() if enabled is None else enabled
        self.starve_s = starve_s
        self._tenants: dict[str, list[Waiting]] = {}
        self.preemptions = 0  # lifetime, for stats

    def __len__(self) -> int:
        return sum(len(q) for q in self._tenants.values())

    def __bool__(self) -> bool:
        return any(self._tenants.values())

    def push(self, entry: Waiting) -> None:
        if not self.enabled:
            entry.tenant, entry.weight = "", 1.0
        heapq.heappush(self._tenants.setdefault(entry.tenant, []), entry)

    def pop(self, rows: list[Row]) -> Waiting | None:
        """The next request to admit given the rows running now, taken off the queue."""
        tenant = self._next_tenant(rows)
        if tenant is None:
            return None
        queue = self._tenants[tenant]
        entry = _pick(queue, rows)
        if entry is queue[0]:
            heapq.heappop(queue)
        else:
            queue.remove(entry)
            heapq.heapify(queue)
        if not queue:
            del self._tenants[tenant]
        return entry

    def peek(self, rows: list[Row]) -> Waiting | None:
        tenant = self._next_tenant(rows)
        return _pick(self._tenants[tenant], rows) if tenant is not None else None

    def _next_tenant(self, rows: list[Row]) -> str | None:
        heads = {t: q[0] for t, q in self._tenants.items() if q}
        if not heads:
            return None
        best = min(h.priority for h in heads.values())
        running = _running_per_tenant(rows)
        return min(
            (t for t, h in heads.items() if h.priority == best),
            key=lambda t: ((running[t] + 1) / heads[t].weight, heads[t].due, heads[t].arrival),
        )

    def victim(self, rows: list[Row], now: float) -> str | None:
        """A running row to pause for the request that would be admitted next, when that
        request has waited beyond the bound and a row is held beyond its tenant's share."""
        waiter = self.peek(rows)
        if waiter is None:
            return None
        running = _running_per_tenant(rows)
        # A tenant with nothing running waits for nobody: its first row is its share at once
        # (the flood-vs-one measurement: a 0.25 s wait is 14x an idle step on a small model).
        starved = running[waiter.tenant] == 0 or now - waiter.since >= self.starve_s
        waiter_share = (running[waiter.tenant] + 1) / waiter.weight

        # A request that has waited half its class's target takes a row of a less urgent
        # class (a keystroke behind a batch full of agent turns): the row resumes later.
        urgent = waiter.target_s > 0 and now >= waiter.due - waiter.target_s / 2

        def over(row: Row) -> bool:
            if row.priority >= BACKGROUND_PRIORITY > waiter.priority:
                return True  # background work yields to an interactive request at once
            if urgent and row.priority >= waiter.priority and row.target_s > waiter.target_s:
                return True
            if not starved or not self.enabled or row.tenant == waiter.tenant or row.priority < waiter.priority:
                return False
            return running[row.tenant] / row.weight > waiter_share

        candidates = [r for r in rows if r.preemptible and over(r)]
        if not candidates:
            return None
        # Background first, then the least urgent class, then the tenant furthest over its
        # share, then the row that has produced least (it loses least by a pause).
        pick = max(
            candidates,
            key=lambda r: (r.priority >= BACKGROUND_PRIORITY, r.target_s, running[r.tenant] / r.weight, -r.generated),
        )
        self.preemptions += 1
        return pick.rid

    def may_start_prefill(self, entry: Waiting, rows: list[Row]) -> bool:
        """Whether entry's tenant may start one more prompt-reading row. The prompt budget
        of a step is split evenly between the rows reading prompts, so rows are its shares:
        while another tenant has a prompt to read (waiting, or being read) in the same or
        a more urgent priority class, a tenant starts a row only within its weighted share
        of the rows reading prompts (rounded up: each tenant may always read one). Alone,
        a tenant may take every row."""
        if not self.enabled:
            return True
        weights = {entry.tenant: entry.weight}
        for tenant, queue in self._tenants.items():
            if queue and queue[0].priority <= entry.priority:
                weights.setdefault(tenant, queue[0].weight)
        reading = [r for r in rows if r.prefilling]
        for row in reading:
            if row.priority <= entry.priority:
                weights.setdefault(row.tenant, row.weight)
        if len(weights) == 1:
            return True
        share = (len(reading) + 1) * entry.weight / sum(weights.values())
        mine = sum(1 for r in reading if r.tenant == entry.tenant)
        return mine + 1 <= math.ceil(share - 1e-9)


def _pick(queue: list[Waiting], rows: list[Row]) -> Waiting:
    """The entry of a tenant's queue to admit next: of its most urgent entry's class (same
    priority and target), the one with the fewest tokens to read; the oldest (the most urgent)
    instead while no row of that class reads a prompt longer than that one."""
    head = queue[0]
    same_class = [w for w in queue if w.priority == head.priority and w.target_s == head.target_s]
    shortest = min(same_class, key=lambda w: (w.left, w.due, w.arrival))
    if shortest is head:
        return head
    long_read = any(
        r.reading > shortest.left for r in rows if r.priority == head.priority and r.target_s == head.target_s
    )
    return shortest if long_read else head


def _running_per_tenant(rows: list[Row]) -> Counter[str]:
    return Counter(r.tenant for r in rows)
