"""Local worker processes: spawn one per model, watch it, stop it without leaving orphans."""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

from ...shared.model_sections import ModelEntry
from ...shared.platform import worker_environment
from .rank_group import RankGroup, spawn_group, worker_command

log = logging.getLogger(__name__)


@dataclass
class WorkerProcess:
    model: str
    worker_id: str
    proc: asyncio.subprocess.Process

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    async def wait(self) -> int:
        return await self.proc.wait()

    def signal(self, sig: int) -> None:
        if self.running:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    async def stop(self, grace_s: float) -> int:
        """SIGTERM (the worker drains), then SIGKILL after the grace period."""
        self.signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.proc.wait(), grace_s)
        except asyncio.TimeoutError:
            log.warning("worker %s for %s ignored SIGTERM; killing it", self.pid, self.model)
            self.signal(signal.SIGKILL)
            return await self.proc.wait()


async def spawn_worker(
    endpoint: str,
    entry: ModelEntry,
    model_path: Path,
    *,
    heartbeat_s: float,
    liveness: int,
    hang_timeout_s: float = 120.0,
    replica: int = 0,
) -> WorkerProcess | RankGroup:
    flags = ["--heartbeat", str(heartbeat_s), "--liveness", str(liveness), "--hang-timeout", str(hang_timeout_s)]
    if entry.distributed is not None:  # a sharded model: its ranks, as one handle
        return await spawn_group(endpoint, entry, model_path, flags)
    worker_id = uuid.uuid4().hex
    cmd = worker_command(endpoint, entry, model_path, worker_id, flags)
    env = worker_environment(use_openblas=entry.use_openblas)
    if replica:  # replicas of one model keep their disk tiers apart (worker/model/cache/prefix_store.py)
        env["MLXGW_REPLICA"] = str(replica)
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdin=asyncio.subprocess.DEVNULL)
    log.info("started worker pid %d for %s (replica %d)", proc.pid, entry.name, replica)
    return WorkerProcess(entry.name, worker_id, proc)
