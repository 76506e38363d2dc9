"""`mlxgw bench` smoke test against the null engine: the tool works and reports figures; and
`mlxgw bench --help` lists every study, each bench a module that exists."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO


def test_bench_alternates_servers_over_rounds_and_writes_reports(tiny_gateway, tmp_path):
    out = tmp_path / "smoke"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mlxgw.cli import main; main()",
            "bench",
            "load",
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
            "--rounds",
            "2",
            "--max-spread",
            "0",  # any difference between rounds is "unstable": the run must say so and exit 3
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "this run is not a result" in result.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    assert [(r["server"], r["concurrency"]) for r in report["levels"]] == [
        ("mlxgw", 1),
        ("again", 1),
        ("mlxgw", 4),
        ("again", 4),
    ]
    # Two rounds, the second starting with the other server; levels are medians over both.
    assert [r["server"] for r in report["runs"]] == ["mlxgw", "again"] * 2 + ["again", "mlxgw"] * 2
    for row in report["levels"]:
        assert row["rounds"] == 2
        assert row["completed"] == 16 and row["failed"] == 0
        assert row["output_tokens"] == 16 * 16
        assert row["ttft_p50_s"] is not None and row["output_tok_s"] > 0
        assert len(row["output_tok_s_rounds"]) == 2  # every round kept beside the median
    assert len(report["ratios"]["again"]) == 2
    assert [log["order"] for log in report["method"]["round_logs"]] == [["mlxgw", "again"], ["again", "mlxgw"]]
    md = out.with_suffix(".md").read_text()
    assert "| server |" in md and "round 2: order again -> mlxgw; load average" in md
    assert "fewer than 3" in result.stderr  # two rounds verify nothing, and it says so
    assert "UNSTABLE" in md and report["method"]["unstable"]


def test_bench_level_progress_is_plain_lines_off_a_terminal_and_one_redrawn_line_on_one():
    import io

    from mlxgw.bench.loadgen import RequestResult
    from mlxgw.bench.progress import LevelProgress

    plain = io.StringIO()
    progress = LevelProgress("level 1/2 mlxgw c=4", 8, plain)
    for i in range(8):
        progress.update(RequestResult(ok=i != 3, status=200, tokens=16))
    progress.close()
    lines = plain.getvalue().splitlines()
    assert lines[0] == "level 1/2 mlxgw c=4: 8 requests"
    assert [line.split(": ")[1].split(",")[0] for line in lines[1:]] == ["2/8 done", "4/8 done", "6/8 done", "8/8 done"]
    assert "1 failed" in lines[-1]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    progress = LevelProgress("level 2/2 mlxgw c=8", 3, tty)
    for _ in range(3):
        progress.update(RequestResult(ok=True, status=200, tokens=5))
    progress.close()
    assert "\n" not in tty.getvalue() and "3/3 done" in tty.getvalue() and "[####" in tty.getvalue()


def test_bench_help_lists_every_study_and_every_bench_is_a_module():
    import importlib.util

    from click.testing import CliRunner

    from mlxgw.bench.studies import STUDIES
    from mlxgw.cli import main

    listed = CliRunner().invoke(main, ["bench", "--help"])
    assert listed.exit_code == 0, listed.output
    for study in STUDIES:
        assert study.name in listed.output
        group = CliRunner().invoke(main, ["bench", study.name, "--help"])
        for command, (module, _) in study.benches.items():
            assert command in group.output, (study.name, command)
            assert importlib.util.find_spec(f"mlxgw.bench.{module}") is not None, module
    assert "load" in listed.output


def test_team_sessions_study_reports_every_turn_the_cache_tiers_and_peak_memory(tiny_dir, tmp_path):
    """The team study (bench/team/sessions.py) from one command on a tiny model: mlxgw with
    and without its disk tier, a cache byte bound; no request lost, each server's peak RSS,
    and where mlxgw's prompt tokens came from."""
    out = tmp_path / "team"
    args = ["--sessions", "2", "--turns", "2", "--system-words", "120", "--own-words", "40", "--turn-words", "10"]
    args += ["--max-tokens", "4", "--think-s", "0", "--cache-mb", "64", "--no-disk", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "mlxgw.bench.team.sessions", str(tiny_dir), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report["rows"]) == {"mlxgw", "mlxgw-nodisk"}
    for label, rounds in report["rows"].items():
        (study,) = rounds
        assert len(study["rows"]) == 4 and not any("error" in r for r in study["rows"]), study
        assert study["peak_rss_bytes"] > 50 << 20 and study["tiers"]["prompt"] > 0, (label, study)
    md = out.with_suffix(".md").read_text()
    assert "| mlxgw-nodisk | 1 | 2 | 2 | 0 |" in md and "RAM / disk" in md, md
