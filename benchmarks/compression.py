"""Compression kernels against the device copy bandwidth (see commtune/bench/compression.py).

    python benchmarks/compression.py               # one GPU, a 100 MB bucket cut for 8 ranks
"""
from commtune.bench.compression import main

if __name__ == "__main__":
    main()
