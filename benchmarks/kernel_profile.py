"""Where a step's time goes, for the benchmarks (`--profile`): torch.profiler's kernel table.

Its own module so that a benchmark on a bare node (torch only, e.g. extract_throughput.py's MoE
shapes) can profile without importing the trainer and its settings' dependencies.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(name: str, step, batches: list, device: torch.device, out: Path) -> None:
    """Where a step's time goes: the kernels' summed device time per step against the wall time
    per step (a step whose kernels take far less than its wall time waits on the host)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for batch in batches:
            step(batch)
        sync(device)
    wall = (time.perf_counter() - t0) / len(batches)
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events) / len(batches)
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / len(batches)
    table = events.table(sort_by="self_device_time_total" if device.type == "cuda" else "self_cpu_time_total",
                         row_limit=60)
    with out.open("a") as f:
        f.write(f"## {name}: wall {wall * 1e3:.1f} ms/step (under the profiler), kernels {kernel_us / 1e3:.1f} ms/step, "
                f"{ops:.0f} aten ops/step\n{table}\n\n")
    print(f"{name}: profiled wall {wall * 1e3:.1f} ms/step, kernels {kernel_us / 1e3:.1f} ms/step", flush=True)
