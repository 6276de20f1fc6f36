"""min_size: a bucket under it goes as a plain mean allreduce, uncompressed, with no error kept;
a bucket of that size or more is compressed. Two gloo ranks, one bucket of 84000 bytes."""
import pytest
import torch

import compression_runs
import distributed

BUCKET = 300 * 70 * 4  # the one linear layer's gradient, in bytes
STEPS = 2


def run(hook, min_size):
    return distributed.run(compression_runs.hook_run, 2, STEPS, hook, "cpu", {"min_size": min_size})[0]


@pytest.mark.parametrize("hook", ["Quantize", "SignSGD", "TopK", "RandomK"])
def test_a_bucket_under_min_size_goes_as_a_plain_mean(hook):
    under = run(hook, BUCKET + 1)
    for ours, grads in under["steps"]:
        torch.testing.assert_close(ours, torch.stack(grads).mean(0), rtol=1e-6, atol=1e-9)
    s = under["stats"]
    assert s["bytes_out"] == STEPS * BUCKET and s["wire_bytes"] == STEPS * BUCKET  # 2 (n - 1) / n = 1 at n = 2
    assert not [key for key in under["state"] if key.startswith("error.")]  # nothing held back to send later

    at = run(hook, BUCKET)  # "under" is strict: a bucket of exactly min_size is compressed
    assert at["stats"]["wire_bytes"] < STEPS * BUCKET / 3
    ours, grads = at["steps"][0]
    assert not torch.allclose(ours, torch.stack(grads).mean(0), rtol=1e-3, atol=1e-6)
    assert [key for key in at["state"] if key.startswith("error.")] == ["error.0"]
