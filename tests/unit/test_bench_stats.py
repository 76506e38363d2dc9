"""The benches' statistics and method (bench/stats.py, bench/method.py, bench/report.py):
pure and fast, except one test that starts and stops a real busy loop."""

from __future__ import annotations

import time

import pytest

from mlxgw.bench import method as bench_method
from mlxgw.bench.method import UNSTABLE_EXIT, Method, busy_loops, rotated, spread_arg
from mlxgw.bench.report import merge_rounds, paired_ratio_rows
from mlxgw.bench.serving.peers import agent_markdown
from mlxgw.bench.stats import median, paired_ratios, percentile, relative_spread, summarize


def test_median_of_two_rounds_is_their_mean_not_the_upper_one():
    # The agent table's old statistic, sorted(values)[len // 2], reported 16.71 here.
    assert median([7.96, 16.71]) == pytest.approx(12.335)
    assert median([16.71, 7.96, 11.0, 12.0]) == pytest.approx(11.5)
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([]) is None
    assert median([None, 4.0]) == 4.0  # a round without a figure is dropped, not counted as 0


def test_percentiles_interpolate_between_ranks():
    values = [10.0, 20.0, 30.0, 40.0]
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile(values, 90) == pytest.approx(37.0)
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summary_keeps_every_round_in_order_with_mean_stdev_and_spread():
    s = summarize([60.3, 63.8, None, 58.0])
    assert s.rounds == (60.3, 63.8, 58.0)
    assert s.median == pytest.approx(60.3)
    assert s.mean == pytest.approx((60.3 + 63.8 + 58.0) / 3)
    assert s.stdev is not None and s.stdev > 0
    assert (s.low, s.high) == (58.0, 63.8)
    assert s.spread == pytest.approx((63.8 - 58.0) / 60.3)
    assert s.cell(1) == "60.3 (60.3, 63.8, 58.0)"
    assert summarize([5.0]).spread is None and summarize([5.0]).cell() == "5.00"
    assert relative_spread([0.0, 0.0]) is None


def test_spread_flags_rounds_that_disagree_beyond_the_limit_only():
    assert summarize([100.0, 104.0, 97.0]).unstable(0.10) is False
    assert summarize([7.96, 16.71]).unstable(0.10) is True
    assert summarize([7.96, 16.71]).unstable(None) is False
    assert spread_arg("10%") == pytest.approx(0.10) and spread_arg("0.25") == 0.25 and spread_arg("off") is None
    with pytest.raises(ValueError):
        spread_arg("-1")


def test_paired_ratios_pair_rounds_one_to_one():
    assert paired_ratios([10.0, 20.0], [5.0, 40.0]) == [2.0, 0.5]
    assert paired_ratios([10.0, None], [5.0, 4.0]) == [2.0, None]
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])


def test_rounds_rotate_the_order_and_record_their_load(capsys):
    assert [rotated("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    method = Method(rounds=3)
    seen = [order for _, order in method.each_round(["mlxgw", "peer"], log=lambda line: None)]
    assert seen == [["mlxgw", "peer"], ["peer", "mlxgw"], ["mlxgw", "peer"]]
    assert [log.round for log in method.logs] == [1, 2, 3]
    assert all(log.load_start is not None and log.load_end is not None for log in method.logs)
    assert "round 2: order peer -> mlxgw; load average" in method.logs[1].line()
    assert capsys.readouterr().err == ""  # 3 rounds: nothing to warn about
    list(Method(rounds=1).each_round(["a"], log=lambda line: None))
    assert "fewer than 3" in capsys.readouterr().err


def _row(server: str, c: int, rnd: int, tok_s: float, ttft: float) -> dict:
    return {
        "server": server,
        "concurrency": c,
        "round": rnd,
        "completed": 4,
        "failed": 0,
        "output_tokens": 64,
        "output_tok_s": tok_s,
        "ttft_p50_s": ttft,
    }


def test_merged_levels_are_true_medians_with_rounds_and_unstable_ones_flagged(capsys):
    rows = [
        _row("mlxgw", 8, 1, 60.3, 1.8),
        _row("peer", 8, 1, 63.8, 1.7),
        _row("peer", 8, 2, 64.0, 1.6),
        _row("mlxgw", 8, 2, 40.0, 2.4),
    ]
    method = Method(rounds=2, max_spread=0.10)
    levels = {r["server"]: r for r in merge_rounds(rows, method)}
    assert levels["mlxgw"]["output_tok_s"] == pytest.approx(50.15)  # not the upper round, 60.3
    assert levels["mlxgw"]["output_tok_s_rounds"] == [60.3, 40.0]
    assert levels["mlxgw"]["completed"] == 8 and levels["mlxgw"]["rounds"] == 2
    assert levels["mlxgw"]["unstable"] and levels["mlxgw"]["verdict"].startswith("UNSTABLE")
    assert not levels["peer"]["unstable"]
    ratios = paired_ratio_rows(rows, "mlxgw", "peer", method)
    assert ratios[0]["tok_s_ratio_rounds"] == [pytest.approx(60.3 / 63.8, abs=1e-3), pytest.approx(40 / 64, abs=1e-3)]
    assert ratios[0]["ttft_p50_ratio_rounds"][0] == pytest.approx(1.7 / 1.8, abs=1e-3)
    assert ratios[0]["unstable"]
    assert method.finish() == UNSTABLE_EXIT
    assert "not a result" in capsys.readouterr().err
    assert Method(rounds=3).finish() == 0


def test_agent_table_reports_the_true_median_every_round_and_paired_ratios():
    def run(rate: float, text: str = "same") -> dict:
        return {"decode_chunks_s": rate, "ttft_s": 14.0, "e2e_s": 30.0, "text": text}

    runs = {"mlxgw": [run(7.96), run(16.71)], "mlx_lm.server": [run(11.6), run(11.6, "other")]}
    table = agent_markdown(runs, Method(rounds=2, max_spread=0.10))
    mlxgw_row = next(line for line in table.splitlines() if line.startswith("| mlxgw |"))
    assert "12.34 (7.96, 16.71)" in mlxgw_row and "16.7 |" not in mlxgw_row
    assert "UNSTABLE" in mlxgw_row
    peer_row = next(line for line in table.splitlines() if line.startswith("| mlx_lm.server |"))
    assert "1.06 (0.69, 1.44)" in peer_row  # mlxgw / peer, round by round
    assert peer_row.endswith("| no |")


def test_busy_loops_run_for_the_block_and_stop_at_its_end():
    method = Method(rounds=3, busy=1)
    with method.busy_loops():
        with method.busy_loops():  # nested in the same run: still one loop, not two
            pass
        with busy_loops(0) as none:
            assert none == []
        assert method._busy_running
    with busy_loops(1, max_s=30) as procs:
        time.sleep(0.2)
        assert procs[0].poll() is None  # spinning
    assert procs[0].poll() is not None  # stopped with the block
    with pytest.raises(ValueError):
        bench_method.Method(busy=-1)


def test_speculation_table_pairs_rounds_and_catches_a_changed_greedy_text():
    from mlxgw.bench.speculation.matrix import identical, table

    def run(variant: str, rnd: int, tok_s: float, texts: dict) -> dict:
        return {
            "round": rnd,
            "workload": "agent",
            "concurrency": 8,
            "variant": variant,
            "failed": 0,
            "tok_s": tok_s,
            "ttft_p50_s": 1.0,
            "itl_p50_s": 0.1,
            "acceptance": 0.7 if variant == "spec-on" else None,
            "texts": texts,
        }

    same = {0: "a", 1: "b"}
    runs = [
        run("spec-off", 1, 10.0, same),
        run("spec-on", 1, 15.0, same),
        run("spec-on", 2, 14.0, same),
        run("spec-off", 2, 10.0, {0: "a", 1: "changed"}),
    ]
    assert identical(runs) == (1, 2)
    rows, md = table(runs, Method(rounds=2, max_spread=0.10))
    assert rows[0]["on_over_off"]["rounds"] == [1.5, 1.4]  # on / off within each round
    assert "1/2 NO" in md


def test_padding_share_counts_left_padding_of_the_decode_batch():
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlxgw.bench.step.breakdown import padding_share

    cache = BatchKVCache(left_padding=[0, 3, 1])
    cache.update_and_fetch(mx.zeros((3, 2, 4, 8)), mx.zeros((3, 2, 4, 8)))

    class Batch:
        prompt_cache = [cache]

    assert padding_share(Batch()) == pytest.approx(4 / 12)
    assert padding_share(object()) is None


def test_the_short_beside_long_table_gives_each_server_its_medians_ratio_and_rounds_within_the_goal():
    from mlxgw.bench.team.short_beside_long import goal_s, summary

    assert goal_s(0.5) == 2.0  # 3x alone + 0.5 s
    rows = [
        {"server": "mlxgw", "alone_s": 0.5, "beside_s": 1.5, "met": True},
        {"server": "mlxgw", "alone_s": 0.6, "beside_s": 2.5, "met": False},
        {"server": "mlxgw", "alone_s": 0.4, "beside_s": 1.2, "met": True},
        {"server": "peer", "alone_s": 0.5, "beside_s": None, "met": None},
    ]
    table = summary(rows).splitlines()
    assert table[2] == "| mlxgw | 0.50 (0.50, 0.60, 0.40) | 1.50 (1.50, 2.50, 1.20) | 3.0x | 2/3 |"
    assert table[3] == "| peer | 0.50 (0.50) | - (-) | - | 0/1 |"  # no first token beside: no ratio
