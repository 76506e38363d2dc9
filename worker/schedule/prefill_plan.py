"""How much prompt processing one engine step does: a per-step token budget.

Every step runs one decode step for the rows already generating and one prefill chunk for
the rows still reading their prompts (mlx-lm's BatchGenerator). The prefilling rows are one
right-padded batch, so a step costs (rows prefilling) x (the longest chunk) token-passes,
padding included. Bounding that product by `budget` bounds how long decoding rows wait per
step, whatever arrives; the same budget decides how many new prompts start:

- each prefilling row gets a chunk of budget // rows tokens (at least 1);
- a waiting prompt is admitted, first come first served, while every prefilling row (itself
  included) would still finish its prompt in this step or get at least a quarter of the
  budget: short prompts arriving together start together (a 512 budget takes six 80-token
  prompts in one step), a long prompt reading its thousands of tokens still lets up to three
  short ones in beside it at the next step (it slows down, they do not wait for it), and no
  row is ever sliced so thin that nobody finishes; only rows of the prompt's own or a more
  urgent latency class count here (a less urgent read takes a thinner share instead), and
  a prompt counts what it has left to read after the prefix cache;
- when nothing is prefilling, the first waiting prompt is always admitted (progress);
- while no row is decoding, the rows being read share IDLE_BUDGET_FACTOR budgets a step
  (nobody waits on them but each other), but new prompts are still admitted by one budget:
  a prompt's first token comes at the end of the step that reads its last chunk, so a
  burst started a budget at a time has its first group decoding while the next is read.

On a slow or loaded host the same token budget can take minutes: a 2,048-token step of an
idle model's burst took over 120 s on a shared 2-core CPU, and the gateway's watchdog (one
engine step past 120 s is a hang) killed the worker mid-prefill. `PrefillPace` measures how
fast this host reads prompt tokens and caps each step's budget at what it reads in
MAX_PREFILL_STEP_S (0.5 s: a short request arriving during a long read waits for the step
in progress, and short steps read a long prompt about as fast as 10-s ones), or in
MAX_STEP_WHILE_DECODING_S while other rows decode (each of their tokens waits for the step:
a 512-token budget was 40 s per token for them on that host), so a step stays short wherever
it runs; on a fast host the cap is far above the budget and changes nothing. The bound
beside decoding rows is 4 s, not 2: the measured rate counted the decode in the step's time,
so at 2 s the cap bit below the budget on a 2-core host and the prompts arriving during a
closed loop's decoding were read in more, smaller chunks (c = 16 in-process,
bench/team/admission.py: TTFT p50 2.0 s at 4 s against 3.2 s at 2 s, tok/s equal, the
largest token gap 1.8-2.1 s at either).

While an editor's keystrokes are about (an editor-class request waiting or running, or one
arrived in the last EDITOR_RECENT_S), a step that reads prompts beside decoding rows takes
only what DECODE_STEPS_PER_PREFILL of their decode steps take (the decode step's time is
measured too: the runner times each step's prompt reading, and the rest of the step is its
decoding; a runner that does not time it leaves an average of the steps that read no prompt,
and the prompt rate net of that): the next keystroke waits a few decode steps for the step
in progress, not seconds, on any host; the long read still progresses every step (never
below MIN_PACED_BUDGET tokens). Within TYPING_S of a keystroke the step reads
TYPING_DECODE_STEPS decode steps' worth instead: the last key of a burst is owed its first
token within the pause, and waits for the step in progress and then its own. Without
keystrokes the step keeps its 4 s bound: paced to decode steps always, 24 agent sessions on
SmolLM2 (bench/team/sessions.py, 3 turns, no think time) had their warm turns' first token
after 67 s at p50 instead of 7 s, since a slower read of the first turns held the rows the
warm turns queued for.

The first step of a fresh worker has no measured rate, and on that same host its 512-token
step of a 0.5B model ran past 120 s: so it is bounded from the start (FIRST_STEP_BUDGET
tokens, a few seconds even there), and the steps after it are paced by the rate it measured.
The step bounds follow the watchdog's (`for_hang_timeout`): a gateway configured with a
short hang timeout gets proportionally shorter steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..model.interfaces import TextRunner
    from .sequence import Sequence

MIN_SHARE_DIVISOR = 4  # a long prompt keeps at least budget / 4 tokens per step
# A step with no row decoding: a request arriving meanwhile waits for it. A 20-token chat
# sent 0.5 s after a 6,000-token prompt got its first token after 16.4 s with 10-s steps (a
# twelfth of the hang bound, until 2026-12-06), 2.2-2.3 s with 1-s steps and 1.4 s with 0.5-s
# steps (alone: 0.45-0.54 s; mlxgw bench team short); a 4,000-token prompt alone read in
# 63-78 s, 54-58 s and 57-62 s (Qwen2.5-Coder-0.5B, this 2-core host).
MAX_PREFILL_STEP_S = 0.5
MAX_STEP_WHILE_DECODING_S = 4.0  # a decoding row's token waits at most this for a prefill chunk
MIN_PACED_BUDGET = 32  # below this a step's fixed cost dominates its prompt reading
FIRST_STEP_BUDGET = 64  # prompt tokens of the first step, before any rate is measured
HANG_TO_STEP = 12  # a paced step aims at this fraction of the watchdog's bound
IDLE_BUDGET_FACTOR = 4  # prompt budget of a step when no row is decoding (nobody waits on it)
DECODE_STEPS_PER_PREFILL = 4  # beside decoding rows and an editor a step reads this many decode steps' worth
TYPING_DECODE_STEPS = 1  # and while a typist types: a keystroke waits a step in progress, then its own
TYPING_S = 3.0  # a keystroke in the last TYPING_S: a burst's keys are 0.2 s apart, its pause 3 s
EDITOR_RECENT_S = 10.0  # a keystroke keeps steps short this long: a typist's burst is a few seconds apart
MIN_STEP_WHILE_DECODING_S = 0.25  # but never less (a fast host's steps are milliseconds)
# What a step may wait for requests that arrived before it to be prepared (templated and
# tokenized on their own thread), in decode steps and at most MAX_PREPARE_WAIT_S: a warm agent
# turn (a ~1,700-token chat) is prepared in tens of milliseconds, and not waiting for it cost it
# a whole step of the rows decoding (0.4 s beside 24 SmolLM2 rows on the 2-core host) before it
# was even queued; the rows decoding wait at most a tenth of their step for it.
PREPARE_WAIT_SHARE = 0.1
MAX_PREPARE_WAIT_S = 0.05


@dataclass
class PrefillPace:
    """Prompt tokens this host reads per second (smoothed over recent steps), and the
    budget that keeps a step within `max_step_s`."""

    max_step_s: float = MAX_PREFILL_STEP_S
    max_step_decoding_s: float = MAX_STEP_WHILE_DECODING_S
    tokens_per_s: float | None = None  # None until a step has read a prompt
    decode_s: float | None = None  # a step without prompt reading (EMA); None until one ran

    def observe(self, tokens: int, seconds: float, prompt_s: float | None = None, decoding: bool = True) -> None:
        """One step read `tokens` prompt tokens in `seconds`; prompt_s: the part of it spent
        reading them, where the runner times it (worker/model/runners/batch_generator.py), the
        rest being the decode step of the rows that generate (decoding: there were any)."""
        if seconds <= 0:
            return
        if prompt_s is not None and 0 <= prompt_s <= seconds:
            self._observe_parts(tokens, prompt_s, seconds - prompt_s, decoding)
            return
        if tokens <= 0:  # a decode step: what a prompt chunk beside decoding rows is measured by
            self._decoded(seconds)
            return
        # Untimed parts: the rate is of the step less a decode step's measured time (at least
        # half the step, which errs towards smaller steps).
        self._read(tokens / max(seconds / 2, seconds - (self.decode_s or 0.0)), tokens)

    def prepare_wait_s(self) -> float:
        """How long a step waits for new requests' preparation (0 until a decode step was
        measured; a step with no row decoding keeps no one waiting)."""
        return min(MAX_PREPARE_WAIT_S, PREPARE_WAIT_SHARE * self.decode_s) if self.decode_s else 0.0

    def _observe_parts(self, tokens: int, prompt_s: float, decode_s: float, decoding: bool) -> None:
        """Both parts measured: every step under load tells the decode step's time, not only
        the rare step that reads no prompt. (Inferred from those alone, it went stale: 24
        agents kept a prompt in every step, a one-row decode time from the start paced the
        steps beside three typists, and the budget sat at MIN_PACED_BUDGET with the host
        reading prompts at 60% of its rate.)"""
        if decoding:
            self._decoded(decode_s)
        if tokens > 0 and prompt_s > 0:
            self._read(tokens / prompt_s, tokens)

    def _decoded(self, seconds: float) -> None:
        self.decode_s = seconds if self.decode_s is None else 0.8 * self.decode_s + 0.2 * seconds

    def _read(self, rate: float, tokens: int) -> None:
        if self.tokens_per_s is None:
            self.tokens_per_s = rate
        elif tokens < MIN_PACED_BUDGET and tokens / rate <= MIN_PACED_BUDGET / self.tokens_per_s:
            # a few tokens' forward, no longer than the smallest step: mostly its fixed cost.
            # It nudges the rate, or one short step (a keystroke's last tokens) halved the
            # next step's budget; a few tokens that took longer are a slowdown, as below
            self.tokens_per_s = 0.9 * self.tokens_per_s + 0.1 * rate
        else:
            # the slower of the last two readings leads: a step that got slow (a longer
            # context, a busier host) shrinks the next one at once; recovery takes a step or two
            self.tokens_per_s = min(rate, (rate + self.tokens_per_s) / 2)

    @classmethod
    def for_hang_timeout(cls, hang_timeout_s: float | None) -> PrefillPace:
        """Step bounds at most a twelfth of the watchdog's (the defaults are below that for its default 120 s)."""
        if not hang_timeout_s or hang_timeout_s <= 0:
            return cls()
        step = hang_timeout_s / HANG_TO_STEP
        return cls(max_step_s=min(MAX_PREFILL_STEP_S, step), max_step_decoding_s=min(MAX_STEP_WHILE_DECODING_S, step))

    def cap(self, budget: int, decoding: bool = False, decode_steps: float = 0) -> int:
        """This step's budget: `budget` unless this host is too slow for it; before any rate
        is measured (a fresh worker's first prefill), FIRST_STEP_BUDGET at most.
        decoding: other rows are generating and wait for this step; decode_steps: an
        editor's requests are about, and a step reads what this many of their decode steps
        take (0: not paced), so the next keystroke does not wait for a long step."""
        if self.tokens_per_s is None:
            return min(budget, FIRST_STEP_BUDGET)
        return min(budget, max(MIN_PACED_BUDGET, int(self.tokens_per_s * self.step_s(decoding, decode_steps))))

    def step_s(self, decoding: bool, decode_steps: float = 0) -> float:
        """How long a step's prompt reading may take: beside decoding rows while an editor
        is about, the time of `decode_steps` decode steps (within MIN_STEP_WHILE_DECODING_S
        and max_step_decoding_s); beside decoding rows otherwise, max_step_decoding_s; else
        max_step_s."""
        if not decoding:
            return self.max_step_s
        if self.decode_s is None or not decode_steps:
            return self.max_step_decoding_s
        paced = max(MIN_STEP_WHILE_DECODING_S, decode_steps * self.decode_s)
        return min(self.max_step_decoding_s, paced)


def chunk_for(rows: int, budget: int) -> int:
    return max(1, budget // max(1, rows))


def step_chunk(remaining: list[int], budget: int, sizing: list[int] | None = None) -> int:
    """The chunk every prefilling row reads this step (tokens each has left to read). The
    rows are one right-padded batch, so a row that finishes its prompt here (a short one)
    still costs the longest chunk: beside a long read it yields the step instead. The step
    is sized to the short rows' need, but never below a MIN_SHARE_DIVISOR-th of the budget
    across the rows, so the long reads keep progressing: per second they read what an even
    split gives them, in shorter steps, and the short rows' first tokens come at the end of
    a step a quarter as long at most (worker/model/runners/batch_generator.py).
    sizing: the rows of the most urgent class reading (default: all): only one of them
    finishing sizes the step (an agent's last 9 tokens beside three file opens cut their
    reads to 9 tokens a step)."""
    chunk = chunk_for(len(remaining), budget)
    finishing = [r for r in (remaining if sizing is None else sizing) if r <= chunk]
    if not finishing or len(finishing) == len(remaining):
        return chunk
    floor = budget // (MIN_SHARE_DIVISOR * len(remaining))
    return max(1, min(chunk, max(max(finishing), floor)))


def fits(remaining: list[int], budget: int) -> bool:
    """Whether these prefilling rows (tokens left to read) can share one step's budget."""
    if len(remaining) <= 1:
        return True
    share = chunk_for(len(remaining), budget)
    floor = max(1, budget // MIN_SHARE_DIVISOR)
    return all(share >= min(r, floor) for r in remaining)


def admit_count(prefilling: list[int], waiting: list[int], budget: int) -> int:
    """How many of `waiting` (tokens to read, in admission order) start this step, given the
    rows already prefilling (tokens each has left)."""
    plan = [r for r in prefilling if r > 0]
    admitted = 0
    for need in waiting:
        if need <= 0:  # served whole from the prefix cache: nothing to read
            admitted += 1
            continue
        if plan and not fits(plan + [need], budget):
            break
        plan.append(need)
        admitted += 1
    return admitted


PREFILL_TIME_SLACK = 2.0  # a prompt gets twice what this host's measured rate says it needs


def prefill_bound(prompt_tokens: int, floor_s: float | None, tokens_per_s: float | None) -> float:
    """Queue + prompt processing bound: the configured one as a floor, or, for a prompt this
    host reads slower than that, twice the time its measured prefill rate needs (a stuck
    worker is the watchdog's business: it makes no progress)."""
    floor = floor_s or 0.0
    if not tokens_per_s:
        return floor
    return max(floor, PREFILL_TIME_SLACK * prompt_tokens / tokens_per_s)


@dataclass
class PrefillBudget:
    """One worker's per-step prompt budget over its running rows (the scheduler asks it).

    per_step: prompt tokens per step across the prefilling rows; None when the runner does
    not take a chunk size (every admitted prompt then reads the runner's own chunk per step,
    and nothing here limits admission)."""

    per_step: int | None
    pace: PrefillPace = field(default_factory=PrefillPace)
    idle_factor: int = IDLE_BUDGET_FACTOR
    step_budget: int = 0  # prompt tokens this step reads (start_step)
    chunk: int = 0  # prompt tokens per prefilling row in this step
    idle_admit_factor: int = 1  # budgets new prompts are admitted by while no row decodes
    admit_budget: int = 0  # prompt tokens this step admits new prompts by (start_step)
    decoding: bool = False  # a row generates in this step (start_step)

    @property
    def enabled(self) -> bool:
        return self.per_step is not None

    def start_step(self, rows: Iterable[Sequence], decode_steps: float = 0) -> None:
        """This step's budgets. The budget protects rows that are decoding. With none, the
        prompts being read only wait for each other, so they read `idle_factor` budgets a
        step (fewer, larger chunks); but new prompts are still admitted one budget at a
        time, because a prompt's first token comes at the end of the step that reads its
        last chunk (worker/model/runners/batch_generator.py): a burst admitted a budget at a time gets its
        first tokens group by group, where one step reading the whole burst gave every
        prompt in it the last one's wait."""
        budget = self.per_step or 0
        self.decoding = decoding = any(s.to_prefill == 0 for s in rows)
        self.step_budget = self.pace.cap(budget if decoding else budget * self.idle_factor, decoding, decode_steps)
        admit = budget if decoding else budget * min(self.idle_admit_factor, self.idle_factor)
        self.admit_budget = min(self.step_budget, self.pace.cap(admit, decoding, decode_steps))

    def fits(self, rows: Iterable[Sequence], seq: Sequence, left: int) -> bool:
        """Whether seq may start this step, with `left` prompt tokens to read (less what the
        prefix cache holds of it now: a keystroke whose file is cached reads its last line,
        not the file). Only the rows reading prompts of its own or a more urgent class count:
        a less urgent long read never keeps it out, it reads a thinner share of the steps
        while the urgent one reads (three file opens and then every keystroke waited minutes
        for four agents' first turns to finish reading, bench/team/day.py)."""
        if self.per_step is None:
            return True
        rivals = [s for s in rows if _urgency(s) <= _urgency(seq)]
        return admit_count(_left(rivals), [left - 1], self.admit_budget) == 1

    def share(self, rows: Iterable[Sequence], runner: TextRunner) -> int:
        """Share this step's budget among the rows still reading their prompts; returns the
        prompt tokens this step reads (what the pace is measured on)."""
        if self.per_step is None:
            return 0
        reading = [s for s in rows if s.to_prefill > 0]
        left = [s.to_prefill for s in reading]
        top = min((_urgency(s) for s in reading), default=None)
        urgent = [s.to_prefill for s in reading if _urgency(s) == top]
        self.chunk = step_chunk(left, self.step_budget, urgent)
        runner.set_prefill_chunk(self.chunk)
        return sum(min(n, self.chunk) for n in left)

    def observe(self, tokens: int, seconds: float, prompt_s: float | None) -> None:
        """The step ran: it read `tokens` prompt tokens in `seconds` (prompt_s of them reading)."""
        self.pace.observe(tokens, seconds, prompt_s, self.decoding)

    def count(self, rows: Iterable[Sequence]) -> None:
        """The runner read min(left, chunk) prompt tokens of every prefilling row."""
        if self.per_step is None:
            return
        for seq in rows:
            seq.to_prefill -= min(seq.to_prefill, self.chunk)


def _urgency(seq: Sequence) -> tuple[int, float]:
    """Lower is more urgent: its priority, then its latency class's target."""
    return seq.req.priority, seq.target_s


def _left(rows: Iterable[Sequence]) -> list[int]:
    return [s.to_prefill for s in rows if s.to_prefill > 0]
