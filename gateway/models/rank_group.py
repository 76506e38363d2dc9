"""The local ranks of a sharded model (models.yaml `distributed:`), as one worker handle.

The gateway starts every rank whose host is this machine, each with MLX_HOSTFILE and
MLX_RANK; rank 0 alone connects to the broker, so the rest of the gateway sees one worker.
The group lives and dies as one: when any rank exits, rank 0 gets a moment to end its
requests with the peer-lost error (its next collective raises), then every remaining rank
is killed, and the exit is reported as the group's (the lifecycle restarts it with backoff).
A planned stop signals rank 0 only: it drains, then tells the other ranks to exit."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...shared.model_sections import ModelEntry
from ...shared.platform import worker_environment

log = logging.getLogger(__name__)

PEER_LOST_GRACE_S = 5.0  # rank 0's time to end its requests after a peer died
FOLLOWERS_EXIT_S = 10.0  # the other ranks' time to exit after rank 0 did
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_local(host: str) -> bool:
    name = host.rpartition(":")[0].strip("[]")
    if name in LOCAL_HOSTS:
        return True
    try:
        import psutil

        return any(a.address == name for addrs in psutil.net_if_addrs().values() for a in addrs)
    except Exception:
        return False


def group_hosts(entry: ModelEntry) -> list[str]:
    d = entry.distributed
    assert d is not None
    return list(d.hosts) or [f"127.0.0.1:{_free_port()}" for _ in range(d.ranks)]


async def sharding_refusal(entry: ModelEntry, model_path: Path) -> str | None:
    """Why this model cannot be sharded as configured (strategy the architecture lacks,
    heads that do not divide), checked in a short-lived process before any rank starts:
    a refused configuration is an immediate, clear error instead of a crash loop."""
    assert entry.distributed is not None
    config = model_path / "config.json"
    key = (str(model_path), json.dumps(asdict(entry.distributed)), config.stat().st_mtime_ns if config.exists() else 0)
    if key not in _refusals:
        _refusals[key] = await _check_sharding(entry.name, model_path, key[1])
    return _refusals[key]


_refusals: dict[tuple, str | None] = {}  # (model, distributed, config.json mtime) -> refusal


async def _check_sharding(name: str, model_path: Path, distributed_json: str) -> str | None:
    cmd = [sys.executable, "-m", "mlxgw.worker.process.distributed", str(model_path), distributed_json]
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        env=worker_environment(use_openblas=False),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode == 0:
        return None
    if proc.returncode == 3:
        return out.decode(errors="replace").strip()
    log.warning("checking the sharding of %s failed: %s", name, err.decode(errors="replace")[-500:])
    return None  # the ranks will report it


@dataclass
class RankGroup:
    model: str
    worker_id: str
    procs: dict[int, asyncio.subprocess.Process]  # rank -> local process; rank 0 always here
    hostfile: Path
    start_timeout_s: float = 0.0
    _done: asyncio.Future | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    @property
    def running(self) -> bool:
        return any(p.returncode is None for p in self.procs.values())

    def start_watch(self) -> None:
        self._done = asyncio.ensure_future(self._watch())

    async def wait(self) -> int:
        assert self._done is not None
        return await asyncio.shield(self._done)

    def signal(self, sig: int) -> None:
        """SIGKILL ends every rank; any other signal goes to rank 0, which leads the others."""
        targets = self.procs.values() if sig == signal.SIGKILL else [self.procs[0]]
        for proc in targets:
            if proc.returncode is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    async def stop(self, grace_s: float) -> int:
        self.signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.wait(), grace_s)
        except asyncio.TimeoutError:
            log.warning("ranks of %s ignored SIGTERM; killing them", self.model)
            self.signal(signal.SIGKILL)
            return await self.wait()

    async def _watch(self) -> int:
        waits = {asyncio.ensure_future(p.wait()): rank for rank, p in self.procs.items()}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            first = min(waits[t] for t in done)
            leader = self.procs[0]
            code = self.procs[first].returncode
            if code == -signal.SIGALRM:
                log.error(
                    "rank %d of %s: the group did not form within distributed.start_timeout_s (%g s): "
                    "check that every rank was started and that the hosts' ports are reachable",
                    first,
                    self.model,
                    self.start_timeout_s,
                )
            if first != 0:
                log.error("rank %d of %s exited with code %s: ending the group", first, self.model, code)
                await self._wait_for(leader, PEER_LOST_GRACE_S)
            else:
                await asyncio.wait(waits, timeout=FOLLOWERS_EXIT_S)
            self.signal(signal.SIGKILL)
            await asyncio.gather(*waits)
        finally:
            self.hostfile.unlink(missing_ok=True)
        codes = {rank: p.returncode for rank, p in self.procs.items()}
        leader_code = codes[0]
        if leader_code == 0 and any(c != 0 for c in codes.values()):
            return next(c for c in codes.values() if c != 0)  # a follower failed: not a clean stop
        return leader_code

    @staticmethod
    async def _wait_for(proc: asyncio.subprocess.Process, timeout: float) -> None:
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            pass


def worker_command(endpoint: str, entry: ModelEntry, model_path: Path, worker_id: str, extra: list[str]) -> list[str]:
    """The command line of a worker process the gateway spawns (a model's worker, or one
    local rank of a sharded model: the rank comes from its environment)."""
    return [
        sys.executable,
        "-m",
        "mlxgw.worker",
        "--connect",
        endpoint,
        "--model",
        entry.name,
        "--model-path",
        str(model_path),
        "--entry",
        json.dumps(asdict(entry)),
        "--worker-id",
        worker_id,
        *extra,
    ]


async def spawn_group(endpoint: str, entry: ModelEntry, model_path: Path, worker_args: list[str]) -> RankGroup:
    """Start the local ranks (rank 0 with the broker link); the other hosts' ranks are
    started by hand there (`mlxgw worker --rank N`, see the README)."""
    hosts = group_hosts(entry)
    fd, name = tempfile.mkstemp(prefix=f"mlxgw-{entry.name}-", suffix=".hosts.json")
    with os.fdopen(fd, "w") as f:
        json.dump([[h] for h in hosts], f)
    worker_id = uuid.uuid4().hex
    procs: dict[int, asyncio.subprocess.Process] = {}
    try:
        for rank, host in enumerate(hosts):
            if rank != 0 and not _is_local(host):
                continue
            env = worker_environment(use_openblas=entry.use_openblas)
            env.update(MLX_HOSTFILE=name, MLX_RANK=str(rank))
            cmd = worker_command(endpoint, entry, model_path, worker_id, worker_args)
            procs[rank] = await asyncio.create_subprocess_exec(*cmd, env=env, stdin=asyncio.subprocess.DEVNULL)
    except BaseException:
        for proc in procs.values():
            proc.kill()
        Path(name).unlink(missing_ok=True)
        raise
    group = RankGroup(entry.name, worker_id, procs, Path(name), entry.distributed.start_timeout_s)
    group.start_watch()
    log.info("started ranks %s of %s (pids %s)", sorted(procs), entry.name, group.pids)
    return group
