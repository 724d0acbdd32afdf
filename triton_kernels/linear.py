"""Skinny GEMM for the dense projections at decode and verify sizes: y [M, N] = x [M, K] @ W [N, K]^T, M <= 64.

These projections read megabytes of weights for a few rows of activations, so they are bound by bandwidth and
launch latency. cuBLAS runs most of them as a split-K GEMM plus a separate reduction kernel. Here one launch
does both: programs own (N tile, K range) pairs, about two per SM; with several K ranges each writes an fp32
partial tile and the last to arrive at a per-tile counter (acquire-release atomics) sums them and writes y,
then resets the counter for the next launch (no memset, so CUDA graphs replay it as is). Larger M goes to
cuBLAS, which is compute-efficient there.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triton_kernels.counters import arrival_counters

MAX_ROWS = 64
BLOCK_K = 128


@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                   SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    # Rows and columns past M and N are clamped, not masked: masked this loop compiled without cp.async stages
    # (Triton 3.6 and 3.9, sm_90 and sm_120); the duplicates only feed outputs that are never stored.
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm  # [BM, 1]
    w_cols = w_ptr + tl.minimum(offs_n, N - 1)[None, :].to(tl.int64) * stride_wn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    for k in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        if EVEN_K:
            x = tl.load(x_rows + k + offs_k[None, :])  # [BM, BK]
            w = tl.load(w_cols + k + offs_k[:, None])  # [BK, BN]
        else:
            k_ok = k + offs_k < K
            x = tl.load(x_rows + k + offs_k[None, :], mask=k_ok[None, :], other=0.0)
            w = tl.load(w_cols + k + offs_k[:, None], mask=k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
    y_ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    if SPLITS == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        tile = (split * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :]  # this split's partial [BM, BN]
        tl.store(part_ptr + tile, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLITS):  # .cg: read the other programs' partials at L2, not a stale L1
                total += tl.load(part_ptr + (s * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :], mask=out_ok,
                                 other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def plan(M, N, K, sms):
    """(BLOCK_M, BLOCK_N, K splits, K per split, num_stages): about two programs per SM, each split at least
    four K tiles long."""
    block_m = max(16, triton.next_power_of_2(M))
    block_n = 64 if N >= 8192 else 32
    tiles = triton.cdiv(N, block_n)
    splits = max(1, min(triton.cdiv(K, 4 * BLOCK_K), 2 * sms // tiles, 16))
    k_per_split = triton.cdiv(triton.cdiv(K, splits), BLOCK_K) * BLOCK_K
    return block_m, block_n, triton.cdiv(K, k_per_split), k_per_split, 3 if block_m == 64 else 4


def linear(x, weight):
    """See `ops.linear.linear`. x: [M, K] (rows may be strided); weight: [N, K] row-major. Returns [M, N]."""
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS or M == 0 or x.stride(1) != 1 or weight.stride(1) != 1:
        return F.linear(x, weight)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    block_m, block_n, splits, k_per_split, stages = plan(M, N, K, sms)
    tiles = triton.cdiv(N, block_n)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    part = torch.empty(splits * block_m * N if splits > 1 else 1, dtype=torch.float32, device=x.device)
    counters = arrival_counters("linear", x.device, tiles)
    _linear_kernel[(tiles, splits)](x, weight, y, part, counters, M, N, K, k_per_split, x.stride(0),
                                    weight.stride(0), SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
                                    BLOCK_K=BLOCK_K, EVEN_K=K % BLOCK_K == 0, num_warps=4, num_stages=stages)
    return y
