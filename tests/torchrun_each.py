"""Several tiny training runs on N ranks in ONE torchrun launch: a launch and its imports cost more than the runs.

:func:`torchrun_each` writes each config and launches this file under ``torchrun --standalone``; every worker opens
one process group and then, for each config in turn, builds and fits the trainer the CLI builds
(``build_trainer(config, env).fit()`` — what ``torchrun -m distillery.cli.train --config PATH`` does for one).
The CLI itself under torchrun is tests/test_distributed.py's ``torchrun``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import torchrun_command, write_config


def torchrun_each(configs: list[tuple[dict, Path]], nproc: int = 2, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``configs`` (each written to its path) one after the other on ``nproc`` gloo ranks; assert the launch
    succeeded and return it (its stderr holds the workers' logs). ``env``: the workers' environment (default: this
    process's with one OpenMP thread). The launch may take 5 minutes and 2 more per config (the conformance kit's
    dozen cases on a loaded 2-core machine)."""
    for cfg, path in configs:
        write_config(path, cfg)
    cmd = torchrun_command(nproc, configs[0][1].parent, __file__, *[str(path) for _, path in configs])
    proc = subprocess.run(cmd, cwd=configs[0][1].parent, env=env or {**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300 + 120 * len(configs))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def fit_each(paths: list[str]) -> None:
    """A torchrun worker: one process group, then each config's trainer fitted in turn (rank 0 logs, as the CLI)."""
    from distillery.common.log import setup_logging
    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.assemble import build_trainer

    configs = [load_run_config(path, prefixes=allowed_prefixes()) for path in paths]  # the plugins the env allows
    env = init_distributed(configs[0].training.distributed)
    setup_logging(env.rank)  # as distillery.cli.train: rank 0 logs (each role's mesh)
    try:
        for i, config in enumerate(configs):
            if i and config.training.distributed != configs[i - 1].training.distributed:  # its own meshes (sp, tp, ...)
                env = init_distributed(config.training.distributed)  # (the process group is kept)
            build_trainer(config, env).fit()
    finally:
        shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    fit_each(sys.argv[1:])
