"""`mlxgw bench` smoke test against the null engine: the tool works and reports figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_runs_against_the_null_engine_and_writes_reports(tiny_gateway, tmp_path):
    out = tmp_path / "smoke"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mlxgw.cli import main; main()",
            "bench",
            "--url",
            f"{tiny_gateway.url}/v1",
            "--model",
            "null",
            "--concurrency",
            "1,4",
            "--requests",
            "8",
            "--max-tokens",
            "16",
            "--compare",
            f"{tiny_gateway.url}/v1",
            "--compare-label",
            "again",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    assert [(r["server"], r["concurrency"]) for r in report["levels"]] == [
        ("mlxgw", 1),
        ("again", 1),
        ("mlxgw", 4),
        ("again", 4),
    ]
    for row in report["levels"]:
        assert row["completed"] == 8 and row["failed"] == 0
        assert row["output_tokens"] == 8 * 16
        assert row["ttft_p50_s"] is not None and row["output_tok_s"] > 0
    assert len(report["ratios"]) == 2
    assert "| server |" in out.with_suffix(".md").read_text()
