"""One NCCL rank on GPU 0 with commtune's settings (run as a script, in a process of its own:
NCCL reads its variables once per process). Prints what the tests check."""
import os
import sys

import torch
import torch.distributed as dist

import commtune as ct


def main(port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    settings = ct.nccl.Settings(buffsize="8MiB", nthreads=256, min_ctas=2, max_ctas=8, high_priority_stream=True)
    ct.init_process_group("nccl", settings=settings, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    options = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda")).options
    print(f"options: high_priority={options.is_high_priority_stream} min_ctas={options.config.min_ctas} "
          f"max_ctas={options.config.max_ctas}")
    model = torch.nn.Linear(256, 256).cuda()
    ddp = ct.wrap(model, hook=ct.hooks.Quantize(min_size=0), device_ids=[0])
    ddp(torch.randn(8, 256, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    print(f"stats nccl: {sorted(ct.stats(ddp)['nccl'].items())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
