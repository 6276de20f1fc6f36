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


@needs_cuda
@pytest.mark.needs_cuda
# Staged in shared memory; 3072 x 4 floats staged fill exactly 48 KB, which with the kernel's own
# shared memory needs the opt-in (a transformer's 3072-wide layers); too big to stage.
@pytest.mark.parametrize("rows", [300, 3072, 70000])
def test_cuda_orthogonalization_in_shared_and_global_memory(rows):
    m = torch.randn(2, rows, 4, generator=torch.Generator().manual_seed(rows))
    ours = m.cuda()
    _C.orthogonalize_(ours, 0.0)
    ours = ours.cpu().double()
    torch.testing.assert_close(ours.transpose(1, 2) @ ours, torch.eye(4, dtype=torch.float64).expand(2, 4, 4),
                               rtol=0, atol=1e-5)
    theirs = torch.linalg.qr(m.double()).Q
    for k in range(1, 5):  # the same leading subspaces as a float64 QR
        pa, pb = ours[:, :, :k], theirs[:, :, :k]
        assert float(torch.linalg.det(pa.transpose(1, 2) @ pb).abs().min()) > 1 - 1e-4


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("divisor", [1, 3])
def test_steps_add_the_addend_divide_and_sum_the_norms(device, divisor):
    """The fused passes against plain tensor arithmetic on what they return: the error buffer
    takes the addend, the output is P (Q / divisor)^T and the rest / divisor, the error ends as
    input + addend - output, and the norms are the residual's and the input's over the matrices."""
    numel, q_numel, matrices, rest = layout(4)
    g = torch.Generator().manual_seed(divisor)
    x, a, q0 = torch.randn(numel, generator=g), torch.randn(numel, generator=g), torch.randn(q_numel, generator=g)
    dtype = torch.float64 if device == "cpu" else torch.float32
    p, q, packed, out, error, norms, _ = (
        t.cpu().double() if isinstance(t, torch.Tensor) else t
        for t in _C.powersgd_steps(x.to(device, dtype), q0.to(device, dtype), matrices, rest, 1e-8,
                                   addend=a.to(device, dtype), divisor=divisor))
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    total = (x.to(dtype) + a.to(dtype)).double()  # added in the working dtype, as the kernels do
    torch.testing.assert_close(error, total - out, **tol)
    residual = squares = 0.0
    for offset, n, m, r, p_at, q_at in matrices:
        P, Q = p[p_at:p_at + n * r].view(n, r), q[q_at:q_at + m * r].view(m, r)
        torch.testing.assert_close(out[offset:offset + n * m].view(n, m), P @ (Q / divisor).T, **tol)
        residual += float(error[offset:offset + n * m].square().sum())
        squares += float(total[offset:offset + n * m].square().sum())
    for offset, n, at in rest:
        torch.testing.assert_close(packed[at:at + n], total[offset:offset + n], **tol)
        torch.testing.assert_close(out[offset:offset + n], total[offset:offset + n] / divisor, **tol)
    torch.testing.assert_close(norms, torch.tensor([residual, squares], dtype=torch.float64), rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_the_error_keeps_nothing_of_an_overflow(device, bad):
    """An Inf or a NaN in the input makes its matrix's output not finite (every rank's step then
    shows it); the error buffer keeps none of it: 0 wherever input - output is not finite, the
    same as elsewhere. On CUDA the decompression zeroes it as it writes (no pass of its own)."""
    numel, q_numel, matrices, rest = layout(4)
    g = torch.Generator().manual_seed(11)
    x, a, q0 = torch.randn(numel, generator=g), torch.randn(numel, generator=g), torch.randn(q_numel, generator=g)
    x[matrices[0][0] + 5] = float(bad)  # in the first matrix
    x[rest[0][0]] = float(bad)  # and in the rest
    p, q, packed, out, error, norms, _ = (
        t.cpu() if isinstance(t, torch.Tensor) else t
        for t in _C.powersgd_steps(x.to(device), q0.to(device), matrices, rest, 1e-8, addend=a.to(device), divisor=2))
    total = x + a
    assert not torch.isfinite(out).all()  # the overflow reaches the output
    assert torch.isfinite(error).all()
    left = total - out
    torch.testing.assert_close(error, torch.where(torch.isfinite(left), left, torch.zeros_like(left)),
                               rtol=1e-5, atol=1e-5)
    assert (error[~torch.isfinite(left)] == 0).all()


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
    a = torch.randn(numel, generator=g)
    ref = _C.powersgd_steps(x.double(), q0.double(), matrices, rest, 1e-8, addend=a.double(), divisor=3)
    run = lambda: _C.powersgd_steps(x.to("cuda", dtype), q0.to("cuda", dtype), matrices, rest, 1e-8,
                                    addend=a.to("cuda", dtype), divisor=3)
    got = run()
    assert got[-1] == (rank <= 32)  # the batched kernels, or the ATen loop above rank 32
    for ours, theirs in zip(got[:6], ref[:6]):  # P, Q, packed rest, output, error, norms
        assert rel(ours, theirs) <= tol
    again = run()
    assert all(torch.equal(a, b) for a, b in zip(got[:5], again[:5]))  # fixed summation order


@pytest.mark.parametrize("device", DEVICES)
def test_a_bucket_without_matrices_packs_and_divides_its_rest(device):
    """A bucket whose tensors all travel uncompressed (biases and norms alone, as a transformer's
    small buckets are): no matrix to size the kernels by, the rest packed and divided all the same."""
    g = torch.Generator().manual_seed(5)
    x, a = torch.randn(400, generator=g), torch.randn(400, generator=g)
    rest = [[0, 150, 0], [150, 250, 150]]
    p, q, packed, out, error, norms = (
        t.cpu() for t in _C.powersgd_steps(x.to(device), torch.empty(0, device=device), [], rest, 1e-8,
                                           addend=a.to(device), divisor=2)[:6])
    total = x + a
    assert p.numel() == 0 and q.numel() == 0
    torch.testing.assert_close(packed, total)
    torch.testing.assert_close(out, total / 2)
    torch.testing.assert_close(error, total - total / 2)
    assert norms.tolist() == [0.0, 0.0]  # the norms cover matrices only
