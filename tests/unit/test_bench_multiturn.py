"""The multi-turn and quantized-KV benches' tables: cold/warm paired per conversation with every
round shown, the goal judged on the worst round, greedy agreement counted against kv16 of the
same round (pure functions over recorded rounds; the benches themselves need servers)."""

from __future__ import annotations

from mlxgw.bench.agents.multiturn import markdown, system_prompt
from mlxgw.bench.method import Method
from mlxgw.bench.serving.kv_bits import table as kv_table


def test_multiturn_pairs_cold_and_warm_per_round_and_judges_the_goal_on_the_worst_round():
    runs = {
        "mlxgw": [{"ttft_s": [10.0, 0.5, 1.0, 0.4]}, {"ttft_s": [12.0, 0.4, 0.4, 0.4]}],
        "peer": [{"ttft_s": [10.0, 9.0, 11.0, 10.0]}, {"ttft_s": [8.0, 0.5, 0.5, 0.5]}],
    }
    method = Method(rounds=2, max_spread=0.10)
    md = markdown(runs, method, goal=10.0)
    mlxgw_row = next(line for line in md.splitlines() if line.startswith("| mlxgw"))
    peer_row = next(line for line in md.splitlines() if line.startswith("| peer"))
    assert "25.0 (20.0, 30.0)" in mlxgw_row and mlxgw_row.endswith("| yes |")  # 10/0.5, 12/0.4
    assert peer_row.endswith("| no |")  # one round at 1x: the goal is not met
    assert any(u.startswith("peer cold/warm") for u in method.unstable)


def test_multiturn_system_prompt_is_fresh_and_about_the_size_asked():
    class Words:  # a tokenizer of whitespace-separated words: enough to size the prompt
        def encode(self, text: str, add_special_tokens: bool = False) -> list[str]:
            return text.split()

    a, b = system_prompt(Words(), 800), system_prompt(Words(), 800)
    assert a != b and a.split()[2:] == b.split()[2:]  # only the nonce differs
    assert 800 <= len(a.split()) <= 820 and "read_file" in a


def test_kv_table_counts_agreement_with_kv16_of_the_same_round():
    def run(variant: str, rnd: int, tok_s: float, texts: dict) -> dict:
        return {"round": rnd, "variant": variant, "failed": 0, "tok_s": tok_s, "texts": texts}

    runs = [
        run("kv16", 1, 10.0, {0: "a", 1: "b"}),
        run("kv8", 1, 8.0, {0: "a", 1: "x"}),
        run("kv4", 1, 9.0, {0: "y", 1: "z"}),
        run("kv16", 2, 20.0, {0: "a", 1: "c"}),  # kv16's own text changed: compared per round
        run("kv8", 2, 16.0, {0: "a", 1: "c"}),
        run("kv4", 2, 18.0, {0: "y", 1: "z"}),
    ]
    memory = {"kv16": (100, 100.0), "kv8": (30, 30.0), "kv4": (20, 20.0)}
    md = kv_table(runs, memory, Method(rounds=2, max_spread=None))
    kv8 = next(line for line in md.splitlines() if line.startswith("| kv8"))
    assert "| 3/4 |" in kv8 and "0.30x" in kv8 and "0.800 (0.800, 0.800)" in kv8
    assert "| 0/4 |" in next(line for line in md.splitlines() if line.startswith("| kv4"))
