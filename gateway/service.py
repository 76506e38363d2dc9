"""`mlxgw service`: run the gateway at boot, with launchd on macOS and systemd on Linux.

The unit and plist templates live in deploy/; this module renders and installs them."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

from ..shared import paths
from ..shared.platform import IS_MACOS
from ..shared.resources import shipped_file

DEPLOY = shipped_file("deploy", "")
LABEL = "com.mlxgw.gateway"


@dataclass
class ServiceSpec:
    program: list[str]  # the full `mlxgw up ...` command line
    workdir: Path
    home: Path
    system: bool = False  # Linux: a system unit instead of a user unit


def default_program(config: Path | None, host: str, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    exe = shutil.which("mlxgw") or str(Path(sys.executable).with_name("mlxgw"))
    args = [exe, "up", "--host", host, "--port", str(port)]
    if config is not None:
        args += ["--config", str(config.resolve())]
    return args + list(extra)


def render_plist(spec: ServiceSpec) -> str:
    args = "\n".join(f"    <string>{escape(a)}</string>" for a in spec.program)
    log_dir = spec.home / "logs"
    return Template((DEPLOY / "launchd.plist.template").read_text()).substitute(
        label=LABEL,
        program_arguments=args,
        workdir=escape(str(spec.workdir)),
        home=escape(str(spec.home)),
        path=escape(os.environ.get("PATH", "/usr/bin:/bin")),
        log_dir=escape(str(log_dir)),
    )


def render_unit(spec: ServiceSpec) -> str:
    return Template((DEPLOY / "mlxgw.service.template").read_text()).substitute(
        workdir=str(spec.workdir),
        home=str(spec.home),
        exec_start=shlex.join(spec.program),
        wanted_by="multi-user.target" if spec.system else "default.target",
    )


def target_path(system: bool) -> Path:
    if IS_MACOS:
        return Path.home() / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    if system:
        return Path("/etc/systemd/system/mlxgw.service")
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "systemd" / "user" / "mlxgw.service"


def render(spec: ServiceSpec) -> str:
    return render_plist(spec) if IS_MACOS else render_unit(spec)


def _run(cmd: list[str]) -> int:
    print("$", shlex.join(cmd))
    return subprocess.run(cmd, check=False).returncode


def activate(path: Path, system: bool) -> int:
    if IS_MACOS:
        (paths.home() / "logs").mkdir(parents=True, exist_ok=True)
        return _run(["launchctl", "bootstrap", f"gui/{os.getuid()}", str(path)])
    if not shutil.which("systemctl"):
        print("systemctl not found: the unit is written but not started")
        return 0
    scope = [] if system else ["--user"]
    return _run(["systemctl", *scope, "daemon-reload"]) or _run(["systemctl", *scope, "enable", "--now", "mlxgw"])


def deactivate(path: Path, system: bool) -> int:
    if IS_MACOS:
        return _run(["launchctl", "bootout", f"gui/{os.getuid()}", str(path)])
    if not shutil.which("systemctl"):
        return 0
    scope = [] if system else ["--user"]
    return _run(["systemctl", *scope, "disable", "--now", "mlxgw"])


def status(system: bool) -> int:
    if IS_MACOS:
        return _run(["launchctl", "print", f"gui/{os.getuid()}/{LABEL}"])
    if not shutil.which("systemctl"):
        print("systemctl not found")
        return 1
    return _run(["systemctl", *([] if system else ["--user"]), "status", "--no-pager", "mlxgw"])
