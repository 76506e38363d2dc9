"""The one `mlxgw` command: wires the gateway's, the worker's and the bench's commands.

Each part defines its own commands and imports nothing of the others; heavy imports (MLX)
stay inside the commands that need them.
"""

from __future__ import annotations

import click

from mlxgw.bench.cli import bench
from mlxgw.gateway.cli.admin import keys, service, usage
from mlxgw.gateway.cli.audit import audit
from mlxgw.gateway.cli.launch.cli import launch
from mlxgw.gateway.cli.serve import reload, status_cmd, up
from mlxgw.worker.process.cli import models, worker


@click.group()
@click.version_option(package_name="mlxgw")
def main() -> None:
    """mlxgw: a team LLM server: one gateway, one MLX worker process per model."""


for command in (up, reload, keys, usage, audit, service, models, worker, bench, launch):
    main.add_command(command)
main.add_command(status_cmd, name="status")
main.add_command(status_cmd, name="ps")

if __name__ == "__main__":
    main()
