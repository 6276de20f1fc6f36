"""ResNet-50 hook overhead (see commtune/bench/hook_overhead.py).

    python benchmarks/hook_overhead.py                # one GPU
    torchrun --nproc-per-node 8 benchmarks/hook_overhead.py
"""
from commtune.bench.hook_overhead import main

if __name__ == "__main__":
    main()
