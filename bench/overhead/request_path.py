"""How far one request wanders through gateway/, then through worker/ and shared/: run a real
chat request (non-streamed and streamed) through an in-process gateway (make_app on aiohttp's
test server, a `null`-engine worker process behind it) and follow the request's handler task
with sys.setprofile; in the worker (a sitecustomize this bench puts on its PYTHONPATH), every
thread from the request's frame arriving on the worker's socket to the first token's frame.

A *stop* is a call from a function in one gateway file into a function in another (the
handler's own first frame counts as the first stop); a *re-entry* is a stop into a file the
request had already entered and left; a *call-back* is a stop into a file that is still on
the call stack above the caller (a lower module calling back up into its caller's module).
Only the handler's task is followed (the broker's and manager's own tasks are not), a frame
counts once however often its coroutine resumes, and code after the handler returns (aiohttp
writing a JSON body) is not counted. In the worker, whose threads (the socket's, the engine's,
the preparation's) loop while they wait, a stop counts once per (thread, caller file, callee
file, function), so a wait loop's turns are one stop.

Not a test and not a benchmark: a measurement of the code's shape, run ad hoc:
    mlxgw bench overhead request-path [--tokens 4] [--show 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ...shared.events import Delta

ROOT = Path(__file__).resolve().parent.parent.parent
GATEWAY = str(ROOT / "gateway") + os.sep
WORKER_SIDE = (str(ROOT / "worker") + os.sep, str(ROOT / "shared") + os.sep)


@dataclass
class Trace:
    """The stops of one request's handler task, in order."""

    task: asyncio.Task | None = None
    root: object = None  # the frame that awaits the handler: the walk up the stack stops there
    stops: list[tuple[str, str]] = field(default_factory=list)  # (file, function) entered
    reentries: int = 0
    callbacks: int = 0
    edges: set[tuple[str, str]] = field(default_factory=set)  # (caller file, callee file)
    callback_stops: list[str] = field(default_factory=list)  # "caller > callee:function"
    _seen: set[int] = field(default_factory=set)
    _frames: list = field(default_factory=list)  # keeps frames alive so their ids stay unique
    _files: dict[str, str | None] = field(default_factory=dict)
    sides: tuple[str, ...] = (GATEWAY,)  # the folders followed, the first one's parent stripped from names
    _keys: set | None = None  # the worker's: the stops counted already, by (thread, caller, file, function)

    def file_of(self, frame) -> str | None:
        """The frame's file relative to gateway/ (or the repository for the worker), None
        outside the folders followed (symlinks resolved)."""
        name = frame.f_code.co_filename
        if name not in self._files:
            real = os.path.realpath(name)
            base = GATEWAY if self.sides == (GATEWAY,) else str(ROOT) + os.sep
            self._files[name] = real[len(base) :] if real.startswith(self.sides) else None
        return self._files[name]

    def follows(self) -> bool:
        try:
            return asyncio.current_task() is self.task
        except RuntimeError:  # a thread without an event loop
            return False

    def profile(self, frame, event: str, arg) -> None:
        if event != "call" or id(frame) in self._seen:
            return
        mine = self.file_of(frame)
        if mine is None or not self.follows():
            return
        self._seen.add(id(frame))
        self._frames.append(frame)
        above = []  # gateway files on the stack, nearest caller first
        back = frame.f_back
        while back is not None and back is not self.root:
            theirs = self.file_of(back)
            if theirs is not None:
                above.append(theirs)
            back = back.f_back
        caller = above[0] if above else None
        if caller == mine:
            return
        if self._keys is not None:
            key = (threading.get_ident(), caller, mine, frame.f_code.co_name)
            if key in self._keys:
                return
            self._keys.add(key)
        if caller is not None:
            self.edges.add((caller, mine))
        if any(f == mine for f, _ in self.stops):
            self.reentries += 1
        if mine in above[1:]:
            self.callbacks += 1
            self.callback_stops.append(f"{caller} > {mine}:{frame.f_code.co_name}")
        self.stops.append((mine, frame.f_code.co_name))

    def summary(self) -> str:
        files = Counter(f for f, _ in self.stops)
        return (
            f"{len(self.stops)} stops in {len(files)} files, {self.reentries} re-entries, "
            f"{self.callbacks} call-backs, {len(self.edges)} distinct file-to-file edges"
        )

    def within(self, floors: tuple[str, ...]) -> str:
        """The same count over the stops in the given floors only (api/, pipeline/, mcp/: where
        a request is read, translated and answered), other floors' stops left out."""
        mine = [f for f, _ in self.stops if f.startswith(floors)]
        sequence = [f for i, f in enumerate(mine) if i == 0 or f != mine[i - 1]]
        return f"{len(sequence)} stops in {len(set(sequence))} files, {len(sequence) - len(set(sequence))} re-entries"

    def preamble(self) -> str:
        """The stops before the generation is made (models/generation.py first entered): the
        request read, checked and translated, where the API and pipeline floors meet."""
        end = next((i for i, (f, _) in enumerate(self.stops) if f == "models/generation.py"), len(self.stops))
        head = [f for f, _ in self.stops[:end]]
        return f"{len(head)} stops in {len(set(head))} files, {len(head) - len(set(head))} re-entries"


class WorkerTrace(Trace):
    """The worker half: every thread from a gateway frame to the first token frame that
    follows it, kept if a request was taken in between (a later frame starts over until then)."""

    def __init__(self, out: str):
        super().__init__(sides=WORKER_SIDE, _keys=set())
        self.out, self.state = out, "idle"

    def follows(self) -> bool:
        return self.state != "idle"

    def profile(self, frame, event: str, arg) -> None:
        name = frame.f_code.co_name if event == "call" else ""
        if name == "_on_gateway_frame" and self.state != "request":
            self.__init__(self.out)
            self.state = "frame"
        elif name == "_intake" and self.state == "frame":
            self.state = "request"
        super().profile(frame, event, arg)
        if name == "_send_events" and self.state == "request" and _has_delta(frame.f_locals["fields"]):
            with open(self.out, "a") as f:  # the first token's frame was the last stop
                f.write(json.dumps({"summary": self.summary(), "stops": self.stops}) + "\n")
            self.state = "idle"


def _has_delta(fields: dict) -> bool:
    return any(isinstance(event, Delta) for _, event in fields.get("items", ()))


def trace_worker(out: str) -> None:
    """Follow this worker process (called by the sitecustomize the bench writes)."""
    trace = WorkerTrace(out)
    threading.setprofile(trace.profile)
    sys.setprofile(trace.profile)


def _worker_traced(home: Path) -> Path:
    """A sitecustomize on the worker's PYTHONPATH that follows it into home/worker-path.jsonl."""
    (home / "site").mkdir()
    out = home / "worker-path.jsonl"
    (home / "site" / "sitecustomize.py").write_text(
        f"from mlxgw.bench.overhead.request_path import trace_worker\ntrace_worker({str(out)!r})\n"
    )
    os.environ["PYTHONPATH"] = str(home / "site") + os.pathsep + os.environ["PYTHONPATH"]
    return out


def _config() -> dict:
    return {
        "manager": {"auto_discover": False, "usage_ledger": False},
        "models": [{"name": "null", "engine": "null", "preload": True}],
    }


async def _run(tokens: int, show: int) -> None:
    import aiohttp
    from aiohttp.test_utils import TestServer
    from aiohttp.web import middleware

    from ...gateway.app import make_app
    from ...gateway.web import state
    from ...shared.config import parse_registry

    home = Path(tempfile.mkdtemp(prefix="mlxgw-trace-"))
    os.environ["MLXGW_HOME"] = str(home)
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    worker_out = _worker_traced(home)
    registry = parse_registry(_config())
    app = make_app(registry, state.GatewaySettings(), f"ipc://{home / 'gw.sock'}")
    current: list[Trace] = []

    @middleware
    async def traced(request, handler):  # innermost: `handler` is the route's own function
        if not current:
            return await handler(request)
        trace = current[0]
        trace.task, trace.root = asyncio.current_task(), sys._getframe()
        outer = trace.root  # the middlewares around this one resume with the handler: not stops
        while outer is not None:
            trace._seen.add(id(outer))
            outer = outer.f_back
        sys.setprofile(trace.profile)
        try:
            return await handler(request)
        finally:
            sys.setprofile(None)

    app.middlewares.append(traced)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    body = {"model": "null", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": tokens}
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):  # the worker loads in the background; wait for its first answer
                async with session.post(url, json=body) as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.5)
            for name, extra in (("non-streamed", {}), ("streamed", {"stream": True})):
                current[:] = [Trace()]
                async with session.post(url, json={**body, **extra}) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                trace = current.pop()
                print(f"{name} chat request ({tokens} tokens): {trace.summary()}")
                print(f"    until the generation is made: {trace.preamble()}")
                print(f"    in api/, pipeline/ and mcp/ only: {trace.within(('api/', 'pipeline/', 'mcp/'))}")
                print(f"    call-backs: {', '.join(trace.callback_stops) or 'none'}")
                for file, count in Counter(f for f, _ in trace.stops).most_common():
                    print(f"    {count:3d}  {file}")
                if show:
                    print("    first stops: " + " > ".join(f"{f}:{fn}" for f, fn in trace.stops[:show]))
                await asyncio.sleep(0.5)  # the worker writes its half when it sends the first token
                worker = json.loads(worker_out.read_text().splitlines()[-1])
                print(f"  worker, socket to first token: {worker['summary']}")
                for file, count in Counter(f for f, _ in worker["stops"]).most_common():
                    print(f"    {count:3d}  {file}")
                if show:
                    print("    first stops: " + " > ".join(f"{f}:{fn}" for f, fn in worker["stops"][:show]))
    finally:
        await server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4, help="max_tokens of each request")
    parser.add_argument("--show", type=int, default=0, help="print the first N stops of each request")
    args = parser.parse_args()
    asyncio.run(_run(args.tokens, args.show))


if __name__ == "__main__":
    main()
