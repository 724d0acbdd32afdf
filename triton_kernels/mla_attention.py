"""Tree-masked absorbed-MLA attention over the latent cache (split-KV flash-decoding), and the cache writer.

All H heads x T new tokens of a sequence form one query block of R = T*H rows (row r = t*H + h, q[b] viewed
as [R, 576]), so every KV tile loaded is shared by all of them and the prefix is read once per split.
Grid (query tiles x value parts, splits, B). A split covers a contiguous range of the sequence's entries,
sized on the device from cache_lens (no host sync, CUDA-graph safe); tiles wholly inside the prefix run
unmasked, the rest (the last T entries, the tree) apply the bit mask or, with mask None (prefill), the causal
rule. With one split the kernel writes the output; otherwise it writes per-split (o, log2-sum-exp) and
`_merge_kernel` combines them. See the attention section of triton_kernels/README.md for the derivations.
"""

import functools
import heapq
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton_kernels import pdl
from triton_kernels.moe_configs import sm_count

D_LAT = 512  # value dim: the latent c
D_PE = 64  # rope part of an entry
ENTRY = D_LAT + D_PE

class Entry(NamedTuple):
    """One row of CONFIGS: a config for query blocks of up to max_rows rows, and its split-count cost model."""

    max_rows: int | None  # R = T*H up to this (None: any); the first entry that fits is used
    config: tuple  # (BLOCK_M, BLOCK_N, warps, stages, BLOCK_DV, UNCHAIN)
    slots: int  # programs resident per SM (shared memory, registers)
    tile_us: float  # a program's time per KV tile (fitted to H200 timings; on sm_120 a guess)
    program_us: float  # a program's fixed time: prologue, partial store, masked tail
    partials: torch.dtype | None  # dtype of the per-split outputs (None: q's)
    tma: bool = False  # the unmasked loop's tiles through tensor descriptors (needs BLOCK_DV 512)


# Configs as data, per arch (compute capability major*10+minor). config = (BLOCK_M, BLOCK_N, warps, stages,
# BLOCK_DV, UNCHAIN); BLOCK_DV 256 splits the values over two programs per query tile, UNCHAIN computes QK^T once
# per program instead of once per warpgroup (see _softmax_step); both are tuning options. The split count is the
# candidate (SPLIT_PER_SLOT programs per slot) with the least modelled time (split_cost).
CONFIGS = {
    90: [  # the fastest measured on the H200, cache cold, CUDA graph (bench/results/attention_h200_run4.md; TMA:
        # run 8, 8-19% faster at 32k where T*H > 64, within 3% elsewhere; the 16-row config's TMA is untimed)
        Entry(16, (16, 32, 4, 3, 512, False), 2, 1.28, 10.0, None),  # 93 KB of shared memory, mma.sync
        Entry(64, (64, 64, 8, 2, 512, True), 1, 3.2, 10.0, None, True),  # 229 KB: one per SM, wgmma
        Entry(None, (64, 64, 8, 2, 512, True), 1, 3.2, 10.0, torch.float32, True),
    ],
    120: [  # compile-checked only (tests/test_attention_kernel.py): fit 101,376 bytes, no spills; untimed
        Entry(16, (16, 32, 4, 2, 512, False), 1, 1.28, 10.0, torch.float32),
        Entry(None, (32, 32, 8, 2, 512, False), 1, 1.6, 10.0, torch.float32),
    ],
}
# Split-count candidates per arch: this many programs per resident slot of the GPU (sm_120: one, untimed).
SPLIT_PER_SLOT = {90: (0.5, 1, 2, 4), 120: (1,)}
# Split rule per arch: (window, whole). The cost is averaged over cache lengths max_len, max_len - BLOCK_N, ...
# (window of them): the kernel splits the actual length, which a padded cache (the model's, sized for the largest
# context) puts below max_len, and where the last split is empty at max_len it is not a tile lower. whole: the
# counts that fill whole waves (floor) are candidates beside the ceil ones. (8, True) measured on the H200 (run 5):
# the fastest count in 20 of 25 cases, within 4.3% in the rest; sm_120 follows it untimed.
SPLIT_RULE = {90: (8, True), 120: (8, True)}
MERGE_COST = {90: (4.0, 0.5), 120: (4.0, 0.5)}  # merge: us per launch, us per MB of partials (written + read)
# Pipeline stages of the masked tail loop (a few tiles): on sm_90 one, which frees the shared memory of a
# second pipeline for larger tiles; on sm_120 (mma.sync) the pipelined tail uses less shared memory.
TAIL_STAGES = {90: 1, 120: None}  # None: the config's stages
# Tree attention with several splits: the last split takes the tiles holding tree entries (masked, slower) and the
# others split the prefix, so that no program runs a whole split and the masked tiles too. By default where the
# tree spans at most TAIL_SPLIT[arch] tiles (H200: 1-6% faster at T*H = 64 and 256, up to 13% at the 4k step's
# T 65 (2 tiles); 4-9% slower at its T 129 (3 tiles); the verify step's graph 1.4% faster at budget 64 but 2.6%
# slower at budget 8, not understood: bench/results/step_h200.md, session 10). A masked tile costs about
# TAIL_TILE_COST unmasked ones in the split model (%globaltimer stamps, 64-row tiles: ~10 against ~4-5 us).
# sm_120 follows sm_90, untimed.
TAIL_SPLIT = {90: 2, 120: 2}
# The split kernel hand-scheduled in Gluon (`mla_gluon.py`, Hopper, bf16, the 64x64 config) instead of Triton's, by
# default per arch (sm_120 has no wgmma). H200, at the op's defaults with a tree, us: its warp-specialized "seesaw"
# schedule (session 14, attention_gluon_h200_s14_seesaw.json) against session 13's Gluon kernel and (session 13,
# attention_h200.md) Triton's: 32k H 64 T 1 23.9 / 23.9 / 30.3, H 8 T 32 44.4 / 53.7 / 66.0, H 64 T 8 72.3 / 93.5
# / 109.1; 128k H 64 T 1 52.3 / 57.0 / 68.0; the 4k verify's T 9 15.8 / 16.2 / 16.7.
GLUON = {90: True, 120: False}
TAIL_TILE_COST = 2.0
# The merge's blocks by the splits' next power of two (up to MERGE_MAX_SPLITS_BLOCK): MERGE_BLOCKS[that] = (BLOCK_S
# splits a step, BLOCK_D values of a row a program, warps), the fastest measured on the H200 with 16-bit partials, the
# Gluon kernel's and the 16-row config's (bench/results/attention_merge_h200_s13.md, the merge alone at the defaults'
# split counts: e.g. 256 rows x 33 splits 4.26 us against 5.44 with the earlier 64 x 256, 1,032 x 7 3.05 against
# 7.75). At most 64 splits a whole row a program on 2 warps, a few splits a step. sm_120 follows, untimed.
MERGE_MAX_SPLITS_BLOCK = 512
MERGE_BLOCKS = {512: (512, 32, 2), 256: (256, 64, 2), 128: (128, 64, 2), 64: (16, 512, 2), 32: (32, 512, 2),
                16: (16, 512, 2), 8: (8, 512, 2)}
MIN_TILES_PER_SPLIT = 4  # a split reads at least this many KV tiles


@triton.jit
def _scores(q_own, q_other, q_pe, kv_base, offs_n, n_ok, offs_own, offs_other, offs_pe, sm_scale_log2,
            SPLIT_V: tl.constexpr, UNCHAIN: tl.constexpr):
    """Scores of a query block against one KV tile (log2 domain), and the tile's value columns this program owns.

    The latent is loaded as the owned value columns plus (SPLIT_V) the other half, so the values need no slice.
    """
    row = offs_n.to(tl.int64)[:, None] * 576
    k_own = tl.load(kv_base + row + offs_own[None, :], mask=n_ok[:, None], other=0.0)  # [BN, DV]
    k_pe = tl.load(kv_base + row + 512 + offs_pe[None, :], mask=n_ok[:, None], other=0.0)  # [BN, 64]
    s_rest = tl.dot(q_pe, tl.trans(k_pe))  # [BM, BN] fp32
    if SPLIT_V:
        k_other = tl.load(kv_base + row + offs_other[None, :], mask=n_ok[:, None], other=0.0)  # [BN, DO]
        s_rest += tl.dot(q_other, tl.trans(k_other))
    return _sum_scores(q_own, k_own, s_rest, sm_scale_log2, UNCHAIN), k_own


@triton.jit
def _tma_scores(q_own, q_pe, lat_desc, pe_desc, row, sm_scale_log2, UNCHAIN: tl.constexpr):
    """_scores for a tile wholly inside the cache, loaded through tensor descriptors (TMA): no address registers."""
    k_own = lat_desc.load([row, 0])  # [BN, 512]
    k_pe = pe_desc.load([row, 0])  # [BN, 64]
    return _sum_scores(q_own, k_own, tl.dot(q_pe, tl.trans(k_pe)), sm_scale_log2, UNCHAIN), k_own


@triton.jit
def _sum_scores(q_own, k_own, s_rest, sm_scale_log2, UNCHAIN: tl.constexpr):
    """(q_own k_own^T + s_rest) * scale, [BM, BN] fp32."""
    if UNCHAIN:  # scaled before the sum: `dot + x` would become the dot's accumulator, chaining the two dots
        return tl.dot(q_own, tl.trans(k_own)) * sm_scale_log2 + s_rest * sm_scale_log2
    return (tl.dot(q_own, tl.trans(k_own)) + s_rest) * sm_scale_log2


@triton.jit
def _probs(s, m_i, l_i, dtype: tl.constexpr):
    """Online-softmax update of (max, sum) with log2-domain scores s [BM, BN]: (max, sum, p, acc rescale)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BM]; m_i starts finite, so no inf - inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [BM, BN]
    return m_new, l_i * alpha + tl.sum(p, 1), p.to(dtype), alpha


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, live, UNCHAIN: tl.constexpr):
    """Online-softmax step with a tile of log2-domain scores s [BM, BN] and its values v [BN, DV].

    UNCHAIN: the softmax runs under `if live` (always true at run time), a branch Triton's layout choice does
    not look through, so QK^T is not a chained dot: its warps split S's columns (each warpgroup computes its
    half once) instead of every warpgroup computing the whole S (see triton_kernels/README.md).
    """
    if UNCHAIN:
        if live:
            m_new, l_i, p, alpha = _probs(s, m_i, l_i, v.dtype)
        else:
            m_new, p, alpha = m_i, s.to(v.dtype), m_i
    else:
        m_new, l_i, p, alpha = _probs(s, m_i, l_i, v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p, v)  # [BM, DV]
    return m_new, l_i, acc


@triton.jit
def program_range(length, T, pid_m, pid_s, num_splits, H: tl.constexpr, CAUSAL: tl.constexpr,
                  TAIL_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tree_start, start, end, n_full) of split pid_s of query tile pid_m for a sequence of `length` entries whose
    last T are the tree: its entries [start, end), the first n_full of its tiles wholly visible. Shared with the
    Gluon kernel (mla_gluon.py)."""
    tree_start = length - T  # first new token's entry
    kv_end = length
    if CAUSAL:  # entries past this tile's last token are invisible to all its rows
        t_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // H, T - 1)
        kv_end = tree_start + t_last + 1
    if TAIL_SPLIT:  # the last split takes the tiles holding tree entries, the others split the prefix's tiles
        prefix_end = tree_start // BLOCK_N * BLOCK_N
        split_len = tl.cdiv(tl.cdiv(prefix_end, num_splits - 1), BLOCK_N) * BLOCK_N
        is_tail = pid_s == num_splits - 1
        start = tl.where(is_tail, prefix_end, pid_s * split_len)
        end = tl.where(is_tail, kv_end, tl.minimum(start + split_len, prefix_end))
    else:
        split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        start = pid_s * split_len
        end = tl.minimum(start + split_len, kv_end)
    n_full = tl.maximum(tl.minimum(end, tree_start) - start, 0) // BLOCK_N  # tiles with every entry visible
    return tree_start, start, end, n_full


@triton.jit(do_not_specialize=["T", "rows_kb"])
def _mla_split_kernel(
    q_ptr, kv_ptr, lens_ptr, mask_ptr, out_ptr, o_part_ptr, lse_part_ptr, lat_desc, pe_desc,
    T, rows_kb, sm_scale_log2,
    H: tl.constexpr, CAUSAL: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DO: tl.constexpr,
    TAIL_STAGES: tl.constexpr, UNCHAIN: tl.constexpr, TMA: tl.constexpr, TAIL_SPLIT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    SPLIT_V: tl.constexpr = BLOCK_DV < 512  # NV programs per query tile, each owning BLOCK_DV value columns
    NV: tl.constexpr = 512 // BLOCK_DV
    pid_m = tl.program_id(0) // NV
    pid_v = tl.program_id(0) % NV
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    num_splits = tl.num_programs(1)
    rows = T * H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row = t*H + h
    m_ok = offs_m < rows
    t_row = offs_m // H  # [BM] new token of each row
    offs_own = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)  # value columns written by this program
    offs_other = (1 - pid_v) * BLOCK_DO + tl.arange(0, BLOCK_DO)  # the rest of the latent (SPLIT_V: NV == 2)
    offs_pe = tl.arange(0, 64)

    pdl.wait(PDL)  # released at the end (pdl.py): the merge's programs do not wait beside this grid
    length = tl.load(lens_ptr + b)
    tree_start, start, end, n_full = program_range(length, T, pid_m, pid_s, num_splits, H, CAUSAL, TAIL_SPLIT,
                                                   BLOCK_M, BLOCK_N)
    # an empty split (no entry) loads no query and stores no o, only lse = -inf
    q_ok = m_ok & (start + 0 * offs_m < end)

    q_rows = q_ptr + (b.to(tl.int64) * rows + offs_m)[:, None] * 576
    q_own = tl.load(q_rows + offs_own[None, :], mask=q_ok[:, None], other=0.0)  # [BM, DV]
    if SPLIT_V:
        q_other = tl.load(q_rows + offs_other[None, :], mask=q_ok[:, None], other=0.0)  # [BM, DO]
    else:
        q_other = tl.zeros([BLOCK_M, BLOCK_DO], dtype=q_ptr.dtype.element_ty)  # unused
    q_pe = tl.load(q_rows + 512 + offs_pe[None, :], mask=q_ok[:, None], other=0.0)  # [BM, 64]
    kv_base = kv_ptr + b.to(tl.int64) * rows_kb * 576  # rows_kb: cache stride in entries; keeps 16-byte alignment

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    offs_tile = tl.arange(0, BLOCK_N)
    n_all = tl.full([BLOCK_N], 1, tl.int1)
    for i in range(n_full):
        if TMA:  # descriptors over the cache as [rows, 576]: [BN, 512] latent and [BN, 64] rope tiles
            s, v = _tma_scores(q_own, q_pe, lat_desc, pe_desc, b * rows_kb + start + i * BLOCK_N, sm_scale_log2,
                               UNCHAIN)
        else:
            offs_n = start + i * BLOCK_N + offs_tile  # [BN]
            s, v = _scores(q_own, q_other, q_pe, kv_base, offs_n, n_all, offs_own, offs_other, offs_pe,
                           sm_scale_log2, SPLIT_V, UNCHAIN)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, rows > 0, UNCHAIN)
    for j0 in tl.range(start + n_full * BLOCK_N, end, BLOCK_N, num_stages=TAIL_STAGES):  # the last few tiles
        offs_n = j0 + offs_tile  # [BN]
        n_ok = offs_n < end
        s, v = _scores(q_own, q_other, q_pe, kv_base, offs_n, n_ok, offs_own, offs_other, offs_pe, sm_scale_log2,
                       SPLIT_V, UNCHAIN)
        node = offs_n - tree_start  # [BN] new-token index of each entry (< 0: prefix)
        in_tree = node >= 0
        if CAUSAL:
            seen = node[None, :] <= t_row[:, None]  # [BM, BN]
        else:
            node_c = tl.maximum(node, 0)
            word_ptr = mask_ptr + (b * T + t_row)[:, None] * ((T + 31) // 32) + (node_c // 32)[None, :]
            words = tl.load(word_ptr, mask=m_ok[:, None] & (in_tree & n_ok)[None, :], other=0)  # [BM, BN]
            seen = ((words >> (node_c % 32)[None, :]) & 1) != 0
        visible = n_ok[None, :] & (~in_tree[None, :] | seen)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, rows > 0, UNCHAIN)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [BM, DV]
    if DIRECT:
        o_rows = out_ptr + (b.to(tl.int64) * rows + offs_m)[:, None] * 512
        tl.store(o_rows + offs_own[None, :], o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:
        part_row = (b.to(tl.int64) * num_splits + pid_s) * rows + offs_m  # [BM]
        tl.store(o_part_ptr + part_row[:, None] * 512 + offs_own[None, :], o.to(o_part_ptr.dtype.element_ty),
                 mask=q_ok[:, None])
        # [BM] log2-sum-exp of the split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_part_ptr + part_row, lse, mask=m_ok & (pid_v + 0 * offs_m == 0))
    pdl.release(PDL)


@triton.jit(do_not_specialize=["rows", "num_splits"])
def _merge_kernel(o_part_ptr, lse_part_ptr, out_ptr, rows, num_splits,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """One pass over the splits, BLOCK_S at a time (all of them in one step when BLOCK_S >= num_splits)."""
    pdl.enter(PDL)
    r = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    part0 = b.to(tl.int64) * num_splits * rows + r  # split 0 of this row
    m = tl.full([1], -1.0e30, dtype=tl.float32)  # finite start: empty splits (lse -inf) weigh exp2(-inf) = 0
    w_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_ok = s0 + offs_s < num_splits
        part = part0 + (s0 + offs_s) * rows  # [BS]
        lse = tl.load(lse_part_ptr + part, mask=s_ok, other=float("-inf"))  # [BS]
        o_ok = s_ok & (lse > float("-inf"))  # an empty split stored no o
        o = tl.load(o_part_ptr + part[:, None] * 512 + offs_d[None, :], mask=o_ok[:, None], other=0.0)  # [BS, BD]
        o = o.to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, 0))
        keep = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)  # [BS]
        acc = acc * keep + tl.sum(w[:, None] * o, 0)
        w_sum = w_sum * keep + tl.sum(w, 0)
        m = m_new
    out = acc / w_sum
    tl.store(out_ptr + (b.to(tl.int64) * rows + r) * 512 + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["T", "stride_kb", "L_max"])
def _write_kv_kernel(kv_ptr, entries_ptr, starts_ptr, T, stride_kb, L_max, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0)
    b = tl.program_id(1)
    pos = tl.load(starts_ptr + b).to(tl.int64) + t
    offs = tl.arange(0, BLOCK_D)
    d_ok = offs < D
    row = tl.load(entries_ptr + (b.to(tl.int64) * T + t) * D + offs, mask=d_ok)  # [BLOCK_D]
    tl.store(kv_ptr + b.to(tl.int64) * stride_kb + pos * D + offs, row.to(kv_ptr.dtype.element_ty),
             mask=d_ok & (pos + 0 * offs < L_max))


def _arch():
    if not torch.cuda.is_available():
        return 90
    major, minor = torch.cuda.get_device_capability()
    return 120 if major >= 12 else 90


def entry_for(rows, arch=None):
    """The CONFIGS entry used for a query block of `rows` = T*H rows on `arch` (None: this machine's)."""
    for entry in CONFIGS[arch if arch is not None else _arch()]:
        if entry.max_rows is None or rows <= entry.max_rows:
            return entry
    raise ValueError(f"no attention config for {rows} rows")


def pick_config(rows, arch=None):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, BLOCK_DV, UNCHAIN) for a query block of `rows` = T*H rows on `arch`."""
    return entry_for(rows, arch).config


def choose_splits(base, max_len, block_n, slots, per_slot, whole=False):
    """Splits per sequence: about per_slot programs per slot over `slots` resident programs with `base` programs
    per split (whole: at most that many, so the programs fill whole waves), each split reading at least
    MIN_TILES_PER_SPLIT tiles of the max_len-entry cache, unless so few splits would leave more than half of one
    wave's slots idle (short caches): then up to one wave of splits, down to one tile each."""
    want = math.floor(per_slot * slots / base) if whole else math.ceil(per_slot * slots / base)
    cap = max(1, triton.cdiv(max_len, block_n * MIN_TILES_PER_SPLIT))
    wave = max(1, slots // base)
    if cap < wave // 2:
        cap = min(wave, triton.cdiv(max_len, block_n))
    return max(1, min(want, cap))


def split_bounds(splits, length, block_n):
    """(start, end) entries of each of `splits` splits of `length` entries (the kernel's rule)."""
    split_len = triton.cdiv(triton.cdiv(length, splits), block_n) * block_n
    return [(min(length, s * split_len), min(length, (s + 1) * split_len)) for s in range(splits)]


def split_work(splits, length, block_n, tree=0, tail=False):
    """Each split's work in unmasked KV tiles, by the kernel's rule: a split's tiles before the tree's first entry
    run unmasked, the rest (the tree's, a ragged end) masked, each at TAIL_TILE_COST where there is a tree (tree:
    its entries at the end of the cache; 0: no tree mask, every tile alike). tail: the last split takes the tree's
    tiles (TAIL_SPLIT)."""
    tree_start = length - tree
    if tail and splits > 1:
        prefix = tree_start // block_n * block_n
        bounds = split_bounds(splits - 1, prefix, block_n) + [(prefix, length)]
    else:
        bounds = split_bounds(splits, length, block_n)
    masked_cost = TAIL_TILE_COST if tree else 1.0
    work = []
    for start, end in bounds:
        full = max(0, min(end, tree_start) - start) // block_n
        work.append(full + masked_cost * triton.cdiv(max(0, end - start - full * block_n), block_n))
    return work


def split_cost(splits, base, max_len, entry, slots, partial_bytes, merge_cost, tree=0, tail=False):
    """Modelled time (us) with `splits` splits: the split kernel's programs (`base` per split, each tile_us per KV
    tile of its split's work (split_work) + program_us, in launch order) list-scheduled over `slots`, plus the
    merge of `partial_bytes` per split."""
    work = split_work(splits, max_len, entry.config[1], tree, tail)
    free = [0.0] * slots  # heap of the times the slots become free
    for s in range(splits):
        for _ in range(base):
            heapq.heappush(free, heapq.heappop(free) + entry.tile_us * work[s] + entry.program_us)
    merge = merge_cost[0] + merge_cost[1] * splits * partial_bytes / 1e6 if splits > 1 else 0.0
    return max(free) + merge


@functools.lru_cache(maxsize=4096)
def default_splits(entry, rows, B, max_len, sms, arch, value_bytes, every=False, rule=None, tree=0, tail=False):
    """The split count of the least modelled time among SPLIT_PER_SLOT's candidates (every: among all counts up to
    the cap) with `entry` (of CONFIGS), for B sequences of `rows` query rows over a max_len-entry cache on `sms` SMs
    of `arch` (partials: value_bytes a value). rule: (window, whole) overriding SPLIT_RULE[arch]; tree: the entries
    under a tree mask at the end of the cache; tail: the last split takes the tree's tiles (each candidate count
    and one more, for the tail's split)."""
    block_m, block_n, _, _, block_dv, _ = entry.config
    window, whole = rule or SPLIT_RULE[arch]
    grid_m = triton.cdiv(rows, block_m) * (D_LAT // block_dv)
    slots = sms * entry.slots
    counts = {choose_splits(B * grid_m, max_len, block_n, slots, n, w) for n in SPLIT_PER_SLOT[arch]
              for w in {False, whole}}
    if every:
        counts = range(1, choose_splits(1, max_len, block_n, 1, max_len) + 1)  # 1 .. the cap
    if tail:
        counts = {s + k for s in counts for k in (0, 1)}
    part_bytes = B * rows * D_LAT * value_bytes
    lengths = [max_len - k * block_n for k in range(window) if max_len - k * block_n > 0]

    def cost(s):
        return sum(split_cost(s, B * grid_m, n, entry, slots, part_bytes, MERGE_COST[arch], tree, tail)
                   for n in lengths)

    return min(sorted(counts), key=cost)


def tail_split_default(T, block_n, arch):
    """Whether the last split takes a T-node tree's tiles by default: where they are at most TAIL_SPLIT[arch]."""
    return triton.cdiv(T - 1, block_n) + 1 <= TAIL_SPLIT[arch]


def merge_blocks(num_splits):
    """(BLOCK_S, BLOCK_D, warps) of the merge for `num_splits` splits."""
    splits_block = min(triton.next_power_of_2(num_splits), MERGE_MAX_SPLITS_BLOCK)
    return MERGE_BLOCKS.get(splits_block, (splits_block, D_LAT, 4))


def _check(q, kv_cache, value_dim):
    if value_dim != D_LAT or q.shape[-1] != ENTRY or kv_cache.shape[-1] != ENTRY:
        raise ValueError(f"mla_attention (triton): needs entry {ENTRY} and value_dim {D_LAT}, got q "
                         f"{tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}, value_dim {value_dim}")
    if q.dtype != kv_cache.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"mla_attention (triton): q {q.dtype} and kv_cache {kv_cache.dtype} must share a float dtype")
    if q.is_cuda and q.dtype == torch.float32:
        raise ValueError("mla_attention (triton): fp32 tiles do not fit shared memory on a GPU; use bf16/fp16 "
                         "(fp32 runs under TRITON_INTERPRET only) or the torch backend")
    if not q.is_contiguous() or kv_cache.stride(2) != 1 or kv_cache.stride(1) != ENTRY or kv_cache.stride(0) % ENTRY:
        raise ValueError("mla_attention (triton): q must be contiguous and kv_cache rows contiguous [.., L, 576]")


def mla_attention(q, kv_cache, cache_lens, tree_mask, scale, value_dim=D_LAT, num_splits=None, config=None,
                  partials=None, tma=None, tail_split=None, gluon=None):
    """Triton twin of ops.mla_attention: q [B, T, H, 576], kv_cache [B, L_max, 576], cache_lens [B] int32,
    tree_mask [B, T, ceil(T/32)] int32 or None (causal), -> [B, T, H, 512] in q's dtype.

    num_splits (splits per sequence), config ((BLOCK_M, BLOCK_N, warps, stages, BLOCK_DV, UNCHAIN)) and partials
    (dtype of the per-split outputs: torch.float32 or q.dtype) override the defaults; so does tma (True: the
    unmasked loop loads its tiles through tensor descriptors, TMA; needs BLOCK_DV 512 and a 16-byte aligned cache)
    and tail_split (True: with a tree mask and several splits, the last split takes the tree's tiles; None:
    where the tree spans at most TAIL_SPLIT[arch] tiles), and gluon (True: the split kernel in Gluon, `mla_gluon`,
    which needs a Hopper GPU, bf16 and the 64x64 config with BLOCK_DV 512; None: where GLUON[arch] says and it can).
    """
    _check(q, kv_cache, value_dim)
    B, T, H, _ = q.shape
    rows = T * H
    arch = _arch()
    entry = entry_for(rows, arch)
    block_m, block_n, warps, stages, block_dv, unchain = config or entry.config
    tail_stages = TAIL_STAGES[arch] or stages
    tma = entry.tma and block_dv == D_LAT if tma is None else tma
    if block_dv not in (256, 512) or (tma and block_dv != 512):
        raise ValueError(f"mla_attention (triton): BLOCK_DV must be 256 or 512 (512 with tma), got {block_dv}")
    if partials not in (None, torch.float32, q.dtype):
        raise ValueError(f"mla_attention (triton): partials must be torch.float32 or q's {q.dtype}, got {partials}")
    asked = partials is not None
    partials = partials or entry.partials or q.dtype
    entry = entry._replace(config=(block_m, block_n, warps, stages, block_dv, unchain))
    causal = tree_mask is None
    tail = not causal and (tail_split_default(T, block_n, arch) if tail_split is None else tail_split)
    if num_splits is None:
        num_splits = default_splits(entry, rows, B, kv_cache.shape[1], sm_count(q.device), arch, partials.itemsize,
                                    tree=0 if causal else T, tail=tail)
    grid_m = triton.cdiv(rows, block_m) * (D_LAT // block_dv)
    out = torch.empty(B, T, H, D_LAT, dtype=q.dtype, device=q.device)
    gluon_partials = partials if asked else q.dtype  # the Gluon kernel's default: 16-bit partials
    gluon_split = _gluon_split(gluon, arch, q, kv_cache, entry.config, gluon_partials)
    direct = num_splits == 1  # the partials (o / l) are the output: no merge
    if direct:  # the Gluon kernel stores lse too
        o_part, lse_part = out, torch.empty(B, 1, rows, dtype=torch.float32, device=q.device) if gluon_split else out
    else:  # the Gluon kernel stores 16-bit partials (bf16: 2-22% faster than fp32, attention_h200.md session 13)
        o_part = torch.empty(B, num_splits, rows, D_LAT, dtype=gluon_partials if gluon_split else partials,
                             device=q.device)
        lse_part = torch.empty(B, num_splits, rows, dtype=torch.float32, device=q.device)
    mask = cache_lens if causal else tree_mask.contiguous()
    if gluon_split:
        gluon_split(q, kv_cache, cache_lens, mask, o_part, lse_part, num_splits, scale * 1.4426950408889634, causal,
                    tail)
        return _merged(o_part, lse_part, out, rows, num_splits, B, direct, q)
    lat_desc, pe_desc = _descriptors(kv_cache, block_n) if tma and kv_cache.data_ptr() % 16 == 0 else (None, None)
    _mla_split_kernel[(grid_m, num_splits, B)](
        q, kv_cache, cache_lens, mask, out, o_part, lse_part, lat_desc, pe_desc,
        T, kv_cache.stride(0) // ENTRY, scale * 1.4426950408889634,
        H=H, CAUSAL=causal, DIRECT=direct, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DV=block_dv,
        BLOCK_DO=D_LAT - block_dv if block_dv < D_LAT else 16, TAIL_STAGES=tail_stages, UNCHAIN=unchain,
        TMA=lat_desc is not None, TAIL_SPLIT=tail and not direct, num_warps=warps, num_stages=stages, **pdl.options(q),
    )
    return _merged(o_part, lse_part, out, rows, num_splits, B, direct, q)


def _gluon_split(gluon, arch, q, kv_cache, config, partials):
    """The Gluon split kernel's launcher (`mla_gluon.split`) where this call runs it with `partials` (dtype), else
    None: asked for (gluon True; an error where it cannot run) or by GLUON[arch] (gluon None) where it can."""
    if gluon is False or (gluon is None and not GLUON.get(arch, False)):
        return None
    try:
        from triton_kernels import mla_gluon
    except (ImportError, AttributeError) as err:  # a Triton without Gluon's Hopper API (it has it from 3.6)
        if gluon:
            raise ValueError(f"mla_attention (triton): gluon=True needs Triton's Gluon for Hopper: {err}") from err
        return None
    if mla_gluon.usable(q, kv_cache, config, partials):
        return mla_gluon.split
    if gluon:
        raise ValueError(f"mla_attention (triton): gluon=True needs a Hopper GPU, bf16 q, the 64x64 config with "
                         f"BLOCK_DV 512 and 16-bit partials where T*H <= 64, got {q.device} {q.dtype} "
                         f"{tuple(config)} {partials}")
    return None


def _merged(o_part, lse_part, out, rows, num_splits, B, direct, q):
    """out, after the merge kernel has combined the splits' partials into it (unless the split kernel wrote it)."""
    if not direct:
        block_s, block_d, warps = merge_blocks(num_splits)
        _merge_kernel[(rows, D_LAT // block_d, B)](
            o_part, lse_part, out, rows, num_splits, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=warps,
            **pdl.options(q),
        )
    return out


def _descriptors(kv_cache, block_n):
    """Tensor descriptors over kv_cache's rows as one [rows, 576] matrix: [BN, 512] latent and [BN, 64] rope tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = (kv_cache.shape[0] - 1) * (kv_cache.stride(0) // ENTRY) + kv_cache.shape[1]
    lat = kv_cache.as_strided((rows, D_LAT), (ENTRY, 1))
    pe = kv_cache.as_strided((rows, D_PE), (ENTRY, 1), kv_cache.storage_offset() + D_LAT)
    return (TensorDescriptor(lat, [rows, D_LAT], [ENTRY, 1], [block_n, D_LAT]),
            TensorDescriptor(pe, [rows, D_PE], [ENTRY, 1], [block_n, D_PE]))


def write_kv(kv_cache, entries, starts):
    """Triton twin of ops.write_kv: kv_cache[b, starts[b] + t] = entries[b, t], in place (rows past L_max dropped)."""
    B, T, D = entries.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != D or not entries.is_contiguous():
        raise ValueError("write_kv (triton): kv_cache rows and entries must be contiguous")
    _write_kv_kernel[(T, B)](kv_cache, entries, starts, T, kv_cache.stride(0), kv_cache.shape[1],
                             D=D, BLOCK_D=triton.next_power_of_2(D), **pdl.options(entries))
    return kv_cache
