"""Do the real agent CLIs finish on the first try against a running gateway?

Runs `claude -p`, `codex exec` and `opencode run` each --runs times against --url (a gateway
started by `make run` or `make run-agents`), each run in a fresh project folder and a fresh
client home, with the client settings docs/agents.md gives (raised idle timeouts; nothing
else). A run "finished" when the client exited 0 with an answer (Claude Code's JSON result
`subtype: success`). For --task hello the run also counts as done only when hello.py was
written and prints "hi". Per run: wall time, the requests the client sent and how each ended
(read from the gateway's usage ledger, $MLXGW_HOME/usage.db), and whether a tool was called.

    python -m mlxgw.bench.agents.first_try --url http://127.0.0.1:8000 --home ~/.cache/mlxgw \\
        --clients claude,codex,opencode --runs 3 --model smollm2-135m

Traffic goes only to the given gateway on 127.0.0.1; each run is bounded by --timeout."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..report import markdown_table

REPO = Path(__file__).resolve().parent.parent
NPM_BINS = [
    REPO / ".cache" / "npm-agents" / "node_modules" / ".bin",
    REPO / ".cache" / "npm-agents-extra" / "node_modules" / ".bin",
]
PROMPTS = {"hi": "Say hi", "hello": "Create hello.py that prints hi"}
# opencode's switches for a machine with no internet (tests/e2e/test_opencode_and_recorded_clients.py uses the same)
OPENCODE_OFFLINE = {
    f"OPENCODE_DISABLE_{name}": "1"
    for name in ("AUTOUPDATE", "MODELS_FETCH", "DEFAULT_PLUGINS", "LSP_DOWNLOAD", "SHARE", "CLAUDE_CODE")
}
IDLE_MS = "3600000"  # the clients' stream idle timeouts, raised above the longest prefill (docs/agents.md)


@dataclass
class Run:
    client: str
    run: int
    rc: int
    wall_s: float
    finished: bool
    requests: int = 0
    outcomes: list[str] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    tool_called: bool = False
    file_ok: bool | None = None
    tail: str = ""


def cli(name: str) -> str:
    for folder in NPM_BINS:
        if (folder / name).exists():
            return str(folder / name)
    sys.exit(f"{name} not found in {', '.join(map(str, NPM_BINS))}: run `make setup` / `make agents`")


def command(
    client: str, url: str, work: Path, home: Path, prompt: str, model: str, max_turns: int | None = None
) -> tuple[list[str], dict, str | None]:
    """The command, its environment and its stdin for one client (a fresh home each run)."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home)}
    if client == "claude":
        env |= {
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "unused",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": IDLE_MS,
            "API_TIMEOUT_MS": IDLE_MS,
        }
        turns = ["--max-turns", str(max_turns)] if max_turns else []
        flags = ["--output-format", "json", "--permission-mode", "acceptEdits", *turns]
        return [cli("claude"), "-p", prompt, *flags], env, None
    if client == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(
            'model_provider = "mlxgw"\n[model_providers.mlxgw]\nname = "mlxgw"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\nstream_idle_timeout_ms = {IDLE_MS}\n'
        )
        env["CODEX_HOME"] = str(codex_home)
        return [cli("codex"), "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access", prompt], env, None
    if client == "opencode":
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                "mlxgw": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "mlxgw",
                    "options": {"baseURL": f"{url}/v1", "timeout": False},
                    "models": {model: {"name": model}},
                }
            },
            "model": f"mlxgw/{model}",
        }
        (work / "opencode.json").write_text(json.dumps(config))
        # the prompt on stdin: `opencode run "<words>"` re-quotes an argument holding spaces
        return [cli("opencode"), "run"], env | OPENCODE_OFFLINE, prompt
    raise SystemExit(f"unknown client {client!r}")


# The API each client speaks: the ledger rows of a run are that API's, in the run's window
# (another client on the same gateway then cannot be counted as this one's).
CLIENT_API = {"claude": "messages", "codex": "responses", "opencode": "chat"}


def ledger_rows(home: Path, api: str, since: float, until: float) -> list[tuple]:
    db = home / "usage.db"
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return con.execute(
            "SELECT outcome, prompt_tokens FROM requests WHERE api = ? AND ts >= ? AND ts <= ? ORDER BY ts",
            (api, since, until),
        ).fetchall()


def finished(client: str, rc: int, stdout: str) -> bool:
    if rc != 0 or not stdout.strip():
        return False
    if client == "claude":
        try:
            return json.loads(stdout.strip().splitlines()[-1]).get("subtype") == "success"
        except json.JSONDecodeError:
            return False
    return True


def file_ok(work: Path) -> bool:
    target = work / "hello.py"
    if not target.exists():
        return False
    done = subprocess.run([sys.executable, str(target)], capture_output=True, text=True, timeout=30)
    return done.returncode == 0 and "hi" in done.stdout.lower()


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def run_once(client: str, n: int, args) -> Run:
    # One project folder per client, emptied before each run, as a user who runs the client
    # again in the same project: Claude Code and Codex write the working directory into their
    # system prompts, so a new folder each run would also be a new prompt from ~800 tokens on.
    # The client's home (sessions, settings) is fresh each run.
    root = args.workdir / client
    work, home = fresh(root / "project"), fresh(root / "home")
    cmd, env, stdin = command(client, args.url, work, home, PROMPTS[args.task], args.model, args.max_turns)
    started = time.time()
    try:
        done = subprocess.run(cmd, cwd=work, env=env, input=stdin, capture_output=True, text=True, timeout=args.timeout)
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    ended = time.time()
    time.sleep(1.5)  # the ledger commits finished requests within a second
    rows = ledger_rows(Path(args.home).expanduser(), CLIENT_API[client], started, ended + 1)
    run = Run(client, n, rc, round(ended - started, 1), finished(client, rc, out), tail=(out + err)[-400:])
    run.requests = len(rows)
    run.outcomes = [str(o) for o, _ in rows]
    run.prompt_tokens = [int(t or 0) for _, t in rows]
    run.tool_called = any(o in ("tool_calls", "tool_use") for o in run.outcomes)
    if args.task == "hello":
        run.file_ok = file_ok(work)
        run.finished = run.finished and run.file_ok
    return run


def table(runs: list[Run]) -> str:
    header = "client | run | finished | wall s | requests (outcomes) | prompt tokens | tool called | file written"
    rows = []
    for r in runs:
        outcomes = ", ".join(r.outcomes) or "-"
        file_cell = "" if r.file_ok is None else ("yes" if r.file_ok else "no")
        rows.append(
            [
                r.client,
                r.run,
                "yes" if r.finished else f"no (rc {r.rc})",
                f"{r.wall_s:.0f}",
                f"{r.requests} ({outcomes})",
                ", ".join(map(str, r.prompt_tokens)) or "-",
                "yes" if r.tool_called else "no",
                file_cell,
            ]
        )
    return markdown_table(header, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument(
        "--home", default=os.environ.get("MLXGW_HOME", "~/.cache/mlxgw"), help="the gateway's MLXGW_HOME (its usage.db)"
    )
    ap.add_argument("--clients", default="claude,codex,opencode")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--task", choices=sorted(PROMPTS), default="hi")
    ap.add_argument("--model", default="smollm2-135m", help="the model opencode is configured with")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument(
        "--max-turns",
        type=int,
        help="claude -p --max-turns: Qwen2.5-Coder-0.5B writes the file, then calls Write again each turn",
    )
    workdir = Path(tempfile.gettempdir()) / "mlxgw-agent-runs"
    ap.add_argument("--workdir", type=Path, default=workdir, help="the clients' project folders")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    runs = []
    for n in range(1, args.runs + 1):  # clients alternate, so each sees the same mix of cold and warm caches
        for client in args.clients.split(","):
            load = os.getloadavg()[0]
            run = run_once(client, n, args)
            runs.append(run)
            print(
                f"{client} run {n}: finished={run.finished} rc={run.rc} {run.wall_s:.0f}s load {load:.1f} "
                f"outcomes={run.outcomes}",
                flush=True,
            )
            if args.out:
                args.out.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    print(table(runs))


if __name__ == "__main__":
    main()
