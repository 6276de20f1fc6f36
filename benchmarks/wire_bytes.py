"""Bytes on the wire per rank, every scheme: counters against formulas (see commtune/bench/wire.py).

    python benchmarks/wire_bytes.py                # 8 ranks: gloo on this CPU, or NCCL on 8 GPUs
"""
from commtune.bench.wire import main

if __name__ == "__main__":
    main()
