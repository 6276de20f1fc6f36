"""Optimizer overlap on one GPU (see commtune/bench/overlap.py).

    python benchmarks/overlap.py        # ResNet-50 (AdamW) and a transformer encoder
"""
from commtune.bench.overlap import main

if __name__ == "__main__":
    main()
