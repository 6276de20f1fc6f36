"""Runs a function on several ranks in fresh processes, the way torchrun would.

Each rank inits a process group (file store), runs fn(rank, world_size, *args) and sends its
return value back; an exception on any rank fails the caller with that rank's traceback. A run
that outlives its timeout is killed and fails: nothing hangs silently.
"""
import datetime
import io
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commtune.launch import NO_MULTICAST



def _entry(fn, rank, world_size, init_file, backend, pg_timeout_s, results, args):
    os.environ.update(NO_MULTICAST)
    torch.set_num_threads(1)  # ranks share this machine's cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        # As bytes: tensors sent through the queue would live in this process's shared memory.
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn, world_size, *args, backend="gloo", timeout_s=180, pg_timeout_s=60):
    """Returns [fn's value on rank 0, rank 1, ...]."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, init_file, backend, pg_timeout_s, results, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        values, errors, deadline = {}, [], time.monotonic() + timeout_s
        try:
            while len(values) + len(errors) < world_size:
                try:
                    rank, ok, value = results.get(timeout=1)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:  # a rank that crashed (a segfault, say) never reports: fail now
                        errors += [f"rank {r} died with exit code {procs[r].exitcode}" for r in dead]
                        break
                    if time.monotonic() > deadline:
                        errors.append(f"ranks {sorted(set(range(world_size)) - set(values))} "
                                      f"gave no result in {timeout_s} s")
                        break
                    continue
                if ok:
                    values[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors.append(f"rank {rank}:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [values[r] for r in range(world_size)]
