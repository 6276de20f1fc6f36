"""PowerSGD's kernels: the orthogonalization and the batched low-rank steps, on CPU and CUDA,
against torch's own orthogonalization and a float64 reference."""
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _orthogonalize_gram_schmidt

from commtune import _C
from conftest import DEVICES, needs_cuda


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_orthogonalize_gives_orthonormal_columns_with_torchs_spans(device, rank):
    g = torch.Generator().manual_seed(rank)
    m = torch.randn(5, 300, rank, generator=g)
    ours, theirs = m.clone().to(device), m.clone()
    _C.orthogonalize_(ours, 0.0)
    _orthogonalize(theirs, 0)  # Gram-Schmidt for rank <= 2, QR above
    ours = ours.cpu()
    eye = torch.eye(rank).expand(5, rank, rank)
    torch.testing.assert_close(ours.transpose(1, 2) @ ours, eye, rtol=0, atol=1e-5)
    # the same projector onto the leading columns, whichever method torch picked
    for k in range(1, rank + 1):
        pa, pb = ours[:, :, :k], theirs[:, :, :k]
        torch.testing.assert_close(pa @ pa.transpose(1, 2), pb @ pb.transpose(1, 2), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
def test_zero_columns_follow_torchs_epsilon_rule(device, epsilon):
    m = torch.randn(3, 64, 2)
    m[0, :, 0] = 0
    m[1, :, 1] = 0
    ours, theirs = m.clone().to(device), m.clone()
    _C.orthogonalize_(ours, epsilon)
    _orthogonalize_gram_schmidt(theirs, epsilon)
    torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-5, atol=1e-6, equal_nan=True)
    if epsilon == 0:
        assert torch.isnan(ours[0, :, 0]).all()  # 0/0, as torch
    else:
        assert torch.isfinite(ours).all() and ours[0, :, 0].abs().max() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_rank_deficient_columns_stay_finite_with_epsilon(device):
    m = torch.randn(2, 100, 4)
    m[:, :, 3] = m[:, :, 0] + 2 * m[:, :, 1]  # dependent on the columns before it
    _C.orthogonalize_(m := m.to(device), 1e-8)
    m = m.cpu()
    assert torch.isfinite(m).all()
    lead = m[:, :, :3]
    torch.testing.assert_close(lead.transpose(1, 2) @ lead, torch.eye(3).expand(2, 3, 3), rtol=0, atol=1e-5)


def layout(rank):
    """A bucket of matrices of awkward shapes with uncompressed pieces between them."""
    shapes = [(300, 70), (64, 576), (3, 513), (1000, 33), (40, 40), (2048, 9)]
    matrices, rest, at, p_at, q_at, rest_at = [], [], 0, 0, 0, 0
    for k, (n, m) in enumerate(shapes):
        gap = 7 * k + 1
        rest.append([at, gap, rest_at])
        at, rest_at = at + gap, rest_at + gap
        r = min(n, m, rank)
        matrices.append([at, n, m, r, p_at, q_at])
        at, p_at, q_at = at + n * m, p_at + n * r, q_at + m * r
    return at, q_at, matrices, rest


def rel(a, b):
    return float((a.double().cpu() - b).norm() / b.norm())


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("rank", [1, 4, 8, 40])
def test_batched_cuda_steps_match_a_float64_reference(dtype, tol, rank):
    if rank > 32 and dtype != torch.float32:
        pytest.skip("above rank 32 the steps are ATen's, which round every op to 16 bits")
    numel, q_numel, matrices, rest = layout(rank)
    g = torch.Generator().manual_seed(rank)
    x, q0 = torch.randn(numel, generator=g), torch.randn(q_numel, generator=g)
    ref = _C.powersgd_steps(x.double(), q0.double(), matrices, rest, 1e-8)
    run = lambda: _C.powersgd_steps(x.to("cuda", dtype), q0.to("cuda", dtype), matrices, rest, 1e-8)
    got = run()
    assert got[-1] == (rank <= 32)  # the batched kernels, or the ATen loop above rank 32
    for ours, theirs in zip(got[:5], ref[:5]):  # P, Q, packed rest, output, error
        assert rel(ours, theirs) <= tol
    again = run()
    assert all(torch.equal(a, b) for a, b in zip(got[:5], again[:5]))  # fixed summation order
