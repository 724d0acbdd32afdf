"""Skinny GEMM for the dense projections at decode and verify sizes: y [M, N] = x [M, K] @ W [N, K]^T, M <= 128.

These projections read megabytes of weights for a few rows of activations, so they are bound by bandwidth and
launch latency. cuBLAS runs most of them as a split-K GEMM plus a separate reduction kernel. Here one launch
does both: programs own (N tile, K range) pairs, a few per SM; with several K ranges each writes an fp32
partial tile and the last to arrive at a per-tile counter (acquire-release atomics) sums them and writes y,
then resets the counter for the next launch (no memset, so CUDA graphs replay it as is).

Two kernels: `gemv` (M = 1, no tl.dot: fp32 FMAs of x against 16-byte loads of W, one fp32 lane per weight,
summed over K once at the end) and `dot` (tokens padded to a power of two >= 16; `swap` puts the weights on the
MMA's M side, acc [BLOCK_N, BLOCK_M], so Hopper's wgmma runs with 16 token columns). A `Config` is data:
kernel, tile, warps, stages, and `waves` (programs per SM the K splits aim for). `ops.linear` runs the kernel
only where `ADOPTED[arch]` lists the (N, K) shape and M bucket (measured faster than cuBLAS), cuBLAS elsewhere.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triton_kernels import arch, pdl, tuning
from triton_kernels.counters import arrival_counters

MAX_ROWS = 128
BUCKETS = (1, 2, 4, 9, 17, 33, 65)  # M buckets of the adoption table: the first bucket >= M
SHARED_BUDGET = {"sm_90": 200_000, "sm_120": 100_000}  # stages x (W + x tile) bytes per program


class Config(NamedTuple):
    kind: str  # "gemv" (M = 1 only), "dot" or "swap"
    block_n: int
    block_k: int
    warps: int
    stages: int
    waves: float  # programs per SM that the K splits aim for
    pdl: bool = False  # programmatic dependent launch: ask L2 for the first weight tiles, then wait for x
    tma: bool = False  # dot/swap: x and W tiles through tensor descriptors (rows past M zero-filled, not loaded)


GEMV = Config("gemv", 32, 256, 4, 3, 2)
SWAP = Config("swap", 64, 128, 4, 4, 2)
DEFAULTS = {"sm_90": {1: GEMV, None: SWAP}, "sm_120": {1: GEMV, None: SWAP}}  # when no adopted entry applies

C = Config
# arch -> (N, K) -> {M bucket: Config}: the fastest candidate of the sweep where it beat cuBLAS by >= 2% at the
# K2.6 projection shapes (bench/results/linear_h200_s11.md); shapes and buckets not listed run cuBLAS. sm_120:
# not timed, nothing adopted.
TMA_SWAP = C("swap", 64, 256, 4, 3, 1, tma=True)
ADOPTED = {
    "sm_90": {
        (2112, 7168): {1: C("gemv", 8, 512, 4, 4, 2), 2: TMA_SWAP, 4: TMA_SWAP, 9: TMA_SWAP,
                       17: C("dot", 32, 128, 4, 4, 2, tma=True)},  # q_a + kv_a
        (1536, 1536): {1: C("gemv", 16, 512, 4, 4, 1), 2: C("dot", 32, 128, 4, 4, 1, tma=True),
                       4: C("dot", 32, 128, 4, 4, 2, tma=True), 9: C("dot", 32, 128, 4, 4, 1, tma=True)},  # q_b
        (7168, 1024): {1: C("gemv", 32, 256, 4, 3, 2), 2: TMA_SWAP, 4: TMA_SWAP, 9: TMA_SWAP, 17: TMA_SWAP,
                       33: TMA_SWAP},  # o_proj, drafter o
        (512, 7168): {1: C("gemv", 16, 256, 4, 6, 1), 2: C("dot", 32, 128, 4, 4, 1, tma=True),
                      4: C("dot", 32, 128, 4, 4, 1), 9: C("dot", 32, 128, 4, 4, 1), 17: C("dot", 32, 128, 4, 4, 1),
                      33: C("dot", 32, 128, 4, 4, 1)},  # shared expert gate/up
        (7168, 256): {1: C("gemv", 32, 256, 4, 3, 2, True), 2: C("dot", 64, 128, 4, 4, 1, tma=True),
                      4: C("swap", 64, 128, 4, 4, 1), 9: C("swap", 64, 128, 4, 4, 1),
                      17: C("swap", 64, 128, 4, 4, 1), 33: C("dot", 64, 128, 4, 4, 1, tma=True),
                      65: C("dot", 64, 128, 4, 4, 1, tma=True)},  # shared expert down
        (4608, 7168): {1: C("gemv", 16, 256, 4, 6, 1), 2: C("swap", 128, 128, 4, 3, 2),
                       4: C("swap", 128, 128, 4, 3, 2)},  # dense layer and drafter gate/up
        (7168, 2304): {1: C("gemv", 32, 256, 4, 3, 2), 2: TMA_SWAP, 4: TMA_SWAP, 9: TMA_SWAP,
                       17: TMA_SWAP},  # dense layer and drafter down
        (20480, 7168): {1: C("gemv", 16, 256, 4, 6, 1), 4: C("swap", 64, 128, 4, 4, 2, True)},  # lm_head shard
        (1024, 7168): {1: C("gemv", 8, 512, 4, 4, 1), 2: C("swap", 64, 128, 4, 4, 1), 4: C("swap", 64, 128, 4, 4, 1),
                       9: C("swap", 64, 128, 4, 4, 1), 17: C("swap", 64, 128, 4, 4, 1)},  # drafter q
        (128, 7168): {1: C("gemv", 8, 1024, 4, 3, 1), 2: C("swap", 64, 256, 4, 3, 2),
                      4: C("swap", 64, 256, 4, 3, 2), 9: C("dot", 32, 128, 4, 4, 1),
                      17: C("dot", 32, 128, 4, 4, 1)},  # drafter k, v
        (7168, 43008): {1: C("gemv", 32, 256, 4, 3, 2)},  # drafter fc
    },
    "sm_120": {},
}


@triton.jit
def _partial(part_ptr, s, m, n, M, N, ok):
    """Split s's partial at (m, n): .cg reads it at L2, not from a stale L1."""
    return tl.load(part_ptr + (s * M + m) * N + n, mask=ok, other=0.0, cache_modifier=".cg")


@triton.jit
def _finish(acc, m, n, M, N, y_ptr, part_ptr, count_ptr, tile, split, splits, REDUCE_LOADS: tl.constexpr,
            RAW: tl.constexpr):
    """Store acc (fp32, rows m and columns n broadcast to its shape) to y, or as split `split`'s partial; the
    last of `splits` programs of `tile` to arrive sums the partials [splits, M, N] into y, loading REDUCE_LOADS
    partials at once. RAW: every split's partial stored for the caller to sum (no y, no counter)."""
    ok = (m < M) & (n < N)
    if RAW:
        tl.store(part_ptr + (split * M + m) * N + n, acc, mask=ok)
    elif splits == 1:
        tl.store(y_ptr + m * N + n, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + (split * M + m) * N + n, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == splits - 1:
            total = tl.zeros_like(acc)
            # several partials in flight (the L2 is busy with the other programs' weights: each round trip is
            # long); summed in split order all the same, adding +0.0 for splits past the last
            for s0 in range(0, splits, REDUCE_LOADS):
                for i in tl.static_range(REDUCE_LOADS):  # unrolled: the loads do not wait for the sums
                    total += _partial(part_ptr, s0 + i, m, n, M, N, ok & (s0 + i + 0 * m < splits))
            tl.store(y_ptr + m * N + n, total.to(y_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _prefetch_then_wait(w_rows, k_start, k_end, BLOCK_K: tl.constexpr):
    """Under programmatic dependent launch the program may start before the previous kernel ends: ask L2 for
    the first two [BN, BK] weight tiles of its K range (constant data, one PTX prefetch per 128-byte line; the whole
    range made the step 1-2.5% slower: bench/results/one_row_chain_h100.md), then wait for the previous grid
    before anything reads x or writes (y, partials and counters may reuse its memory), then let the next kernel
    launch (triton_kernels/pdl.py)."""
    lines = tl.arange(0, BLOCK_K // 64) * 64  # [BK / 64] line starts (64 bf16 a line)
    for t in tl.static_range(2):
        pdl.prefetch_l2(w_rows + tl.minimum(k_start + t * BLOCK_K + lines, k_end - 1)[None, :])
    pdl.enter(True)


@triton.jit
def _split_range(split, k_per_split, K, BLOCK_K: tl.constexpr):
    """(start, end, end of the whole BLOCK_K tiles) of K split `split` (whole tiles: all of them when EVEN_K)."""
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    return k_start, k_end, k_start + (k_end - k_start) // BLOCK_K * BLOCK_K


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in up's dtype, silu rounded to it first as torch's F.silu output is (fp32 math)."""
    gate = gate.to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    return silu * up


@triton.jit
def _load(ptrs, mask=None):
    """tl.load of ptrs, masked (zeros elsewhere) where a mask is given; unmasked loads stay pipelined."""
    if mask is None:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit
def residual_sum(x_ptrs, r_ptrs, e_ptrs, mask, ty: tl.constexpr, RESIDUAL: tl.constexpr, EXTRA: tl.constexpr):
    """(x (+ extra)) (+ residual) in ty, each add rounded to ty as torch's separate adds are (an fp32 x rounded to
    ty first). Without RESIDUAL, x alone in ty. Shared by glue's norm kernels and the gemv's norm prologue."""
    x = _load(x_ptrs, mask).to(ty)
    if EXTRA:
        x = (x.to(tl.float32) + _load(e_ptrs, mask).to(tl.float32)).to(ty)
    if RESIDUAL:
        x = (x.to(tl.float32) + _load(r_ptrs, mask).to(tl.float32)).to(ty)
    return x


@triton.jit
def inv_rms(h, D, eps, AXIS: tl.constexpr = 0):
    """1 / sqrt(mean(h^2) + eps) of the fp32 rows of h along AXIS (D values each; zeros past D)."""
    return 1.0 / tl.sqrt(tl.sum(h * h, AXIS) / D + eps)


@triton.jit
def _normed_x(x_ptr, r_ptr, e_ptr, nw_ptr, offs, rstd, ty: tl.constexpr, RESIDUAL: tl.constexpr,
              EXTRA: tl.constexpr, mask=None):
    """Columns offs of rms_norm(h) (h: `residual_sum`'s row, rstd its `inv_rms`), rounded as the norm kernels
    round it."""
    h = residual_sum(x_ptr + offs, r_ptr + offs, e_ptr + offs, mask, ty, RESIDUAL, EXTRA).to(tl.float32)
    return (h * rstd * _load(nw_ptr + offs, mask).to(tl.float32)).to(ty)


@triton.jit
def _norm_prologue(x_ptr, r_ptr, e_ptr, nw_ptr, h_ptr, xn_ptr, K, eps, store, ty: tl.constexpr,
                   BLOCK_D: tl.constexpr, RESIDUAL: tl.constexpr, EXTRA: tl.constexpr, NORMED: tl.constexpr):
    """The rstd of the row h = (x (+ extra)) (+ residual) [K], which every program computes alone; the program
    where `store` also writes h to h_ptr with RESIDUAL (the residual stream's next value) and rms_norm(h) to xn_ptr
    with NORMED (for the row's other readers: `_normed_x`, which re-reads the row from L1), each rounded as glue's
    norm kernels round them."""
    offs = tl.arange(0, BLOCK_D)
    ok = offs < K
    h = residual_sum(x_ptr + offs, r_ptr + offs, e_ptr + offs, ok, ty, RESIDUAL, EXTRA)
    rstd = inv_rms(h.to(tl.float32), K, eps)
    if store:
        if RESIDUAL:
            tl.store(h_ptr + offs, h, mask=ok)
        if NORMED:
            tl.store(xn_ptr + offs, _normed_x(x_ptr, r_ptr, e_ptr, nw_ptr, offs, rstd, ty, RESIDUAL, EXTRA, ok),
                     mask=ok)
    return rstd


@triton.jit
def _load_x(x_ptrs, K, GLU: tl.constexpr, mask=None):
    """x's tile at x_ptrs, or with GLU silu(gate) * up of the [gate ; up] row halves K apart (`silu_mul`)."""
    x = _load(x_ptrs, mask)
    if GLU:
        x = silu_mul(x, _load(x_ptrs + K, mask))
    return x


@triton.jit(do_not_specialize=["splits"])
def _gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, N, K, k_per_split, splits, stride_wn,
                 r_ptr, e_ptr, nw_ptr, h_ptr, xn_ptr, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr,
                 PDL: tl.constexpr, RAW: tl.constexpr = False, GLU: tl.constexpr = False,
                 NORM: tl.constexpr = False, RESIDUAL: tl.constexpr = False, EXTRA: tl.constexpr = False,
                 NORMED: tl.constexpr = False, BLOCK_D: tl.constexpr = 1):
    """One row: y [1, N] = x [1, K] @ W^T. Grid (N tiles, K splits). RAW: each split's fp32 partial [N] stored
    at part_ptr + split * N for the caller to sum (no y, no counter). GLU: x is [gate ; up] [1, 2K] (`_load_x`).
    NORM: the product is rms_norm(h) @ W^T (norm weight nw_ptr), h = (x (+ extra)) (+ residual) (`residual_sum`):
    each program computes the row's rstd first, program (0, 0) stores h (with RESIDUAL) at h_ptr and the normed
    row (with NORMED) at xn_ptr."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    ty: tl.constexpr = w_ptr.dtype.element_ty
    # columns past N are clamped, not masked, so the weight loads stay unmasked (pipelined)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start, k_end, k_full = _split_range(split, k_per_split, K, BLOCK_K)
    if PDL:
        _prefetch_then_wait(w_rows, k_start, k_end, BLOCK_K)
    rstd = 0.0
    if NORM:
        rstd = _norm_prologue(x_ptr, r_ptr, e_ptr, nw_ptr, h_ptr, xn_ptr, K, eps, (pid_n == 0) & (split == 0), ty,
                              BLOCK_D, RESIDUAL, EXTRA, NORMED)
    for k in tl.range(k_start, k_full, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_rows + k + offs_k[None, :])  # [BN, BK]
        if NORM:
            x = _normed_x(x_ptr, r_ptr, e_ptr, nw_ptr, k + offs_k, rstd, ty, RESIDUAL, EXTRA)
        else:
            x = _load_x(x_ptr + k + offs_k, K, GLU)  # [BK]
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if not EVEN_K and k_full < k_end:  # a ragged K's masked tail (a separate step: the loop's loads stay unmasked)
        k_ok = k_full + offs_k < k_end
        w = tl.load(w_rows + k_full + offs_k[None, :], mask=k_ok[None, :], other=0.0)
        if NORM:
            x = _normed_x(x_ptr, r_ptr, e_ptr, nw_ptr, k_full + offs_k, rstd, ty, RESIDUAL, EXTRA, k_ok)
        else:
            x = _load_x(x_ptr + k_full + offs_k, K, GLU, k_ok)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)  # [BN]
    _finish(out, tl.zeros_like(offs_n), offs_n, 1, N, y_ptr, part_ptr, count_ptr, pid_n, split, splits, 4, RAW)


@triton.jit
def _mma(x, w, acc, SWAP: tl.constexpr):
    """acc += x [BM, BK] @ w [BN, BK]^T, as acc [BN, BM] with the weights on the MMA's M side when SWAP."""
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit(do_not_specialize=["M", "splits"])
def _dot_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split, splits, stride_xm, stride_wn,
                x_desc, w_desc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr, TMA: tl.constexpr = False,
                REDUCE_LOADS: tl.constexpr = 4, RAW: tl.constexpr = False, GLU: tl.constexpr = False):
    """y [M, N] = x [M, K] @ W^T, M <= BLOCK_M. Grid (N tiles, K splits). TMA: the tiles come through x_desc
    ([BM, BK] blocks of x) and w_desc ([BN, BK] blocks of W), which zero-fill past M, N and K. GLU: x is
    [gate ; up] [M, 2K] (`_load_x`)."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past M and N are clamped, not masked: masked this loop compiled without cp.async stages
    # (Triton 3.6 and 3.9, sm_90 and sm_120); the duplicates only feed outputs that are never stored.
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    w_rows = w_ptr + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start, k_end, k_full = _split_range(split, k_per_split, K, BLOCK_K)
    if PDL:
        _prefetch_then_wait(w_rows, k_start, k_end, BLOCK_K)
    if TMA:  # the padding rows past M cost no traffic: x is about as many bytes as W per program at BM 64
        for k in range(k_start, k_end, BLOCK_K):
            x = x_desc.load([0, k])
            if GLU:
                x = silu_mul(x, x_desc.load([0, K + k]))
            acc = _mma(x, w_desc.load([pid_n * BLOCK_N, k]), acc, SWAP)
    else:
        for k in range(k_start, k_full, BLOCK_K):
            x = _load_x(x_rows + k + offs_k[None, :], K, GLU)  # [BM, BK]
            w = tl.load(w_rows + k + offs_k[None, :])  # [BN, BK]
            acc = _mma(x, w, acc, SWAP)
    if not TMA and not EVEN_K and k_full < k_end:  # a ragged K's masked tail
        k_ok = (k_full + offs_k < k_end)[None, :]
        x = _load_x(x_rows + k_full + offs_k[None, :], K, GLU, k_ok)
        w = tl.load(w_rows + k_full + offs_k[None, :], mask=k_ok, other=0.0)
        acc = _mma(x, w, acc, SWAP)
    if SWAP:
        m, n = offs_m[None, :], offs_n[:, None]
    else:
        m, n = offs_m[:, None], offs_n[None, :]
    _finish(acc, m, n, M, N, y_ptr, part_ptr, count_ptr, pid_n, split, splits, REDUCE_LOADS, RAW)


class Plan(NamedTuple):
    block_m: int
    tiles: int
    splits: int
    k_per_split: int
    stages: int


def plan(cfg, M, N, K, sms, key, glu=False):
    """The launch of `cfg` for [M, K] x [N, K]^T on `sms` SMs: K split so that N tiles x splits is about
    cfg.waves x sms, every split a whole number of K tiles; stages cut to arch `key`'s shared-memory budget."""
    block_m = _block_m(cfg, M)
    tiles = triton.cdiv(N, cfg.block_n)
    k_tiles = triton.cdiv(K, cfg.block_k)
    splits = max(1, min(k_tiles, round(cfg.waves * sms / tiles)))
    k_per_split = triton.cdiv(k_tiles, splits) * cfg.block_k
    stages = max(2, min(cfg.stages, SHARED_BUDGET[key] // _stage_bytes(cfg, block_m, glu)))
    return Plan(block_m, tiles, triton.cdiv(K, k_per_split), k_per_split, stages)


def _block_m(cfg, M):
    return 1 if cfg.kind == "gemv" else max(16, triton.next_power_of_2(M))


def _stage_bytes(cfg, block_m, glu):
    """Shared memory a pipeline stage takes: a W tile and an x tile (gate and up tiles with glu)."""
    return (cfg.block_n + block_m * (2 if glu else 1)) * cfg.block_k * 2


def glu_fits(cfg, M, key):
    """Whether `cfg` can form silu(gate) * up on its loads at M rows on arch `key`: one stage of W, gate and up
    tiles within the arch's shared-memory budget (on sm_120 not at 65-128 rows with 256-wide K tiles)."""
    return _stage_bytes(cfg, _block_m(cfg, M), True) <= SHARED_BUDGET[key]


def reduce_loads(cfg, block_m):
    """Partials the last program of a tile loads at once: 4 where a [BN, BM] fp32 tile is at most 32 registers a
    thread, else 1 (more registers a partial spill the loads in flight: bench/results/linear_probe_h200_s11.json)."""
    return 4 if cfg.block_n * block_m <= 32 * 32 * cfg.warps else 1


def bucket_of(M):
    """The adoption table's M bucket for M rows (None past the last bucket)."""
    return next((b for b in BUCKETS if M <= b), None)


def config_for(key, M):
    """The default config for M rows on arch `key` (used where no adopted entry applies)."""
    table = DEFAULTS[key]
    return table.get(M, table[None])


class Norm(NamedTuple):
    """The gemv's norm prologue (`_gemv_kernel` NORM): x is replaced by rms_norm(h), h = (x (+ extra)) (+ residual),
    h (with a residual) is stored into `h` and, where given, rms_norm(h) into `normed`: tensors of x's shape in the
    weight's dtype."""
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    extra: torch.Tensor | None = None
    h: torch.Tensor | None = None
    normed: torch.Tensor | None = None


NORM_MAX_K = 8192  # the norm prologue holds the whole row in registers: [next power of two of K] a program


def linear_kernel(x, weight, cfg=None, raw=False, glu=False, norm=None):
    """The Triton kernel alone (no cuBLAS fallback): x [M, K] (rows may be strided, unit column stride),
    weight [N, K] row-major, 1 <= M <= 128. cfg: a Config (default: `config_for`). Returns [M, N]; with raw the
    K-split fp32 partials [splits, M, N] unsummed, for a caller that sums them in its next launch. glu: x is
    [gate ; up] [M, 2K] and the product is silu(gate) * up @ W^T, the activation formed as the tiles load (the
    bits of `silu_mul` then this kernel on its output: one launch fewer). norm: a `Norm`, for the gemv at K <=
    NORM_MAX_K: the product is rms_norm((x (+ extra)) (+ residual)) @ W^T, each program computing the row's rstd
    (the norm kernel's launch saved; the rstd's sum may round apart from the norm kernel's, its order differing)."""
    M = x.shape[0]
    N, K = weight.shape
    if (not 1 <= M <= MAX_ROWS or x.shape[1] != (2 if glu else 1) * K or x.stride(1) != 1
            or weight.stride(1) != 1):
        raise ValueError(f"linear_kernel: x {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)} "
                         f"strides {weight.stride()}: needs 1 <= M <= {MAX_ROWS}, x's columns "
                         f"{'2 x ' if glu else ''}the weight's and unit column strides")
    key = arch.current(x.device)
    cfg = cfg or config_for(key, M)
    if cfg.kind == "gemv" and M != 1:
        raise ValueError(f"linear_kernel: the gemv config takes one row, got {M}")
    if glu and not glu_fits(cfg, M, key):
        raise ValueError(f"linear_kernel: {cfg} at {M} rows has no room for the gate and up tiles on {key}")
    if norm is not None and (cfg.kind != "gemv" or glu or K > NORM_MAX_K):
        raise ValueError(f"linear_kernel: the norm prologue runs on the gemv alone (no glu), K <= {NORM_MAX_K}; "
                         f"got {cfg}, K {K}, glu {glu}")
    p = plan(cfg, M, N, K, arch.sm_count(x.device), key, glu)
    part = torch.empty(p.splits * M * N if p.splits > 1 or raw else 1, dtype=torch.float32, device=x.device)
    y = part if raw else torch.empty(M, N, dtype=weight.dtype if norm else x.dtype, device=x.device)
    counters = arrival_counters("linear", x.device, p.tiles)
    even_k = K % cfg.block_k == 0
    # PTX prefetch and grid-dependency control (not interpretable): where the table measured it, or on the chain
    use_pdl = x.is_cuda and (cfg.pdl or pdl.active(x))
    launch = dict(num_warps=cfg.warps, **({"launch_pdl": True} if use_pdl else {}))
    if cfg.kind == "gemv":
        _gemv_kernel[(p.tiles, p.splits)](x, weight, y, part, counters, N, K, p.k_per_split, p.splits,
                                          weight.stride(0), *_norm_args(norm, x), BLOCK_N=cfg.block_n,
                                          BLOCK_K=cfg.block_k, EVEN_K=even_k, STAGES=p.stages, PDL=use_pdl, RAW=raw,
                                          GLU=glu, **_norm_constexprs(norm, K), **launch)
    else:
        x_desc, w_desc = _descriptors(x, weight, p.block_m, cfg) if cfg.tma and tma_ok(x, weight) else (None, None)
        _dot_kernel[(p.tiles, p.splits)](x, weight, y, part, counters, M, N, K, p.k_per_split, p.splits,
                                         x.stride(0), weight.stride(0), x_desc, w_desc, BLOCK_M=p.block_m,
                                         BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=even_k,
                                         SWAP=cfg.kind == "swap", PDL=use_pdl, TMA=x_desc is not None,
                                         REDUCE_LOADS=reduce_loads(cfg, p.block_m), RAW=raw, GLU=glu,
                                         num_stages=p.stages, **launch)
    return part.view(p.splits, M, N) if raw else y


def _norm_args(norm, x):
    """The gemv's (r_ptr, e_ptr, nw_ptr, h_ptr, xn_ptr, eps) for `norm` (x stands in for the pointers it does not
    read)."""
    if norm is None:
        return x, x, x, x, x, 0.0
    return (*(x if t is None else t for t in (norm.residual, norm.extra)), norm.weight,
            *(x if t is None else t for t in (norm.h, norm.normed)), float(norm.eps))


def _norm_constexprs(norm, K):
    if norm is None:
        return dict(NORM=False, RESIDUAL=False, EXTRA=False, NORMED=False, BLOCK_D=1)
    return dict(NORM=True, RESIDUAL=norm.residual is not None, EXTRA=norm.extra is not None,
                NORMED=norm.normed is not None, BLOCK_D=triton.next_power_of_2(K))


def tma_ok(x, weight):
    """Whether tensor descriptors can cover x and weight: 16-byte aligned bases and row strides."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, weight))


def kernel_spec(cfg, M, N, K, sms, key, raw=False, glu=False, norm=None):
    """(kernel, signature, constexprs, options) of the kernel `linear_kernel` launches under `cfg` for bf16 x [M, K]
    (contiguous; [M, 2K] with glu) and weight [N, K] on `sms` SMs, with programmatic dependent launch as on the GPU,
    compiled for arch `key` (aot.compile_for). norm: a `Norm` whose residual, extra and normed say whether they are
    given (their values unused); with extra x is fp32, as a MoE layer's routed sums are."""
    p = plan(cfg, M, N, K, sms, key, glu)
    x_type = "*fp32" if norm is not None and norm.extra is not None else "*bf16"
    signature = dict(x_ptr=x_type, w_ptr="*bf16", y_ptr="*fp32" if raw else "*bf16", part_ptr="*fp32",
                     count_ptr="*i32", N="i32", K="i32", k_per_split="i32", splits="i32")
    options = dict(arch=key, num_warps=cfg.warps, aligned=True, divisible=("N", "K", "k_per_split"))
    if cfg.kind == "gemv":
        signature.update(r_ptr="*bf16", e_ptr="*bf16", nw_ptr="*bf16", h_ptr="*bf16", xn_ptr="*bf16", eps="fp32")
        constexprs = dict(stride_wn=K, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
                          STAGES=p.stages, PDL=True, RAW=raw, GLU=glu, **_norm_constexprs(norm, K))
        return _gemv_kernel, signature, constexprs, options
    signature = dict(signature, M="i32")
    constexprs = dict(stride_xm=2 * K if glu else K, stride_wn=K, BLOCK_M=p.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0, SWAP=cfg.kind == "swap", PDL=True, TMA=cfg.tma,
                      REDUCE_LOADS=reduce_loads(cfg, p.block_m), RAW=raw, GLU=glu)
    if cfg.tma:
        signature.update(x_desc=f"tensordesc<bf16[{p.block_m}, {cfg.block_k}]>",
                         w_desc=f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>")
    else:
        constexprs.update(x_desc=None, w_desc=None)
    return _dot_kernel, signature, constexprs, dict(options, num_stages=p.stages)


def _descriptors(x, weight, block_m, cfg):
    """Tensor descriptors of x [M, K] in [block_m, BK] blocks and weight [N, K] in [BN, BK] blocks."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, cfg.block_k]),
            TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [cfg.block_n, cfg.block_k]))


def adopted(device, M, N, K):
    """The adopted Config for this shape and M on `device`, or None (cuBLAS): the tuned file's choice for the shape
    and bucket where the file in force lists it (tuning.py), else ADOPTED's."""
    bucket = bucket_of(M) if M >= 1 else None
    if bucket is None:
        return None
    key = arch.current(device)
    listed, tuned = tuning.linear_entry(key, N, K, bucket)
    if listed:
        return Config(**tuned) if tuned else None
    return ADOPTED[key].get((N, K), {}).get(bucket)


def kernel_config(x, weight):
    """The Config `linear` runs x [M, *] @ weight [N, K]^T with: the adopted entry for the shape and M bucket, for
    16-bit operands of one dtype (what it was measured with) and unit column strides; None where cuBLAS runs."""
    N, K = weight.shape
    cfg = adopted(x.device, x.shape[0], N, K)
    if (cfg is None or x.dtype not in (torch.float16, torch.bfloat16) or x.dtype != weight.dtype or x.stride(1) != 1
            or weight.stride(1) != 1):
        return None
    return cfg


def linear(x, weight):
    """See `ops.linear.linear`: the Triton kernel where `kernel_config` gives one, else cuBLAS. x: [M, K]; weight:
    [N, K]. Returns [M, N]."""
    cfg = kernel_config(x, weight)
    return F.linear(x, weight) if cfg is None else linear_kernel(x, weight, cfg)
