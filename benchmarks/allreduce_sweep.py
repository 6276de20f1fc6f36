"""Collective sweep with nccl-tests' algbw/busbw (see commtune/bench/allreduce_sweep.py).

    torchrun --nproc-per-node 8 benchmarks/allreduce_sweep.py
    python benchmarks/allreduce_sweep.py --ranks 2 --max-size 1MiB      # CPU, gloo
"""
from commtune.bench.allreduce_sweep import main

if __name__ == "__main__":
    main()
