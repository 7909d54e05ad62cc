"""Benchmark: one checkpoint save (DCP write + sha256 of every file) of a large role, one DCP writer thread vs
the default (``components.checkpoint.manager.writer_threads``: up to 8, one file each, hashed in parallel).

Builds a module of ``--gib`` GiB of fp32 parameters (plus two AdamW-sized moment tensors, as a real role's state
has), saves it with :class:`CheckpointManager` under each setting in turn (same process, alternating, ``--repeats``
times), and prints the median seconds of each. Usage: ``python bench/checkpoint_save.py [--gib 1] [--repeats 3]
[--dir /tmp/ckpt-bench]``; on the GPU machine put ``--dir`` on the disk the runs use."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful

from distillery.components.checkpoint import manager
from distillery.components.checkpoint.manager import CheckpointManager, CheckpointPayload
from distillery.components.checkpoint.stateful import ModuleState


class Moments(Stateful):
    """Two AdamW-sized fp32 tensors per parameter (what an optimizer state adds to a checkpoint)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.state = {f"{n}.{m}": torch.randn_like(p) for n, p in module.named_parameters() for m in ("exp_avg", "exp_avg_sq")}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = state


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0, help="fp32 parameters of the role (its checkpoint is 3x that)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/ckpt-bench")
    args = parser.parse_args()
    width = 4096
    rows = max(1, int(args.gib * 2**30 / 4 / width / 8))
    module = torch.nn.Sequential(*(torch.nn.Linear(width, rows, bias=False) for _ in range(8)))
    payload = CheckpointPayload(dcp_state={"roles.student": ModuleState(module), "optimizers.student": Moments(module)},
                                rng_state={}, role_configs={"student": {}}, frozen_roles={}, metadata={})
    default_threads = manager.writer_threads(payload.dcp_state)
    times: dict[str, list[float]] = {"one thread": [], f"{default_threads} threads (default)": []}
    root = Path(args.dir)
    for _ in range(args.repeats):
        for label, threads in (("one thread", 1), (f"{default_threads} threads (default)", default_threads)):
            shutil.rmtree(root, ignore_errors=True)
            manager.writer_threads = lambda state, n=threads: n  # this setting for this save
            t0 = time.perf_counter()
            CheckpointManager(root, keep_last=1, rank=0, world_size=1).save(1, payload)
            times[label].append(time.perf_counter() - t0)
    shutil.rmtree(root, ignore_errors=True)
    state_gib = 3 * sum(p.numel() for p in module.parameters()) * 4 / 2**30
    print(json.dumps({"state_gib": round(state_gib, 2), "cpus": torch.get_num_threads(),
                      "median_s": {k: round(statistics.median(v), 2) for k, v in times.items()},
                      "all_s": {k: [round(x, 2) for x in v] for k, v in times.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
