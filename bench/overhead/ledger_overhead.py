"""The usage ledger's cost per request, measured without the network's noise:
`python -m mlxgw.bench.overhead.ledger_overhead [N]`.

Times the access log's hook (`record_request`: the row is built and queued) with the ledger
on and off, alternated, on the event loop's thread, then how long the writer thread takes to
commit those rows to SQLite (work done off the event loop, but on the same CPU)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from ...gateway.access.keys import ApiKey
from ...gateway.access.ledger import LEDGER, Ledger, record_request


def _request(app: web.Application) -> web.Request:
    request = make_mocked_request("POST", "/v1/chat/completions", app=app)
    request["rid"] = "req_0123456789abcdef01234567"
    request["key"] = ApiKey(name="alice", sha256="0" * 64, tpd=10**12)
    request["model"] = "null"
    return request


def hook_seconds(ledger: Ledger, n: int) -> float:
    app = web.Application()
    app[LEDGER] = ledger
    request = _request(app)
    started = time.perf_counter()
    for _ in range(n):
        record_request(request, 200, 0.0123)
    return time.perf_counter() - started


def main(n: int = 20000, rounds: int = 5) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        on = Ledger(Path(tmp) / "usage.db")
        on.start()
        off = Ledger(None)
        times = {"on": [], "off": []}
        for _ in range(rounds):  # alternated, so drift in the machine's load hits both
            times["off"].append(hook_seconds(off, n))
            times["on"].append(hook_seconds(on, n))
        on.close()  # commits what is queued
        rows = on.written
    per = {k: min(v) / n * 1e6 for k, v in times.items()}
    print(
        f"hook on the event loop, best of {rounds} x {n}: ledger on {per['on']:.2f} us, off {per['off']:.2f} us, "
        f"difference {per['on'] - per['off']:.2f} us per request"
    )
    print(
        f"writer thread: {rows} rows committed with {on.writer_cpu_s:.2f} s of CPU, "
        f"{on.writer_cpu_s / max(rows, 1) * 1e6:.2f} us per row"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=20000, help="requests timed per round")
    main(ap.parse_args().n)
