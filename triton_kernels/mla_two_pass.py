"""Tree attention in two passes, for query blocks too tall for the split kernel on mma.sync (sm_120).

The split kernel (mla_attention.py) holds a [rows, 512] fp32 accumulator and a [rows, 576] query per program, so
within sm_120's registers and 101,376 bytes of shared memory a program takes 16-32 rows, and every KV tile it loads
feeds only those. Here the work is two plain GEMMs, each with a small accumulator:

1. scores: S = q K^T over the 576 dims, 64 at a time, one [BM, BN] tile of (rows, entries) a program; the tile's
   mask, its row max m and p = exp2(S - m) (q's dtype) and row sum l; P [B, rows, entries] and m, l
   [B, tiles, rows] go to a workspace (each entry's scores once, no accumulator across tiles).
2. values: a split's o = sum_t exp2(m_t - M) P_t V_t / L over its tiles t, with M = max_t m_t and
   L = sum_t exp2(m_t - M) l_t, one [BM, BD] block of (rows, value columns) a program; o and its log2-sum-exp
   M + log2 L are the split's partials, merged by mla_attention's merge (or o is the output with one split).

p rounded to q's dtype before the value GEMM is what the split kernel does too; the rescale by exp2(m_t - M) <= 1
is applied in fp32 before that rounding. Splits are contiguous runs of score tiles (`tile_range`)."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton_kernels import pdl
from triton_kernels.mla_splits import D_LAT, ENTRY, choose_splits, visible

BLOCK_K = 64  # query/key dims a step of the scores' loop (576 = 9 steps)
TAIL_M = tl.constexpr(16)  # rows of the scores pass's short last row block (the least a tl.dot takes)


class TwoPassTiles(NamedTuple):
    """The scores kernel's [scores_m, scores_n] tile, warps and pipeline stages, and the values kernel's
    [values_m, values_d] block (value columns: a divisor of 512), warps and stages."""

    scores_m: int
    scores_n: int
    scores_warps: int
    scores_stages: int
    values_m: int
    values_d: int
    values_warps: int
    values_stages: int


@triton.jit(do_not_specialize=["T", "rows_kb", "n_tiles"])
def _scores_kernel(q_ptr, kv_ptr, lens_ptr, mask_ptr, p_ptr, m_ptr, l_ptr, T, rows_kb, p_cols, n_tiles,
                   sm_scale_log2, H: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """Tile (pid 0: rows, pid 1: entries) of sequence pid 2: p = exp2(S - m), m and l per row (module docstring);
    nothing for a tile wholly past the sequence's length. A last row block of at most TAIL_M rows (a tree of
    2^k + 1 nodes leaves one token's H rows) runs as a TAIL_M-row tile, not a BLOCK_M one mostly masked."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2)
    rows = T * H
    pdl.wait(PDL)
    length = tl.load(lens_ptr + b)
    if pid_n * BLOCK_N < length:
        if rows - pid_m * BLOCK_M <= TAIL_M:
            _scores_tile(q_ptr, kv_ptr, mask_ptr, p_ptr, m_ptr, l_ptr, b, pid_m * BLOCK_M, pid_n, length, T, rows_kb,
                         p_cols, n_tiles, sm_scale_log2, H, CAUSAL, TAIL_M, BLOCK_N, BLOCK_K, STAGES)
        else:
            _scores_tile(q_ptr, kv_ptr, mask_ptr, p_ptr, m_ptr, l_ptr, b, pid_m * BLOCK_M, pid_n, length, T, rows_kb,
                         p_cols, n_tiles, sm_scale_log2, H, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
    pdl.release(PDL)


@triton.jit
def _scores_tile(q_ptr, kv_ptr, mask_ptr, p_ptr, m_ptr, l_ptr, b, row0, pid_n, length, T, rows_kb, p_cols, n_tiles,
                 sm_scale_log2, H: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """The scores kernel's work for rows [row0, row0 + BLOCK_M) and entry tile pid_n of sequence b (the tile holds
    entries)."""
    rows = T * H
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < rows
    # masked loads, not clamped rows as the values pass: 1.1-2x faster here (attention_two_pass_h100.md)
    n_ok = offs_n < length
    q_rows = q_ptr + (b.to(tl.int64) * rows + offs_m)[:, None] * 576 + offs_k[None, :]
    k_rows = kv_ptr + (b.to(tl.int64) * rows_kb + offs_n)[:, None] * 576 + offs_k[None, :]
    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, 576, BLOCK_K, num_stages=STAGES):
        q = tl.load(q_rows + k0, mask=m_ok[:, None], other=0.0)
        k = tl.load(k_rows + k0, mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), s)
    s = s * sm_scale_log2
    if (pid_n + 1) * BLOCK_N > length - T:  # a tile holding tree entries or the sequence's end
        seen = visible(offs_m, offs_n, length, length - T, T, b, mask_ptr, H, CAUSAL, GATHER=False)
        s = tl.where(seen, s, float("-inf"))
    m = tl.max(s, 1)  # [BM]; -inf where the row sees nothing here
    m = tl.where(m > float("-inf"), m, -1.0e30)  # finite: exp2(m - M) is 0, not nan
    p = tl.exp2(s - m[:, None])
    p_rows = p_ptr + (b.to(tl.int64) * rows + offs_m)[:, None] * p_cols + offs_n[None, :]
    tl.store(p_rows, p.to(p_ptr.dtype.element_ty), mask=m_ok[:, None])
    stats = (b.to(tl.int64) * n_tiles + pid_n) * rows + offs_m
    tl.store(m_ptr + stats, m, mask=m_ok)
    tl.store(l_ptr + stats, tl.sum(p, 1), mask=m_ok)


@triton.jit
def tile_range(length, pid_s, num_splits, BLOCK_N: tl.constexpr):
    """(first, end) score tiles of split pid_s: the sequence's tiles cut into num_splits contiguous runs."""
    tiles = tl.cdiv(length, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    first = pid_s * per_split
    return first, tl.minimum(first + per_split, tiles)


@triton.jit(do_not_specialize=["T", "rows_kb", "n_tiles"])
def _values_kernel(p_ptr, m_ptr, l_ptr, kv_ptr, lens_ptr, out_ptr, o_part_ptr, lse_part_ptr, T, rows_kb, p_cols,
                   n_tiles, H: tl.constexpr, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """Block (pid 0: rows x value columns) of split pid 1 of sequence pid 2: o over the split's score tiles
    (module docstring), to out (DIRECT) or as partials o [B, splits, rows, 512], lse [B, splits, rows]; an empty
    split stores lse = -inf only."""
    col_blocks: tl.constexpr = 512 // BLOCK_D
    pid_m = tl.program_id(0) // col_blocks
    pid_d = tl.program_id(0) % col_blocks
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    num_splits = tl.num_programs(1)
    rows = T * H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_ok = offs_m < rows
    pdl.wait(PDL)
    length = tl.load(lens_ptr + b)
    first, end = tile_range(length, pid_s, num_splits, BLOCK_N)
    stats = m_ptr + (b.to(tl.int64) * n_tiles + first) * rows + offs_m
    big_m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    for t in range(first, end):
        big_m = tl.maximum(big_m, tl.load(stats + (t - first) * rows, mask=m_ok, other=-1.0e30))
    # Clamped, not masked (unmasked loads): rows past `rows` are never stored, and past the length p is 0 (pass 1
    # stored exp2(-inf)), so the clamped entries' values (finite: they are the last entry's) add nothing.
    p_rows = p_ptr + (b.to(tl.int64) * rows + tl.minimum(offs_m, rows - 1))[:, None] * p_cols + offs_n[None, :]
    v_base = kv_ptr + b.to(tl.int64) * rows_kb * 576 + offs_d[None, :]
    big_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for t in tl.range(first, end, num_stages=STAGES):
        at = (b.to(tl.int64) * n_tiles + t) * rows + offs_m
        rescale = tl.exp2(tl.load(m_ptr + at, mask=m_ok, other=-1.0e30) - big_m)  # [BM]
        big_l += rescale * tl.load(l_ptr + at, mask=m_ok, other=0.0)
        p = tl.load(p_rows + t * BLOCK_N)
        v = tl.load(v_base + tl.minimum(t * BLOCK_N + offs_n, length - 1)[:, None] * 576)
        acc = tl.dot((p.to(tl.float32) * rescale[:, None]).to(v.dtype), v, acc)
    o = acc / tl.where(big_l > 0, big_l, 1.0)[:, None]
    if DIRECT:
        o_rows = out_ptr + (b.to(tl.int64) * rows + offs_m)[:, None] * 512
        tl.store(o_rows + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:
        part_row = (b.to(tl.int64) * num_splits + pid_s) * rows + offs_m
        tl.store(o_part_ptr + part_row[:, None] * 512 + offs_d[None, :], o.to(o_part_ptr.dtype.element_ty),
                 mask=(m_ok & (first + 0 * offs_m < end))[:, None])
        lse = tl.where(big_l > 0, big_m + tl.log2(tl.where(big_l > 0, big_l, 1.0)), float("-inf"))
        tl.store(lse_part_ptr + part_row, lse, mask=m_ok & (pid_d + 0 * offs_m == 0))
    pdl.release(PDL)


def default_splits(tiles, rows, B, max_len, sms, per_sm):
    """Splits per sequence: about per_sm values programs per SM (each split has B x row blocks x column blocks of
    them), each split at least mla_splits.MIN_TILES_PER_SPLIT score tiles (`choose_splits`)."""
    base = B * triton.cdiv(rows, tiles.values_m) * (D_LAT // tiles.values_d)
    return choose_splits(base, max_len, tiles.scores_n, sms, per_sm)


def run(q, kv_cache, cache_lens, mask, o_part, lse_part, splits, sm_scale_log2, causal, tiles):
    """Both passes for q [B, T, H, 576] over kv_cache [B, L_max, 576]: with one split the output into o_part
    ([B, T, H, 512]), else the splits' partials into o_part [B, splits, rows, 512] and lse_part [B, splits, rows]
    (mla_attention's launcher contract). mask: the packed tree mask, or cache_lens where causal."""
    _, T, H, _ = q.shape
    probs, row_max, row_sum = scores(q, kv_cache, cache_lens, mask, sm_scale_log2, causal, tiles)
    values(probs, row_max, row_sum, kv_cache, cache_lens, o_part, lse_part, splits, T, H, tiles)


def scores(q, kv_cache, cache_lens, mask, sm_scale_log2, causal, tiles):
    """The first pass: P [B, rows, tiles x scores_n] in q's dtype, and m, l [B, tiles, rows] fp32."""
    B, T, H, _ = q.shape
    rows = T * H
    n_tiles = triton.cdiv(kv_cache.shape[1], tiles.scores_n)
    probs = torch.empty(B, rows, n_tiles * tiles.scores_n, dtype=q.dtype, device=q.device)
    row_max = torch.empty(B, n_tiles, rows, dtype=torch.float32, device=q.device)
    row_sum = torch.empty_like(row_max)
    _scores_kernel[(triton.cdiv(rows, tiles.scores_m), n_tiles, B)](
        q, kv_cache, cache_lens, mask, probs, row_max, row_sum, T, kv_cache.stride(0) // ENTRY, probs.shape[2],
        n_tiles, sm_scale_log2, H=H, CAUSAL=causal, BLOCK_M=tiles.scores_m, BLOCK_N=tiles.scores_n,
        BLOCK_K=BLOCK_K, STAGES=tiles.scores_stages, num_warps=tiles.scores_warps, **pdl.options(q))
    return probs, row_max, row_sum


def values(probs, row_max, row_sum, kv_cache, cache_lens, o_part, lse_part, splits, T, H, tiles):
    """The second pass over the first's outputs (`scores`), into o_part and lse_part as `run` says."""
    B, rows, p_cols = probs.shape
    grid = (triton.cdiv(rows, tiles.values_m) * (D_LAT // tiles.values_d), splits, B)
    _values_kernel[grid](
        probs, row_max, row_sum, kv_cache, cache_lens, o_part, o_part, lse_part, T, kv_cache.stride(0) // ENTRY,
        p_cols, row_max.shape[1], H=H, DIRECT=splits == 1, BLOCK_M=tiles.values_m, BLOCK_D=tiles.values_d,
        BLOCK_N=tiles.scores_n, STAGES=tiles.values_stages, num_warps=tiles.values_warps, **pdl.options(probs))


def kernel_specs(tiles, key, causal=False, H=8, splits=2, partials="bf16"):
    """[(kernel, signature, constexprs, options)] of both passes as `run` launches them with `tiles` on arch `key`
    (bf16, PDL; partials: their dtype, fp32 or bf16), for aot.compile_for."""
    common = {"lens_ptr": "*i32", "T": "i32", "rows_kb": "i32", "p_cols": "i32", "n_tiles": "i32"}
    scores = dict(common, q_ptr="*bf16", kv_ptr="*bf16", mask_ptr="*i32", p_ptr="*bf16", m_ptr="*fp32",
                  l_ptr="*fp32", sm_scale_log2="fp32")
    values = dict(common, p_ptr="*bf16", m_ptr="*fp32", l_ptr="*fp32", kv_ptr="*bf16", out_ptr="*bf16",
                  o_part_ptr=f"*{partials}", lse_part_ptr="*fp32")
    return [
        (_scores_kernel, scores, dict(H=H, CAUSAL=causal, BLOCK_M=tiles.scores_m, BLOCK_N=tiles.scores_n,
                                      BLOCK_K=BLOCK_K, STAGES=tiles.scores_stages, PDL=True),
         dict(arch=key, num_warps=tiles.scores_warps, num_stages=tiles.scores_stages, aligned=True,
              divisible=("p_cols",))),
        (_values_kernel, values, dict(H=H, DIRECT=splits == 1, BLOCK_M=tiles.values_m, BLOCK_D=tiles.values_d,
                                      BLOCK_N=tiles.scores_n, STAGES=tiles.values_stages, PDL=True),
         dict(arch=key, num_warps=tiles.values_warps, num_stages=tiles.values_stages, aligned=True,
              divisible=("p_cols",))),
    ]
