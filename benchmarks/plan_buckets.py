"""The bucket planner's prediction beside measurement (see commtune/bench/plan.py).

    python benchmarks/plan_buckets.py      # 2 CPU ranks on gloo, or every GPU on NCCL
"""
from commtune.bench.plan import main

if __name__ == "__main__":
    main()
