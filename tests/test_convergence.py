"""Convergence with compression: a small classifier trained on 2 gloo ranks for a fixed step
budget reaches, with each compressor plus error feedback, test accuracy within 1 point of
uncompressed training. Accuracy is the mean over three seeds (model and data); both means are
recorded (pytest's record_property, and printed).

Two optimizers with the same effective step (lr / (1 - momentum) = 0.5):
- plain SGD, lr 0.5 (the uncompressed run's best lr within 0.25 points: 0.8 and 1.0 give 88.27%
  and 88.31% against 88.08%): every compressor meets the bar;
- SGD with momentum 0.9 after the hook, lr 0.05: SignSGD and RandomK(0.05) fall short. Error
  feedback delivers what a step held back in later bursts, and momentum spreads each burst over
  about 1 / (1 - momentum) further steps; at 5% RandomK holds each entry back ~20 steps and
  training turns unstable. Kept as strict expected failures, so that a fix shows.
"""
import functools

import pytest
import torch

import distributed

STEPS, BATCH, CLASSES, DIM, TEACHER = 300, 64, 4, 8, 16
SEEDS = (0, 1, 2)
OPTIMIZERS = {"sgd": dict(lr=0.5, momentum=0.0), "momentum": dict(lr=0.05, momentum=0.9)}


def _data(seed, n):
    """A teacher network's labels on Gaussian inputs: learnable, not linearly separable."""
    g = torch.Generator().manual_seed(1234)  # the same teacher everywhere
    w1, w2 = torch.randn(DIM, TEACHER, generator=g), torch.randn(TEACHER, CLASSES, generator=g)
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x @ w1) @ w2).argmax(1)


def train(rank, world_size, hook_name, optimizer, seed):
    import commtune as ct

    hooks = {"none": ct.hooks.AllReduce(), "Quantize": ct.hooks.Quantize(min_size=0, chunk=256),
             "Quantize(4 bits)": ct.hooks.Quantize(bits=4, min_size=0, chunk=256),
             "Quantize(e4m3)": ct.hooks.Quantize(format="e4m3", min_size=0, chunk=256),
             "SignSGD": ct.hooks.SignSGD(min_size=0, chunk=256), "TopK": ct.hooks.TopK(ratio=0.05, min_size=0),
             "TopK(threshold)": ct.hooks.TopK(ratio=0.05, min_size=0, selection="threshold"),
             "RandomK": ct.hooks.RandomK(ratio=0.05, min_size=0)}
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, CLASSES))
    ddp = ct.wrap(model, hook=hooks[hook_name])
    opt = torch.optim.SGD(ddp.parameters(), **OPTIMIZERS[optimizer])
    x, y = _data(100 + rank + 1000 * seed, STEPS * BATCH)
    for step in range(STEPS):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(xb), yb).backward()
        opt.step()
    tx, ty = _data(7, 4000)
    with torch.no_grad():
        return float((model(tx).argmax(1) == ty).float().mean()) * 100


@functools.lru_cache(maxsize=None)
def accuracy(hook_name, optimizer):
    """Mean test accuracy over SEEDS."""
    return sum(distributed.run(train, 2, hook_name, optimizer, seed)[0] for seed in SEEDS) / len(SEEDS)


COMPRESSORS = ["Quantize", "Quantize(4 bits)", "Quantize(e4m3)", "SignSGD", "TopK", "TopK(threshold)", "RandomK"]


def _compare(compressor, optimizer, record_property):
    base, ours = accuracy("none", optimizer), accuracy(compressor, optimizer)
    record_property(f"uncompressed_accuracy_{optimizer}", base)
    record_property(f"{compressor}_accuracy_{optimizer}", ours)
    print(f"{optimizer}, mean test accuracy after {STEPS} steps: uncompressed {base:.2f}%, {compressor} {ours:.2f}%")
    assert ours >= base - 1.0, f"{compressor} ({optimizer}): {ours:.2f}% vs {base:.2f}% uncompressed"


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_uncompressed_training_learns_the_task(optimizer):
    assert accuracy("none", optimizer) > 80  # far above chance (25%): the task tells compressors apart


@pytest.mark.parametrize("compressor", COMPRESSORS)
def test_compressed_training_with_error_feedback_matches_uncompressed(compressor, record_property):
    _compare(compressor, "sgd", record_property)


# Momentum 0.9 after the hook (means over SEEDS): SignSGD 86.22% and RandomK(0.05) 53.76%
# against 87.92% uncompressed (twenty-eighth session, RandomK's stratified draw; at ratio 0.25 and
# 0.5: 84.68% and 88.29%); the others within 0.7 points. With plain SGD at the same effective
# step both match (88.57% and 88.50% against 88.08%).
SHORT_UNDER_MOMENTUM = {"SignSGD", "RandomK"}


@pytest.mark.parametrize("compressor", [
    pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=f"{c} falls short with momentum 0.9 after the hook"))
    if c in SHORT_UNDER_MOMENTUM else c for c in COMPRESSORS])
def test_compressed_training_under_momentum(compressor, record_property):
    _compare(compressor, "momentum", record_property)
