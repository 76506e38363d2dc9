"""A host made slow on purpose: the real runner, where reading a prompt token takes longer."""

from __future__ import annotations

import time

SECONDS_PER_TOKEN = 0.002  # a host that reads at most 500 prompt tokens a second


class SlowHost:
    """The real runner; each step then sleeps what its prompt tokens cost on the slow host,
    and that time counts in the step's timed prompt reading (`prompt_s`), as a real slow
    host's forward does."""

    def __init__(self, runner, seconds_per_token: float = SECONDS_PER_TOKEN):
        self.runner, self.seconds_per_token = runner, seconds_per_token
        self.reads: list[int] = []  # prompt tokens read by each step

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def step(self):
        before = self.runner.generator.prompt_tokens_read
        out = self.runner.step()
        read = self.runner.generator.prompt_tokens_read - before
        time.sleep(read * self.seconds_per_token)
        if out.prompt_s is not None:
            out.prompt_s += read * self.seconds_per_token
        self.reads.append(read)
        return out
