"""Starting the ranks: `launch(fn, world_size, device_type, *args)` runs `fn(group, *args)` on every rank.

From a plain process it spawns `world_size` fresh interpreters (torch.multiprocessing, start method
"spawn") that meet over TCP on a free local port. Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the
environment) the current process is already one rank and simply runs its share.

A rank that raises a `PagedKVError` prints the message and exits with code 2; the other ranks are then
stopped, and `launch` raises `RankFailed` carrying that exit code. Ctrl-C (or SIGTERM) is passed to rank
0 alone, which leaves its work (a server shuts down) and releases the followers; that rank ends with
code 130 when interrupted mid-generation.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import ConfigError, PagedKVError
from .group import TensorParallelGroup, init_group

# NVLink SHARP (multicast) collectives are left off in every rank this module starts.
RANK_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0"}


class RankFailed(Exception):
    """A rank exited with an error; `exit_code` is 2 for a user mistake (already printed), else 1."""

    def __init__(self, exit_code: int, detail: str = ""):
        self.exit_code = exit_code
        super().__init__(detail or f"a tensor-parallel rank exited with code {exit_code}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def ranks_on_this_host(world_size: int) -> int:
    """How many of `world_size` ranks run on this machine: torchrun's processes of this node, else all of them."""
    if _under_torchrun():
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return world_size


def _prepare_cpu_rank(ranks_here: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # transformers meshes over the accelerator it sees
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))


def launch(fn: Callable[..., Any], world_size: int, device_type: str, *args) -> list[Any]:
    """Run `fn(group, *args)` on `world_size` ranks; returns each rank's return value, by rank.

    Under torchrun only this process's rank runs, and the list holds its value alone.
    """
    if _under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ConfigError(f"--tensor-parallel {world_size} but torchrun started {os.environ['WORLD_SIZE']} "
                               "processes; make them equal")
        os.environ.update(RANK_ENVIRONMENT)
        if device_type == "cpu":
            _prepare_cpu_rank(ranks_on_this_host(world_size))
        return [_run_rank(int(os.environ["RANK"]), world_size, device_type, "env://", fn, args)]
    with tempfile.TemporaryDirectory(prefix="pagedkv-tp-") as tmp:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.start_processes(_spawned_rank, args=(world_size, device_type, init_method, fn, args, tmp),
                                     nprocs=world_size, join=False, start_method="spawn")
        try:
            with _interrupts_to_leader(context.processes[0].pid):
                while not context.join():
                    pass
        except mp.ProcessExitedException as exc:
            raise RankFailed(exc.exit_code if exc.exit_code in (2, 130) else 1, str(exc)) from None
        except mp.ProcessRaisedException as exc:
            raise RankFailed(1, str(exc)) from None
        return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


@contextlib.contextmanager
def _interrupts_to_leader(leader_pid: int):
    """Ctrl-C / SIGTERM reach rank 0 alone: it stops its work and releases the followers, which then exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame):
        os.kill(leader_pid, signal.SIGINT)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _spawned_rank(rank: int, world_size: int, device_type: str, init_method: str, fn, args, result_dir: str) -> None:
    os.setpgrp()  # out of the terminal's process group: Ctrl-C reaches the launcher, which tells rank 0 once
    os.environ.update(RANK_ENVIRONMENT, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    if device_type == "cpu":
        _prepare_cpu_rank(world_size)
    result = _run_rank(rank, world_size, device_type, init_method, fn, args)
    Path(result_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def _run_rank(rank: int, world_size: int, device_type: str, init_method: str, fn, args):
    # the leader stops on SIGINT; followers stop when the leader releases them (or when the launcher ends them)
    signal.signal(signal.SIGINT, signal.default_int_handler if rank == 0 else signal.SIG_IGN)
    group: TensorParallelGroup = init_group(rank, world_size, device_type, init_method)
    try:
        result = fn(group, *args)
    except PagedKVError as exc:
        print(f"pagedkv: error: {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # the launcher stops the other ranks, which may be waiting in a collective
    except KeyboardInterrupt:
        os._exit(130)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    # every rank has left its work (rank 0 released the others): meet before tearing the group down, so that
    # no rank closes its connections while another still reads the release from them
    dist.barrier(group=group.control)
    dist.destroy_process_group()
    return result
