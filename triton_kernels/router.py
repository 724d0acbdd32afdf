"""DeepSeek-V3 noaux_tc router in two launches: split-K router logits, then sigmoid + grouped top-k per token.

The torch reference (`ops.moe.route_torch`) casts the gate weight to fp32 on every call and launches about a
dozen small kernels; here the logits are a bf16 x bf16 -> fp32 tl.dot (products are exact in fp32, only the
summation order differs), split along D so that even one token spreads the gate weight over enough programs,
and the second kernel sums the splits and does the whole selection in registers.
"""

import torch
import triton
import triton.language as tl

from triton_kernels import arch, glue, pdl
from triton_kernels.keys import ordered
from triton_kernels.linear import MAX_ROWS, NORM_MAX_K, Config, Norm, linear_kernel

BLOCK_E = 32
MAX_SPLITS = 16
LOWEST = tl.constexpr(-(2**63))  # below every select key

# Per arch, how the logits are computed by token count: one token on the skinny GEMM's gemv (no tl.dot: fp32 FMAs
# of 16-byte weight loads), 2 to linear.MAX_ROWS tokens on its dot tiles through tensor descriptors (the padding
# rows not loaded), the K-split partials of both left for the select kernel to sum (`linear_kernel(raw=True)`):
# 1.2-1.3x faster than the logits kernel below at 1-65 tokens (bench/results/glue_h200_s11.md). More tokens:
# the logits kernel with (BLOCK_M, BLOCK_D) tiles, one token block a program.
ONE_ROW = {"sm_90": Config("gemv", 16, 512, 4, 4, 1), "sm_120": Config("gemv", 16, 512, 4, 4, 1)}
MANY_ROWS = {"sm_90": Config("swap", 64, 128, 4, 4, 0.5, tma=True),
             "sm_120": Config("swap", 64, 128, 4, 4, 0.5, tma=True)}
LOGITS_TILE = {"sm_90": (64, 128), "sm_120": (64, 128)}
SELECT_WARPS = {"sm_90": 4, "sm_120": 4}  # fastest at 1-129 rows; 1 warp spills on sm_90 and sm_120
# Per arch, the widest row whose norm (`norm_route`) the one-row logits gemv computes in its prologue rather than
# glue's norm kernel in a launch of its own: the verify at one token 0.7% faster on the proxy, 0.3% slower on
# sm_90, whose gemv gains more time than the launch saves (bench/results/norm_linear_h100.md).
NORM_IN_LOGITS_MAX_D = {"sm_90": 0, "sm_120": NORM_MAX_K}


@triton.jit
def _logits_kernel(x_ptr, w_ptr, part_ptr, M, E, D, d_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl.enter(PDL)
    pid_e, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    # rows and experts past M and E are clamped, not masked, so that the loads stay unmasked (pipelined through
    # shared memory); their duplicate sums are never stored
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None].to(tl.int64) * D  # [BM, 1]
    w_cols = w_ptr + tl.minimum(offs_e, E - 1)[None, :].to(tl.int64) * D  # [1, BE]
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    d_start = split * d_per_split
    for d in range(d_start, tl.minimum(d_start + d_per_split, D), BLOCK_D):
        if EVEN_D:  # D and d_per_split whole tiles
            x = tl.load(x_rows + d + offs_d[None, :])  # [BM, BD]
            w = tl.load(w_cols + d + offs_d[:, None])  # [BD, BE]
        else:
            d_ok = d + offs_d < D
            x = tl.load(x_rows + d + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            w = tl.load(w_cols + d + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
    dst = part_ptr + (split * M + offs_m[:, None]).to(tl.int64) * E + offs_e[None, :]
    tl.store(dst, acc, mask=(offs_m < M)[:, None] & (offs_e < E)[None, :])


@triton.jit
def _select_kernel(part_ptr, bias_ptr, weights_ptr, ids_ptr, M, E, splits, group_size, n_group, topk_group,
                   top_k, scaling, NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    offs_s = tl.arange(0, BLOCK_S)
    parts = tl.load(part_ptr + ((offs_s[:, None] * M + m).to(tl.int64) * E + offs[None, :]),
                    mask=(offs_s < splits)[:, None] & ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_E]: one round trip
    logits = tl.sum(parts, 0)
    scores = tl.sigmoid(logits)
    choice = tl.where(ok, scores + tl.load(bias_ptr + offs, mask=ok, other=0.0), float("-inf"))
    if n_group > 1:
        group = offs // group_size
        offs_g = tl.arange(0, BLOCK_G)
        group_score = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        for g in range(n_group):  # a group's score: the sum of its two best biased scores
            member = tl.where(group == g, choice, float("-inf"))
            best = tl.max(member, 0)
            first = tl.min(tl.where(member == best, offs, BLOCK_E), 0)
            second = tl.max(tl.where(offs == first, float("-inf"), member), 0)
            group_score = tl.where(offs_g == g, best + second, group_score)
        kept = tl.zeros((BLOCK_E,), dtype=tl.int1)
        for _ in range(topk_group):
            best = tl.max(group_score, 0)
            g = tl.min(tl.where(group_score == best, offs_g, BLOCK_G), 0)
            kept = kept | (group == g)
            group_score = tl.where(offs_g == g, float("-inf"), group_score)
        choice = tl.where(kept, choice, float("-inf"))
    # one max a pick: key = choice's order-preserving int32 bits above (2^31 - 1 - expert), so ties go to the
    # lower expert; padding lanes hold the smallest key
    key = tl.where(ok, (ordered(choice).to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64), LOWEST)
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in range(top_k):  # descending, as torch.topk returns them
        best = tl.max(key, 0)
        e = 2147483647 - (best - ((best >> 32) << 32)).to(tl.int32)
        ids = tl.where(offs_k == j, e, ids)
        key = tl.where(offs == e, LOWEST, key)
    picked = offs_k < top_k
    tl.store(ids_ptr + m * top_k + offs_k, ids, mask=picked)
    chosen = tl.where(picked, tl.gather(scores, ids, 0), 0.0)
    if NORM:
        chosen = chosen / (tl.sum(chosen, 0) + 1e-20)
    tl.store(weights_ptr + m * top_k + offs_k, chosen * scaling, mask=offs_k < top_k)


def _splits(M, E, sms, block_m):
    """K splits so that the logits grid is about two programs per SM."""
    tiles = triton.cdiv(E, BLOCK_E) * triton.cdiv(M, block_m)
    return max(1, min(MAX_SPLITS, 2 * sms // tiles))


def logits(x, gate_weight):
    """Split-K fp32 router logits of x [M, D] (M >= 1) against gate_weight [E, D] of x's dtype, both contiguous:
    partials [splits, M, E], which the select kernel sums."""
    M, D = x.shape
    E = gate_weight.shape[0]
    key = arch.current(x.device)
    if M == 1:
        return linear_kernel(x, gate_weight, ONE_ROW[key], raw=True)
    if M <= MAX_ROWS:
        return linear_kernel(x, gate_weight, MANY_ROWS[key], raw=True)
    block_m, block_d = LOGITS_TILE[key]
    d_per_split = triton.cdiv(triton.cdiv(D, _splits(M, E, arch.sm_count(x.device), block_m)), block_d) * block_d
    splits = triton.cdiv(D, d_per_split)
    part = torch.empty(splits, M, E, dtype=torch.float32, device=x.device)
    _logits_kernel[(triton.cdiv(E, BLOCK_E), triton.cdiv(M, block_m), splits)](
        x, gate_weight, part, M, E, D, d_per_split, BLOCK_M=block_m, BLOCK_E=BLOCK_E, BLOCK_D=block_d,
        EVEN_D=D % block_d == 0, num_stages=3, **pdl.options(x))
    return part


def route(x, gate_weight, bias, top_k, n_group, topk_group, scaling_factor, norm_topk_prob=True):
    """See `ops.moe.route`. x: [M, D] fp16/bf16/fp32; gate_weight: [E, D] of x's dtype; bias: [E] fp32.
    Returns (weights [M, top_k] fp32, ids [M, top_k] int32)."""
    x, gate_weight = x.contiguous(), gate_weight.contiguous().to(x.dtype)
    part = logits(x, gate_weight) if x.shape[0] else None
    return _select(part, x.shape[0], gate_weight.shape[0], bias, top_k, n_group, topk_group, scaling_factor,
                   norm_topk_prob, x.device)


def norm_route(x, residual, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, scaling_factor,
               norm_topk_prob=True):
    """See `ops.moe.norm_route`. x: [M, D] of residual's dtype or fp32; residual: [M, D]; norm_weight: [D];
    gate_weight: [E, D] of residual's dtype. One row up to NORM_IN_LOGITS_MAX_D: the norm in the prologue of
    the logits' gemv, whose program (0, 0) also stores h and the normed row (the norm kernel's launch saved); else
    glue.add_rms_norm, then `route`. Returns (h, normed, weights, ids)."""
    x, residual, gate_weight = x.contiguous(), residual.contiguous(), gate_weight.contiguous()
    M, D = residual.shape
    key = arch.current(x.device)
    if M != 1 or D > NORM_IN_LOGITS_MAX_D[key]:
        h, normed = glue.add_rms_norm(x, residual, norm_weight, eps)
        return h, normed, *route(normed, gate_weight, bias, top_k, n_group, topk_group, scaling_factor,
                                 norm_topk_prob)
    h, normed = torch.empty_like(residual), torch.empty_like(residual)
    norm = Norm(norm_weight, eps, residual, h=h, normed=normed)
    part = linear_kernel(x, gate_weight.to(residual.dtype), ONE_ROW[key], raw=True, norm=norm)
    return h, normed, *_select(part, M, gate_weight.shape[0], bias, top_k, n_group, topk_group, scaling_factor,
                               norm_topk_prob, x.device)


def _select(part, M, E, bias, top_k, n_group, topk_group, scaling_factor, norm_topk_prob, device):
    """The select kernel on the logits' K-split partials [splits, M, E]: (weights, ids) as `route` returns them."""
    weights = torch.empty(M, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(M, top_k, dtype=torch.int32, device=device)
    if M == 0:
        return weights, ids
    splits = part.shape[0]
    _select_kernel[(M,)](part, bias.float().contiguous(), weights, ids, M, E, splits, E // n_group, n_group,
                         topk_group, top_k, float(scaling_factor), NORM=bool(norm_topk_prob),
                         BLOCK_E=triton.next_power_of_2(E), BLOCK_G=triton.next_power_of_2(n_group),
                         BLOCK_K=triton.next_power_of_2(top_k), BLOCK_S=triton.next_power_of_2(splits),
                         num_warps=SELECT_WARPS[arch.current(device)], **pdl.options(part))
    return weights, ids
