"""Convergence with compression: a small classifier trained on 2 gloo ranks for a fixed step
budget reaches, with each compressor plus error feedback, test accuracy within 1 point of
uncompressed training. Both accuracies are recorded (pytest's record_property, and printed)."""
import functools

import pytest
import torch

import distributed

STEPS, BATCH, CLASSES, DIM, TEACHER = 300, 64, 4, 8, 16


def _data(seed, n):
    """A teacher network's labels on Gaussian inputs: learnable, not linearly separable."""
    g = torch.Generator().manual_seed(1234)  # the same teacher everywhere
    w1, w2 = torch.randn(DIM, TEACHER, generator=g), torch.randn(TEACHER, CLASSES, generator=g)
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x @ w1) @ w2).argmax(1)


def train(rank, world_size, hook_name):
    import commtune as ct

    hooks = {"none": ct.hooks.AllReduce(), "Quantize": ct.hooks.Quantize(min_size=0, chunk=256),
             "Quantize(4 bits)": ct.hooks.Quantize(bits=4, min_size=0, chunk=256),
             "Quantize(e4m3)": ct.hooks.Quantize(format="e4m3", min_size=0, chunk=256),
             "SignSGD": ct.hooks.SignSGD(min_size=0, chunk=256), "TopK": ct.hooks.TopK(ratio=0.05, min_size=0),
             "TopK(threshold)": ct.hooks.TopK(ratio=0.05, min_size=0, selection="threshold"),
             "RandomK": ct.hooks.RandomK(ratio=0.05, min_size=0)}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, CLASSES))
    ddp = ct.wrap(model, hook=hooks[hook_name])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    x, y = _data(100 + rank, STEPS * BATCH)
    for step in range(STEPS):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(xb), yb).backward()
        opt.step()
    tx, ty = _data(7, 4000)
    with torch.no_grad():
        return float((model(tx).argmax(1) == ty).float().mean()) * 100


@functools.lru_cache(maxsize=None)
def accuracy(hook_name):
    return distributed.run(train, 2, hook_name)[0]


def test_uncompressed_training_learns_the_task():
    assert accuracy("none") > 80  # far above chance (25%): the task tells compressors apart


# SignSGD with error feedback falls short here: 86.5% against 88.1% (chunks of 32, 64, 128, 512
# and 1024 elements: 85.7%, 87.2%, 85.7%, 85.3%, 84.3%: no trend to pick a chunk by). Kept as a
# strict expected failure so that a fix shows.
SIGN_SHORT = pytest.mark.xfail(strict=True, reason="EF-SignSGD reaches 86.5% vs 88.1% uncompressed at this budget")
# RandomK at 5% sends a twentieth of each step's update and the rest waits in the error buffer:
# 52.2% after the same budget (TopK at 5%: 88.05%); at ratios 0.1, 0.2, 0.3, 0.5, 0.75: 62.3%,
# 78.6%, 82.4%, 87.3%, 88.6% (twenty-fifth session): it needs half the entries a step to keep up.
RANDOMK_SHORT = pytest.mark.xfail(strict=True, reason="RandomK(0.05) reaches 52.2% vs 88.1% at this budget")


@pytest.mark.parametrize("compressor", ["Quantize", "Quantize(4 bits)", "Quantize(e4m3)",
                                        pytest.param("SignSGD", marks=SIGN_SHORT), "TopK", "TopK(threshold)",
                                        pytest.param("RandomK", marks=RANDOMK_SHORT)])
def test_compressed_training_with_error_feedback_matches_uncompressed(compressor, record_property):
    base, ours = accuracy("none"), accuracy(compressor)
    record_property("uncompressed_accuracy", base)
    record_property(f"{compressor}_accuracy", ours)
    print(f"test accuracy after {STEPS} steps: uncompressed {base:.2f}%, {compressor} {ours:.2f}%")
    assert ours >= base - 1.0, f"{compressor}: {ours:.2f}% vs {base:.2f}% uncompressed"
