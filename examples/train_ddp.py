"""A plain DDP training script with commtune's two-line change. Launch with torchrun:

    torchrun --nproc-per-node 2 examples/train_ddp.py --hook cast-bf16          # CPU: gloo
    torchrun --nproc-per-node 8 examples/train_ddp.py --hook allreduce          # GPUs: NCCL
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import commtune as ct  # change 1 of 2

HOOKS = {
    "allreduce": lambda: ct.hooks.AllReduce(),
    "cast-bf16": lambda: ct.hooks.Cast(torch.bfloat16),
    "cast-fp16": lambda: ct.hooks.Cast(torch.float16),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hook", choices=sorted(HOOKS), default="cast-bf16")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--bucket-mb", type=float, default=25)
    args = p.parse_args()

    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
    ddp = ct.wrap(model, hook=HOOKS[args.hook](),  # change 2 of 2 (was: DistributedDataParallel(model, ...))
                  device_ids=[device.index] if cuda else None, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    target = torch.randn(256, 10, generator=torch.Generator().manual_seed(0)).to(device)
    for step in range(args.steps):
        x = torch.randn(64, 256, generator=g).to(device)
        y = (x @ target).argmax(1)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    if dist.get_rank() == 0:
        ct.report(ddp)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
