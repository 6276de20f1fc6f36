"""Small models and data for the multi-rank tests."""
import torch
from torch import nn


class SmallNet(nn.Module):
    """Conv, linear, 1-D and tiny tensors: enough parameters for several buckets."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.fc1 = nn.Linear(8 * 8 * 8, 64)
        self.fc2 = nn.Linear(64, 10)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1)))) * self.scale


def make_model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return SmallNet().to(device)


def batch(rank, step, device="cpu", scale=1.0):
    """A different batch per rank and step, the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 3, 8, 8, generator=g) * scale
    y = torch.randint(0, 10, (4,), generator=g)
    return x.to(device), y.to(device)


def loss_fn(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


# Small buckets so the model spans several of them (and DDP's rebuild changes them).
BUCKET_CAP_MB = 0.02
