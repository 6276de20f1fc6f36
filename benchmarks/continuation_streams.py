"""Which stream a hook's continuation kernels run on, and its cost (see commtune/bench/streams.py).

    python benchmarks/continuation_streams.py        # one GPU
"""
from commtune.bench.streams import main

if __name__ == "__main__":
    main()
