"""DeepSeek-V3 noaux_tc router in one launch: split-K router logits, then sigmoid + grouped top-k per token.

The torch reference (`ops.moe.route_torch`) casts the gate weight to fp32 on every call and launches about a
dozen small kernels. Here the logits are a bf16 x bf16 -> fp32 tl.dot (products are exact in fp32, only the
summation order differs), split along D so that even one token spreads the gate weight over enough programs.
Each program stores its fp32 partial tile; the last program to arrive for a block of tokens (acquire-release
counter, reset after use) sums the partials and selects the experts of those tokens in registers, a few
tokens at a time.
"""

import torch
import triton
import triton.language as tl

from triton_kernels.counters import arrival_counters

BLOCK_M, BLOCK_E, BLOCK_D = 16, 32, 256
SELECT_ROWS = 4  # tokens selected at once by the last program: [4, E] rows keep the select within registers
MAX_SPLITS = 16


@triton.jit
def _partial_logits(x_ptr, w_ptr, part_ptr, M, E, D, d_per_split, pid_e, pid_m, split,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    d_start = split * d_per_split
    for d in range(d_start, tl.minimum(d_start + d_per_split, D), BLOCK_D):
        d_ok = d + offs_d < D
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * D + d + offs_d[None, :],
                    mask=(offs_m < M)[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
        w = tl.load(w_ptr + offs_e[None, :].to(tl.int64) * D + d + offs_d[:, None],
                    mask=(offs_e < E)[None, :] & d_ok[:, None], other=0.0)  # [BD, BE]
        acc = tl.dot(x, w, acc)
    dst = part_ptr + (split * M + offs_m[:, None]).to(tl.int64) * E + offs_e[None, :]
    tl.store(dst, acc, mask=(offs_m < M)[:, None] & (offs_e < E)[None, :])


@triton.jit
def _first_of_max(x, offs, BIG: tl.constexpr):
    """Per row of x [BM, N]: (max, the lowest column holding it)."""
    best = tl.max(x, 1)
    return best, tl.min(tl.where(x == best[:, None], offs[None, :], BIG), 1)


@triton.jit
def _keep_best_groups(choice, offs, group_size, n_group, topk_group, BLOCK_A: tl.constexpr, BLOCK_G: tl.constexpr):
    """choice [BM, BA] with experts outside each row's topk_group best groups set to -inf; a group's score is
    the sum of its two best biased scores."""
    group = offs // group_size  # [BA]
    offs_g = tl.arange(0, BLOCK_G)
    group_score = tl.full((choice.shape[0], BLOCK_G), float("-inf"), tl.float32)
    for g in range(n_group):
        member = tl.where((group == g)[None, :], choice, float("-inf"))
        best, first = _first_of_max(member, offs, BLOCK_A)
        second = tl.max(tl.where(offs[None, :] == first[:, None], float("-inf"), member), 1)
        group_score = tl.where(offs_g[None, :] == g, (best + second)[:, None], group_score)
    kept = tl.zeros(choice.shape, dtype=tl.int1)
    for _ in range(topk_group):
        _, top = _first_of_max(group_score, offs_g, BLOCK_G)  # [BM]
        kept = kept | (group[None, :] == top[:, None])
        group_score = tl.where(offs_g[None, :] == top[:, None], float("-inf"), group_score)
    return tl.where(kept, choice, float("-inf"))


@triton.jit
def _select(part_ptr, bias_ptr, weights_ptr, ids_ptr, first_row, M, E, splits, group_size, n_group, topk_group,
            top_k, scaling, NORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_A: tl.constexpr,
            BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = first_row + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_A)
    ok = offs < E
    both = (rows < M)[:, None] & ok[None, :]
    logits = tl.zeros((ROWS, BLOCK_A), dtype=tl.float32)
    for s in range(splits):  # .cg: the other programs' partials, read at L2 rather than from a stale L1
        logits += tl.load(part_ptr + (s * M + rows[:, None]).to(tl.int64) * E + offs[None, :], mask=both,
                          other=0.0, cache_modifier=".cg")
    scores = tl.sigmoid(logits)  # [BM, BA]
    bias = tl.load(bias_ptr + offs, mask=ok, other=0.0)
    choice = tl.where(ok[None, :], scores + bias[None, :], float("-inf"))
    if n_group > 1:
        choice = _keep_best_groups(choice, offs, group_size, n_group, topk_group, BLOCK_A, BLOCK_G)
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
    chosen = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    for j in range(top_k):  # descending, as torch.topk returns them
        _, e = _first_of_max(choice, offs, BLOCK_A)
        picked = offs[None, :] == e[:, None]
        ids = tl.where(offs_k[None, :] == j, e[:, None], ids)
        chosen = tl.where(offs_k[None, :] == j, tl.sum(tl.where(picked, scores, 0.0), 1)[:, None], chosen)
        choice = tl.where(picked, float("-inf"), choice)
    if NORM:
        chosen = chosen / (tl.sum(chosen, 1)[:, None] + 1e-20)
    out = rows[:, None] * top_k + offs_k[None, :]
    out_ok = (rows < M)[:, None] & (offs_k < top_k)[None, :]
    tl.store(ids_ptr + out, ids, mask=out_ok)
    tl.store(weights_ptr + out, chosen * scaling, mask=out_ok)


@triton.jit
def _router_kernel(x_ptr, w_ptr, bias_ptr, part_ptr, count_ptr, weights_ptr, ids_ptr, M, E, D, d_per_split,
                   group_size, n_group, topk_group, top_k, scaling, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_K: tl.constexpr, SELECT_ROWS: tl.constexpr):
    pid_e, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _partial_logits(x_ptr, w_ptr, part_ptr, M, E, D, d_per_split, pid_e, pid_m, split, BLOCK_M, BLOCK_E, BLOCK_D)
    tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
    arrivals = tl.num_programs(0) * tl.num_programs(2)
    if tl.atomic_add(count_ptr + pid_m, 1, sem="acq_rel") == arrivals - 1:
        for first in range(pid_m * BLOCK_M, tl.minimum(pid_m * BLOCK_M + BLOCK_M, M), SELECT_ROWS):
            _select(part_ptr, bias_ptr, weights_ptr, ids_ptr, first, M, E, tl.num_programs(2), group_size, n_group,
                    topk_group, top_k, scaling, NORM, SELECT_ROWS, BLOCK_A, BLOCK_G, BLOCK_K)
        tl.atomic_xchg(count_ptr + pid_m, 0)


def _splits(M, E, sms):
    """K splits so that the logits grid is about two programs per SM even for a single token."""
    tiles = triton.cdiv(E, BLOCK_E) * triton.cdiv(M, BLOCK_M)
    return max(1, min(MAX_SPLITS, 2 * sms // tiles))


def route(x, gate_weight, bias, top_k, n_group, topk_group, scaling_factor, norm_topk_prob=True):
    """See `ops.moe.route`. x: [M, D] fp16/bf16/fp32; gate_weight: [E, D] of x's dtype; bias: [E] fp32.
    Returns (weights [M, top_k] fp32, ids [M, top_k] int32)."""
    M, D = x.shape
    E = gate_weight.shape[0]
    x, gate_weight = x.contiguous(), gate_weight.contiguous().to(x.dtype)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    splits = _splits(M, E, sms)
    d_per_split = triton.cdiv(triton.cdiv(D, splits), BLOCK_D) * BLOCK_D
    splits = triton.cdiv(D, d_per_split)
    weights = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(M, top_k, dtype=torch.int32, device=x.device)
    if M == 0:
        return weights, ids
    part = torch.empty(splits, M, E, dtype=torch.float32, device=x.device)
    m_tiles = triton.cdiv(M, BLOCK_M)
    counters = arrival_counters("router", x.device, m_tiles)
    _router_kernel[(triton.cdiv(E, BLOCK_E), m_tiles, splits)](
        x, gate_weight, bias.float().contiguous(), part, counters, weights, ids, M, E, D, d_per_split, E // n_group,
        n_group, topk_group, top_k, float(scaling_factor), NORM=bool(norm_topk_prob), BLOCK_M=BLOCK_M,
        BLOCK_E=BLOCK_E, BLOCK_D=BLOCK_D, BLOCK_A=triton.next_power_of_2(E), BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_K=triton.next_power_of_2(top_k), SELECT_ROWS=SELECT_ROWS, num_stages=3)
    return weights, ids
