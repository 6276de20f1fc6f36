import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICES = ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.needs_cuda])]


def cuda_world_size():
    """Ranks for the NCCL tests: one per GPU (NCCL takes one rank per GPU)."""
    return torch.cuda.device_count()
