"""The ResNet-50 scaling study (see commtune/bench/scaling.py).

    python benchmarks/resnet50_scaling.py          # every GPU; --cpu: 2 gloo ranks, a small model
"""
from commtune.bench.scaling import main

if __name__ == "__main__":
    main()
