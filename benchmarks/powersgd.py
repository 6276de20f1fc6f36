"""PowerSGD cost: commtune's C++/CUDA hook against torch's powerSGD_hook (see commtune/bench/powersgd.py).

    python benchmarks/powersgd.py                  # one GPU: ResNet-50 and a transformer encoder
    python benchmarks/powersgd.py --models resnet50 --ranks 4 --buckets 25
"""
from commtune.bench.powersgd import main

if __name__ == "__main__":
    main()
