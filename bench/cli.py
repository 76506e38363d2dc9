"""`mlxgw bench <study> <bench> [ARGS]`: every bench behind one command.

`mlxgw bench load` load-tests an OpenAI-compatible server (optionally against others); the
studies (bench/studies.py) are groups whose commands run a bench module with the rest of the
command line, as `python -m mlxgw.bench.<study>.<bench>` would.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import click

from .studies import STUDIES, Study

PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks: `load` for any OpenAI-compatible server, and the studies (each a group of
    benches; `mlxgw bench STUDY BENCH --help` shows a bench's own options). bench/README.md
    has the method, each study's README its current figures and their commands."""


def run_module(module: str, args: list[str]) -> None:
    """Run mlxgw.bench.<module> as `python -m` would, with `args` as its command line."""
    name = f"mlxgw.bench.{module}"
    sys.argv = [f"python -m {name}", *args]
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def study_group(study: Study) -> click.Group:
    group = click.Group(study.name, help=study.summary, short_help=study.summary)
    for command, (module, line) in study.benches.items():

        @click.pass_context
        def run(ctx: click.Context, module: str = module) -> None:
            run_module(module, ctx.args)

        help_text = (
            f"{line}\n\n`python -m mlxgw.bench.{module}`; its options: `mlxgw bench {study.name} {command} --help`."
        )
        group.add_command(
            click.Command(command, callback=run, help=help_text, short_help=line, context_settings=PASS_THROUGH)
        )
    return group


@bench.command("load")
@click.option("--url", default="http://127.0.0.1:8000/v1", show_default=True, help="OpenAI base URL")
@click.option("--model", required=True)
@click.option("--label", default="mlxgw", show_default=True)
@click.option("--api-key", envvar="MLXGW_BENCH_KEY", default=None, help="bearer key for the first server")
@click.option("--compare-api-key", default=None, help="bearer key for the other servers")
@click.option("--compare", "compare_url", multiple=True, help="another server's base URL, run alternately (repeatable)")
@click.option("--compare-model", multiple=True, help="model name on each --compare server (default: --model)")
@click.option("--compare-label", multiple=True, help="label of each --compare server (default: peer, peer2...)")
@click.option("--rounds", default=3, show_default=True, help="repeat the sweep, rotating the servers' order")
@click.option(
    "--max-spread",
    default="10%",
    show_default=True,
    help="exit 3 and say so when a figure's rounds differ by more than this share of its median ('off': never)",
)
@click.option("--busy", default=0, show_default=True, help="N fixed CPU busy loops running beside every server")
@click.option("--concurrency", default="1,4,8", show_default=True, help="comma-separated levels")
@click.option("--requests", default=0, help="requests per level (default: 2 x concurrency, >= 4)")
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--prompt-words", default=40, show_default=True)
@click.option("--prompt-words-max", default=None, type=int, help="sample prompt lengths up to this")
@click.option("--temperature", default=0.7, show_default=True)
@click.option("--no-stream", is_flag=True, help="non-streaming requests")
@click.option("--fixed-prompt", is_flag=True, help="the same prompt every time (measures caches)")
@click.option("--prefix-words", default=0, help="also run the shared-prefix workload with this prefix")
@click.option("--prefix-repeats", default=4, show_default=True)
@click.option(
    "--seed",
    default=None,
    type=int,
    help="prompt seed (default: random per run, so no server answers from an earlier run's cache)",
)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="write OUT.json and OUT.md")
def load(
    url,
    model,
    label,
    api_key,
    compare_api_key,
    compare_url,
    compare_model,
    compare_label,
    rounds,
    max_spread,
    busy,
    concurrency,
    requests,
    max_tokens,
    prompt_words,
    prompt_words_max,
    temperature,
    no_stream,
    fixed_prompt,
    prefix_words,
    prefix_repeats,
    seed,
    out,
) -> None:
    """Load-test an OpenAI-compatible server (and optionally compare it with a second one)."""
    from .method import Method, spread_arg
    from .run import BenchConfig, Target, run

    if seed is None:
        import random

        seed = random.randrange(1 << 30)
    targets = [Target(label, url, model, api_key)]
    for i, peer_url in enumerate(compare_url):
        peer_label = compare_label[i] if i < len(compare_label) else ("peer" if i == 0 else f"peer{i + 1}")
        peer_model = compare_model[i] if i < len(compare_model) else model
        targets.append(Target(peer_label, peer_url, peer_model, compare_api_key))
    cfg = BenchConfig(
        concurrency=[int(c) for c in concurrency.split(",")],
        requests=requests,
        max_tokens=max_tokens,
        prompt_words=prompt_words,
        prompt_words_max=prompt_words_max,
        temperature=temperature,
        stream=not no_stream,
        fixed_prompt=fixed_prompt,
        prefix_words=prefix_words,
        prefix_repeats=prefix_repeats,
        seed=seed,
        rounds=rounds,
    )
    try:
        method = Method(rounds=rounds, max_spread=spread_arg(max_spread), busy=busy)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    report = run(targets, cfg, out, method=method)
    click.echo(report["markdown"])
    if any(r["failed"] for r in report["levels"]):
        sys.exit(1)
    sys.exit(report["exit_status"])


for _study in STUDIES:
    bench.add_command(study_group(_study))
