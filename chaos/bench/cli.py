"""``chaos-bench``: the project's benchmarks as one click group.

Subcommands are registered here; each lives in its own module of :mod:`chaos.bench`.
"""

from __future__ import annotations

import click

from chaos.bench.allreduce import allreduce_command
from chaos.bench.assign import assign_command
from chaos.bench.audit import audit_command
from chaos.bench.compress import compress_command
from chaos.bench.control import control_command
from chaos.bench.convergence import convergence_command
from chaos.bench.fuzz import fuzz_command
from chaos.bench.hetero import hetero_command
from chaos.bench.join_load import join_load_command
from chaos.bench.local_sim import local_sim_command
from chaos.bench.native import native_command
from chaos.bench.pool import pool_command
from chaos.bench.primitives import primitives_command
from chaos.bench.shard_cost import shard_cost_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Chaos benchmarks: each prints a table and writes JSON."""


main.add_command(allreduce_command)
main.add_command(local_sim_command)
main.add_command(assign_command)
main.add_command(control_command)
main.add_command(shard_cost_command)
main.add_command(native_command)
main.add_command(primitives_command)
main.add_command(pool_command)
main.add_command(fuzz_command)
main.add_command(hetero_command)
main.add_command(convergence_command)
main.add_command(audit_command)
main.add_command(compress_command)
main.add_command(join_load_command)

if __name__ == "__main__":  # pragma: no cover
    main()
