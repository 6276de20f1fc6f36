import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICES = ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.needs_cuda])]


def on_device(x, device, offset):
    """A copy of x on the device starting `offset` elements into its storage (off alignment)."""
    base = torch.empty(x.numel() + offset, dtype=x.dtype, device=device)
    base[offset:] = x.to(device)
    return base[offset:]


def cuda_world_size():
    """Ranks for the NCCL tests: one per GPU (NCCL takes one rank per GPU)."""
    return torch.cuda.device_count()
