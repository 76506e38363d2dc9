"""Process hygiene of `mlxgw up`: the port is checked before any worker starts, run files
left by a killed gateway (ipc sockets, pid files) are cleaned at start, and `mlxgw reload`
finds the gateway on a port even when its pid file is stale or gone."""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path

import psutil

from ..shared import paths

log = logging.getLogger(__name__)


class PortBusy(RuntimeError):
    pass


def pid_file(port: int) -> Path:
    return paths.run_dir() / f"gateway-{port}.pid"


def check_port(host: str, port: int) -> None:
    """Raise PortBusy when (host, port) cannot be listened on (same options as aiohttp's site)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "it is in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise PortBusy(f"cannot listen on {host}:{port}: {why}") from None


def is_gateway(pid: int) -> bool:
    """True when pid is a running `mlxgw up` of this user (never signal a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    return "up" in cmdline and any("mlxgw" in part for part in cmdline)


def write_pid_file(port: int) -> Path:
    path = pid_file(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(os.getpid()))
    return path


def remove_pid_file(path: Path) -> None:
    """Remove the pid file only while it is still ours (another gateway may own it now)."""
    try:
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except OSError:
        pass


def _stale_socket(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:
            return False
    return False


def _owner_alive(sock: Path) -> bool:
    """Whether the socket's name (gateway-PID-HEX.sock) names a running gateway: several
    gateways may share one MLXGW_HOME, and one busy or paused must keep its socket."""
    parts = sock.stem.split("-")
    if len(parts) < 3 or not parts[1].isdigit():
        return False  # an older name: only the connect test decides
    pid = int(parts[1])
    return pid == os.getpid() or is_gateway(pid)


def clean_stale_run_files(run_dir: Path | None = None) -> list[Path]:
    """Remove ipc sockets nobody listens on and pid files of processes that are gone;
    another running gateway's files are never touched."""
    run_dir = run_dir or paths.run_dir()
    removed: list[Path] = []
    for sock in run_dir.glob("gateway-*.sock"):
        if not _owner_alive(sock) and _stale_socket(sock):
            sock.unlink(missing_ok=True)
            removed.append(sock)
    for pidf in run_dir.glob("gateway-*.pid"):
        try:
            pid = int(pidf.read_text().strip())
        except (OSError, ValueError):
            pid = -1
        if pid <= 0 or not is_gateway(pid):
            pidf.unlink(missing_ok=True)
            removed.append(pidf)
    if removed:
        log.info("removed %d stale run files left by a gateway that did not stop cleanly", len(removed))
    return removed


def _listening_pid(port: int) -> int | None:
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid and is_gateway(c.pid):
            return c.pid
    return None


def find_gateway(port: int) -> tuple[int | None, str]:
    """The pid of the gateway serving `port`, and a note on how it was found."""
    path = pid_file(port)
    note = ""
    try:
        pid = int(path.read_text().strip())
        if is_gateway(pid):
            return pid, ""
        path.unlink(missing_ok=True)
        note = f" (removed a stale pid file left by process {pid})"
    except FileNotFoundError:
        note = f" (no pid file at {path})"
    except (OSError, ValueError):
        path.unlink(missing_ok=True)
        note = " (removed an unreadable pid file)"
    pid = _listening_pid(port)
    if pid is not None:
        path.write_text(str(pid))
        return pid, " (found by its port; the pid file is written again)"
    return None, note
