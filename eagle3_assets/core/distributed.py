"""One distributed set-up for every job (extraction and training), by environment variables.

`torchrun` sets RANK, WORLD_SIZE and LOCAL_RANK; a plain `python -m ...` run is rank 0
of a world of 1 and never touches torch.distributed.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch

from .target import pick_device


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def broadcast(self, obj):
        """Rank 0's object on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's object, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def sum(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], device=self.device)
        torch.distributed.all_reduce(t)
        return int(t.item())

    def from_rank0(self, values: list[float]) -> list[float]:
        """Rank 0's numbers on every rank (e.g. its clock, so time limits agree across ranks)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.broadcast(t, src=0)
        return t.tolist()


def setup(device: str = "auto") -> Dist:
    """Rank, world size and this rank's device; joins the process group when there are several."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dev = pick_device(device)
    if dev.type == "cuda" and world > 1:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, dev)


def leave() -> None:
    """Leave the process group and end the process, once a job has succeeded (its files written,
    its Pipes session closed). A rank that runs the interpreter's normal teardown after gloo can
    still die of SIGABRT ("terminate called without an active exception": a C++ thread destroyed
    with the interpreter), which fails the launch after its work is done; destroying the group
    first made that rarer, not gone. So a rank of a group exits at once after flushing its output:
    nothing of ours is left to tear down. A process not in a group returns normally. Not called on
    failure: a rank whose peers failed mid-collective could wait here forever."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    torch.distributed.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
