"""Starting ranks: under torchrun use its environment; otherwise spawn local ranks."""
import datetime
import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast stays off in every multi-GPU process (and in what they start).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def default_setup():
    """(backend, device type, world size): NCCL on every GPU when present, else 2 gloo ranks."""
    if torch.cuda.is_available():
        return "nccl", "cuda", torch.cuda.device_count()
    return "gloo", "cpu", 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, backend, fn, args, port):
    os.environ.update(NO_MULTICAST)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init(backend, rank, world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        shut_down()


def shut_down():
    """Collects garbage, then destroys the process group: a DDP and its hook, which hold the group,
    can sit in reference cycles until the collector runs, and their teardown should happen while
    the interpreter and the group are whole. (Once in CI a gloo rank of the planner benchmark
    aborted at exit, "terminate called without an active exception", after its work was done.)"""
    gc.collect()
    dist.destroy_process_group()


def init(backend, rank, world_size, timeout_s=300):
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def run_ranks(fn, args=(), backend=None, world_size=None):
    """Runs fn(rank, world_size, *args) on every rank, with a process group initialised."""
    os.environ.update(NO_MULTICAST)
    auto_backend, _, auto_world = default_setup()
    backend = backend or auto_backend
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init(backend, rank, world)
        try:
            fn(rank, world, *args)
        finally:
            shut_down()
        return
    world = world_size or auto_world
    mp.start_processes(_rank_main, args=(world, backend, fn, args, _free_port()), nprocs=world,
                       start_method="spawn")
