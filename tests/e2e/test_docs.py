"""The commands the docs show are true: every shell block of README.md, ARCHITECTURE.md and
docs/*.md runs against a real `mlxgw up`, or is marked with the reason it cannot run here.

Unmarked blocks run in bash against one gateway serving the docs' own model names
(`smollm2-135m` is the tiny random model with short answers, `minilm-l6` the real
embedding model), with the stand-ins described in tests/helpers/doc_commands.py. Every
`mlxgw` command, marked or not, is parsed by the real command line, so a renamed flag or a
wrong value fails here. README.md must stay a front door (at most 300 lines)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, TESTS, start_gateway
from helpers.doc_commands import RUNNABLE, Block, broken_links, commands, mlxgw_args, parse, shell_blocks, stray_marks

DOC_FILES = [REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCKS = [block for path in DOC_FILES for block in shell_blocks(path)]
UNMARKED = [block for block in BLOCKS if block.mark is None]
MIN_REASON = 10  # characters: a reason a reader can act on, not "todo"

# bash stand-ins: curl fails on HTTP errors and reaches the test's gateway; mlxgw is parsed
# by the real CLI (and runs where that is safe); make only proves its targets expand.
PRELUDE = r"""
set -eo pipefail  # no -u: a block may name the reader's variables ($METRICS_TOKEN)
curl() { command curl --fail-with-body -sS --max-time 120 "${@//127.0.0.1:8000/127.0.0.1:$DOC_PORT}"; echo; }
mlxgw() { "$DOC_PYTHON" -m helpers.doc_commands "$@"; }
make() { command make -n -C "$DOC_REPO" "$@" > /dev/null; }
"""


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail to docs/"


def test_the_docs_have_shell_blocks_to_check():
    assert len(BLOCKS) >= 20 and len(UNMARKED) >= 8, (len(BLOCKS), len(UNMARKED))


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark], ids=lambda b: b.where)
def test_a_marked_block_says_why(block: Block):
    assert len(block.reason) >= MIN_REASON, f"{block.where}: `<!-- {block.mark}: WHY -->` needs its reason"


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_every_mark_marks_a_shell_block(path: Path):
    assert stray_marks(path) == [], f"{path.name}: marks with no shell block under them"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_every_mlxgw_command_parses_with_the_real_cli(block: Block):
    for words in commands(block):
        args = mlxgw_args(words)
        if args is not None:
            parse(args)  # raises click's UsageError naming the flag or value


@pytest.mark.parametrize("block", UNMARKED, ids=lambda b: b.where)
def test_an_unmarked_block_runs_only_what_a_test_can(block: Block):
    for words in commands(block):
        name = "mlxgw" if mlxgw_args(words) is not None else words[0]
        assert name in RUNNABLE, f"{block.where}: `{name}` cannot run in a test; mark the block with why"


@pytest.fixture(scope="module")
def docs_gateway(tmp_path_factory, tiny_dir, minilm_dir):
    """`mlxgw up` in a home of its own (its keys and ledger touch no other test), serving the
    names the docs use; answers are short so every block runs in seconds."""
    home = tmp_path_factory.mktemp("docs-home")
    config = {
        "gateway": {"max_tokens_cap": 8},
        "manager": {"auto_discover": False},
        "models": [
            {"name": "smollm2-135m", "source": str(tiny_dir), "preload": True, "max_num_seqs": 4},
            {"name": "minilm-l6", "source": str(minilm_dir), "kind": "embedding", "preload": True},
        ],
    }
    gw = start_gateway(home, config, "docs-gateway")
    yield gw, home
    gw.stop()


@pytest.mark.parametrize("block", UNMARKED, ids=lambda b: b.where)
def test_an_unmarked_block_runs(block: Block, docs_gateway, tmp_path):
    gw, home = docs_gateway
    env = dict(
        os.environ,
        DOC_PORT=str(gw.port),
        DOC_PYTHON=sys.executable,
        DOC_REPO=str(REPO),
        DOC_GATEWAY_HOME=str(home),
        DOC_SCRATCH_HOME=str(tmp_path),  # keys made by a block go here, never into a served home
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    script = PRELUDE + block.text.replace(".venv/bin/mlxgw", "mlxgw")
    result = subprocess.run(
        [shutil.which("bash") or "bash", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{block.where} failed ({result.returncode}):\n{block.text}\n{output}"


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_every_relative_link_resolves(path: Path):
    assert broken_links(path) == [], f"{path.name}: links to a missing file or heading"
