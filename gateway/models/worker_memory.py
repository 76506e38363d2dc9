"""What a local worker's processes hold, measured by the gateway at each decision.

A worker's heartbeat reports its own RSS, a heartbeat old (seconds, on a busy host), and
leaves out the processes it starts: MLX's CPU backend compiles kernels with g++, and each
cc1plus held 100-112 MB (measured on Linux). A worker killed mid-compile leaves its
compilers running after it has exited. So the residency budget counts each worker's whole
process tree, read with psutil when it decides, and the processes of a worker that has
exited until they are gone: they are killed (they serve nobody), and a load waits for their
memory to be released, never only for the decision to evict.

A child that has forked but not yet exec'd shares its parent's pages copy-on-write: it
counts nothing (counted by RSS, a fork made two resident workers look like three)."""

from __future__ import annotations

import logging
import os
import signal

import psutil

log = logging.getLogger(__name__)


def _rss(proc: psutil.Process) -> int:
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return 0
        return int(proc.memory_info().rss)
    except psutil.Error:
        return 0


def _same_image(proc: psutil.Process, parent: psutil.Process | None) -> bool:
    """A fork that has not exec'd: the parent's command line, and its pages are the parent's."""
    try:
        return parent is not None and proc.cmdline() == parent.cmdline()
    except psutil.Error:
        return False


class ProcessTree:
    """A worker process and every process it started, as last seen."""

    def __init__(self, pid: int):
        self.root: psutil.Process | None = None
        try:
            proc = psutil.Process(pid)
            if proc.ppid() == os.getpid():  # only a process this gateway started is measured (or killed)
                self.root = proc
        except psutil.Error:
            pass
        self.known: dict[int, psutil.Process] = {}  # descendants ever seen, kept past the root's exit

    def _refresh(self) -> None:
        if self.root is None or not self.root.is_running():
            return  # exited (its pid may be another process's now): what was seen is what is left
        try:
            for child in self.root.children(recursive=True):
                self.known.setdefault(child.pid, child)
        except psutil.Error:
            pass  # the root has exited: what was seen of its tree is what is left

    def alive(self) -> list[psutil.Process]:
        self._refresh()
        procs = [p for p in self.known.values() if p.is_running()]
        self.known = {p.pid: p for p in procs}
        return procs

    def rss_bytes(self) -> int:
        """The tree's resident memory now (forks that have not exec'd count nothing)."""
        procs = self.alive()
        root = [self.root] if self.root is not None and self.root.is_running() else []
        by_pid = {p.pid: p for p in root + procs}
        total = sum(_rss(p) for p in root)
        for p in procs:
            try:
                parent = by_pid.get(p.ppid())
            except psutil.Error:
                continue
            if not _same_image(p, parent):
                total += _rss(p)
        return total

    def end_leftovers(self) -> list[psutil.Process]:
        """Once the worker has exited: kill what it left running; returns those, to be
        counted until they are gone."""
        procs = self.alive()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        if procs:
            log.info("ended %d process(es) a worker left running (pids %s)", len(procs), [p.pid for p in procs])
        return procs


class Leftovers:
    """Processes of exited workers, counted against the budget until they are gone."""

    def __init__(self) -> None:
        self.procs: list[psutil.Process] = []

    def add(self, procs: list[psutil.Process]) -> None:
        self.procs.extend(procs)

    def rss_bytes(self) -> int:
        self.procs = [p for p in self.procs if p.is_running() and _rss(p) > 0]
        return sum(_rss(p) for p in self.procs)
