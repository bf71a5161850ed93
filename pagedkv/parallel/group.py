"""`TensorParallelGroup`: this process's rank, its device, and the process groups it talks through.

Two channels: the tensor-parallel collectives of the sharded model (the default process group: NCCL on
CUDA, gloo on the CPU), and a gloo "control" group that carries the leader's step messages as pickled
host objects, so that broadcasting a block table never touches a GPU stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    control: dist.ProcessGroup | None  # gloo group for step messages; None: the default group (gloo on the CPU)

    @property
    def is_leader(self) -> bool:
        """Rank 0 schedules, samples and decides every block table; the other ranks follow its steps."""
        return self.rank == 0


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_group(rank: int, world_size: int, device_type: str, init_method: str = "env://") -> TensorParallelGroup:
    """Join the process group as `rank` of `world_size`, binding rank r to cuda:r on CUDA."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size, device_id=device)
        control = dist.new_group(backend="gloo")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        control = None
    return TensorParallelGroup(rank, world_size, device, control)


def available_devices(device_type: str) -> int:
    """How many ranks `device_type` can host: GPUs on CUDA, cores on the CPU (one rank needs one core at least)."""
    if device_type == "cuda":
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def check_tensor_parallel(world_size: int, num_kv_heads: int, num_heads: int, device_type: str,
                          ranks_here: int | None = None) -> None:
    """Raise ConfigError unless `world_size` ranks can each own an equal share of the heads on `device_type`,
    `ranks_here` of them (default: all) on this host's devices."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"--tensor-parallel {world_size!r}: must be a positive number of ranks")
    if num_kv_heads % world_size or num_heads % world_size:
        divisors = [n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0 and num_heads % n == 0]
        raise ConfigError(f"--tensor-parallel {world_size}: this model has {num_kv_heads} KV heads and {num_heads} "
                          f"attention heads, which {world_size} ranks cannot share equally (each rank owns whole KV "
                          f"heads); use one of {', '.join(map(str, divisors))}")
    have, here = available_devices(device_type), world_size if ranks_here is None else ranks_here
    if here > have:
        lower = "lower --tensor-parallel" if here == world_size else "start fewer processes per node (--nproc-per-node)"
        if device_type == "cuda":
            found = f"{have} CUDA device{'s' if have != 1 else ''}" if have else "no CUDA device"
            fix = f"{lower} to at most {have}" if have else "run the ranks on the CPU with --device cpu"
            raise ConfigError(f"--tensor-parallel {world_size}: needs {here} GPUs here (one per rank) but this "
                              f"machine has {found}; {fix}")
        raise ConfigError(f"--tensor-parallel {world_size}: needs {here} CPU cores here (one per rank) but this "
                          f"machine has {have}; {lower} to at most {have}")
