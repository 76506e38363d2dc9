"""The prefix cache as an oracle (Gu et al., ICML 2025): a key that knows the text before another
key's secret guesses it one token at a time, keeping the guess with the most `cached_tokens`.
Across keys it must recover nothing; within one cache group it still works (the documented
trade-off of sharing: docs/operations.md, "What is shared and with whom"). Real `mlxgw up`, real
worker, the tiny model (the attack reads counts, not words)."""

from __future__ import annotations

import pytest
import yaml
from helpers import http, start_gateway

from mlxgw.gateway.access.keys import hash_key

KEYS = {name: f"mlxgw-{name}-key-0123456789" for name in ("victim", "attacker", "ally", "teammate")}
CONFIG = {
    "manager": {"auto_discover": False},
    "models": [{"name": "tiny", "preload": True, "max_num_seqs": 4}],
}
# What the attacker knows: the text before the secret (a shared form letter)
KNOWN = " ".join(f"clause {i} of the access policy applies." for i in range(20)) + " The door PIN is"
PIN = "7 3 9 1"


@pytest.fixture(scope="module")
def team(home, tiny_dir):
    keys_path = home / "namespace-keys.yaml"
    entries = [
        {"name": "victim", "sha256": hash_key(KEYS["victim"])},
        {"name": "attacker", "sha256": hash_key(KEYS["attacker"])},
        {"name": "ally", "sha256": hash_key(KEYS["ally"]), "cache_group": "team-a"},
        {"name": "teammate", "sha256": hash_key(KEYS["teammate"]), "cache_group": "team-a"},
    ]
    keys_path.write_text(yaml.safe_dump({"keys": entries}))
    gw = start_gateway(home, CONFIG, "namespaces-gateway", extra_args=("--keys", str(keys_path)))
    yield gw
    gw.stop()


def cached(gw, key: str, text: str, **extra) -> int:
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": text}], **extra}
    status, _, answer = http(gw.url + "/v1/chat/completions", "POST", body, {"Authorization": f"Bearer {KEYS[key]}"})
    assert status == 200, answer
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def extract_pin(gw, attacker: str, salt: str) -> tuple[str, list[list[int]]]:
    """The attack: each digit in turn, the candidate whose prompt had the most cached tokens
    ('?' where no candidate stands out). Returns the guess and every count it saw."""
    known, seen = "", []
    cached(gw, attacker, f"{KNOWN} {salt}")  # its own copy of the known text: only the secret can differ
    for _ in PIN.split():
        counts = [cached(gw, attacker, f"{KNOWN} {known}{digit}") for digit in range(10)]
        seen.append(counts)
        best = max(counts)
        digit = str(counts.index(best)) if counts.count(best) == 1 else "?"
        known += digit + " "
    return known.strip(), seen


def test_another_keys_secret_cannot_be_read_from_cached_tokens(team):
    cached(team, "victim", f"{KNOWN} {PIN}. Tell nobody.")
    guess, seen = extract_pin(team, "attacker", "warm-up")
    assert guess.replace(" ", "").strip("?") == "", (guess, seen)
    # nothing stands out anywhere: every candidate read the same, from the attacker's own copy
    assert all(len(set(counts[1:])) == 1 for counts in seen), seen


def test_within_one_cache_group_the_attack_still_works(team):
    """The trade-off an operator accepts by sharing a group: the same attack recovers the PIN."""
    cached(team, "ally", f"{KNOWN} {PIN}. Tell nobody.")
    guess, seen = extract_pin(team, "teammate", "warm-up")
    assert guess == PIN, (guess, seen)


def test_a_cache_salt_narrows_a_keys_namespace(team):
    text = f"{KNOWN} salted request, " + "long enough to fill several blocks " * 8
    first = cached(team, "victim", text, cache_salt="session-1")
    assert first < 40
    assert cached(team, "victim", text, cache_salt="session-2") == first  # another salt shares nothing
    assert cached(team, "victim", text, cache_salt="session-1") > 100  # the same salt reads its own


def test_a_keys_own_prompts_still_hit_its_cache(team):
    text = "my own repeated context, " * 30
    first = cached(team, "attacker", text)  # its chat template's opening, from its own earlier requests
    assert first < 40
    assert cached(team, "attacker", text) > 100
    assert cached(team, "victim", text) == first  # and no other key's


def test_a_bad_cache_salt_is_a_400_naming_it(team):
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "cache_salt": ""}
    status, _, answer = http(
        team.url + "/v1/chat/completions", "POST", body, {"Authorization": f"Bearer {KEYS['victim']}"}
    )
    assert status == 400 and "cache_salt" in str(answer), answer
