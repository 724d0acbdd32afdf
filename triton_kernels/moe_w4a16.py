"""Triton W4A16 grouped MoE: INT4 group-32 routed experts, bf16/fp16 activations (layout in README.md).

Three launches per `moe` call and a cast, no host synchronisation:
1. `_route_kernel`: program 0 groups the (token, slot) pairs by expert into blocks of BM rows, padded per expert;
   the other programs zero the fp32 output and the split-K arrival counters.
2. `_gate_up_kernel`: per (block, N tile, K split) gate and up partial GEMMs; the last split to arrive sums the
   partials and writes h = silu(gate) * up for its tile.
3. `_down_kernel`: per (block, N tile, K split) h @ W_down^T, scaled by the top-k weight and atomically added
   into the token's fp32 output row (the reduction over k); then torch's cast to x's dtype.
With a `decode` config (few tokens) there are two launches: no routing pass (block b of the GEMMs holds pair b
alone), and the K splits of gate/up and the top-k pairs of a token in down add into fp32 sums that stay zeroed
between calls (`_decode_scratch`); the last program to arrive at a tile's counter finishes it (h, or the output
in x's dtype: no cast) and zeroes the sums and the counter again.
"""

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels import pdl
from triton_kernels.aot import mma_v2_only
from triton_kernels.counters import arrival_counters
from triton_kernels.moe_configs import config_for, layout_for, sm_count

GROUP, PACK = 32, 8
SLAB = 256  # K values per repacked slab: 32 words x 8 nibbles per column, 8 quantisation groups
SLAB_WORDS = SLAB // PACK
# Slab word w (of 32), nibble p (bits 4p) holds k = 256 * slab + SLAB_K[w][p]: group 2 (p % 4) + w // 16,
# row 2 (w % 16) + p // 4 within the group, so one mask yields a group's two adjacent rows in one register.
SLAB_K = [[(2 * (p % 4) + w // 16) * 32 + 2 * (w % 16) + p // 4 for p in range(8)] for w in range(32)]
# Magic-number dequantisation per activation dtype: MAGIC is the bit pattern of MAGIC_VALUE (bf16 128.0, fp16
# 1024.0) whose mantissa takes a nibble; WIDE when the mantissa also fits a nibble 4 bits up (fp16's 10 bits).
UNPACK = {torch.bfloat16: dict(MAGIC=0x4300, MAGIC_VALUE=128.0, WIDE=False),
          torch.float16: dict(MAGIC=0x6400, MAGIC_VALUE=1024.0, WIDE=True)}
_GROUP, _SLAB, _SLAB_WORDS = tl.constexpr(GROUP), tl.constexpr(SLAB), tl.constexpr(SLAB_WORDS)


@dataclass
class TritonExperts:
    """Routed experts repacked for the Triton kernels.

    Slab layout (panel 0): gate_up [E, KD/8, 2I] int32, gate_up_scale [E, KD/32, 2I]; down [E, KI/8, D] int32,
    down_scale [E, KI/32, D], where KD and KI are D and I rounded up to 256 (padding nibbles hold q = 0,
    padding scales 0). Panel layout (panel P > 0): columns cut into panels of P, each panel's K rows
    contiguous: gate_up [E, 2 IP/P, KD/8, P] (gate panels, then up panels; IP = I rounded up to P), scales
    [E, 2 IP/P, KD/32, P]; down [E, DP/P, KI/8, P], scales [E, DP/P, KI/32, P] (DP = D rounded up to P).
    P = 1 is the K-major layout: words [E, N, KP/8, 1] (a column's slab words contiguous, as the swapped tiles'
    shared-memory copy orders them: 16-byte cp.async), scales in the slab layout.
    """

    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor
    hidden: int
    intermediate: int
    panel_gate_up: int = 0
    panel_down: int = 0
    backend: str = "triton"

    @property
    def num_experts(self):
        return self.gate_up.shape[0]


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _unpack_group(words, m: tl.constexpr, MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr,
                  DTYPE: tl.constexpr, SWAP: tl.constexpr, LOP3: tl.constexpr):
    """Nibble pair m of half-slab words [16, BN] int32 (SWAP: [BN, 16]) -> one group [32, BN] DTYPE (SWAP:
    its transpose [BN, 32]), row 2w + j from word w's nibble at bit 4m + 16j, holding q exactly; q * 16 for odd
    m when WIDE (mantissa >= 8 bits, fp16), which reads those nibbles in place instead of shifting them down.
    LOP3: the mask and the OR as one 3-input PTX lop3 (ptxas takes one immediate an instruction, so it emits an
    AND and an OR for the plain form; inline PTX: not interpretable)."""
    if WIDE:
        SHIFT: tl.constexpr = 8 * (m // 2)
        MASK: tl.constexpr = 0x00F000F0 if m % 2 else 0x000F000F
        SCALE: tl.constexpr = 16 if m % 2 else 1
    else:
        SHIFT: tl.constexpr = 4 * m
        MASK: tl.constexpr = 0x000F000F
        SCALE: tl.constexpr = 1
    shifted = words >> SHIFT
    if LOP3 and SWAP:  # one lop3 writes a word's two values as the packed pair the MMA operand holds (the form
        # below costs Triton 3.9 two byte permutes a word to repack its halves; 3.6 compiles both alike). With
        # pack=2 an asm instance takes two elements of each input ($1 $2: the word twice, $3 $4, $5 $6)
        both = tl.reshape(tl.join(shifted, shifted), (words.shape[0], 2 * words.shape[1]))  # [BN, 32]
        pairs = tl.inline_asm_elementwise("lop3.b32 $0, $1, $3, $5, 0xEA;", "=r,r,r,r,r,r,r",
                                          [both, tl.full(both.shape, MASK, tl.int32),
                                           tl.full(both.shape, MAGIC * 65537, tl.int32)],
                                          dtype=tl.bfloat16 if MAGIC == 0x4300 else tl.float16, is_pure=True,
                                          pack=2)
        return pairs - (MAGIC_VALUE + 8.0 * SCALE)
    if LOP3:  # 0xEA: (a & b) | c
        pair = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [shifted, tl.full(words.shape, MASK, tl.int32),
                                          tl.full(words.shape, MAGIC * 65537, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        pair = (shifted & MASK) | (MAGIC * 65537)  # two 16-bit floats MAGIC_VALUE + SCALE * u per word
    lo = pair.to(tl.int16).to(DTYPE, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    if SWAP:  # [BN, 16, 2] -> [BN, 32]: a word's two rows are adjacent along K already
        v = tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))
    else:
        v = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (2 * words.shape[0], words.shape[1]))  # [32, BN]
    return v - (MAGIC_VALUE + 8.0 * SCALE)


@triton.jit
def _load_slab(w_ptrs, w_row, w_mask):
    """The two half-slabs of words [16, BN] int32 at w_ptrs [16, BN] (or both transposed) and 16 rows (of
    stride w_row) further."""
    return tl.load(w_ptrs, mask=w_mask, other=0), tl.load(w_ptrs + 16 * w_row, mask=w_mask, other=0)


@triton.jit
def _load_scales(s_ptrs, s_mask, s_row):
    """A slab's 8 group scales [BN, 8] (bf16) from s_ptrs [BN] (its first group's) and the row stride s_row."""
    return tl.load(s_ptrs[:, None] + (tl.arange(0, 8) * s_row)[None, :], mask=s_mask[:, None], other=0.0)


@triton.jit
def _group_scale(tile, g: tl.constexpr):
    """Column g [BN] fp32 of scales [BN, 8], by splits of the view [BN, 2, 2, 2] (g = 4a + 2b + c; the splits
    are shared by the 8 calls of a slab)."""
    lo, hi = tl.split(tl.reshape(tile.to(tl.float32), (tile.shape[0], 2, 2, 2)))  # [BN, 2, 2]: c
    v = hi if g % 2 else lo
    lo, hi = tl.split(v)  # [BN, 2]: b
    v = hi if (g // 2) % 2 else lo
    lo, hi = tl.split(v)  # [BN]: a
    return hi if g // 4 else lo


@triton.jit
def _slab_dot(acc, a_ptrs, row_mask, k, K, w0, w1, s_ptrs, s_mask, stride_sg, s_tile,
              MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, DTYPE: tl.constexpr,
              EVEN_K: tl.constexpr, SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr,
              PRESCALE: tl.constexpr = False):
    """acc [BM, BN] += A [BM, 256] @ dequant(slab) [256, BN], scaling each group's partial product; with SWAP
    the transposed product acc [BN, BM] += dequant(slab)^T [BN, 256] @ A^T [256, BM] (the weights are the MMA's
    M operand: BM tokens pad to 8, not 16).

    w0, w1 [16, BN] (SWAP: [BN, 16]): the slab's half-slabs of words (`_load_slab`); a_ptrs [BM, 32] (SWAP:
    [32, BM]) point at the slab's first group (columns k [32]); A's columns at or past K read as 0 (no column
    mask when EVEN_K: K is a multiple of 256). Group 2m + t is nibble pair m of half t. Scales: loaded here from
    s_ptrs [BN] (the first group's; groups stride_sg apart), or with AHEAD taken from s_tile [BN, 8]
    (`_load_scales`, loaded a slab ahead by the caller). PRESCALE: the dequantised weights times their scale in
    DTYPE (one rounding of q * scale, as a bf16 weight has), then one dot chain into acc: no fp32 multiply-add of
    each group's product, whose wait for the MMA result it needed.
    """
    for t in tl.static_range(2):
        words = w1 if t else w0
        for m in tl.static_range(4):
            g = 2 * m + t
            if SWAP:
                a_mask = row_mask[None, :] if EVEN_K else row_mask[None, :] & (k + g * _GROUP < K)[:, None]
            else:
                a_mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (k + g * _GROUP < K)[None, :]
            a = tl.load(a_ptrs + g * _GROUP, mask=a_mask, other=0.0).to(DTYPE)  # [BM, 32] (SWAP: [32, BM])
            w = _unpack_group(words, m, MAGIC, MAGIC_VALUE, WIDE, DTYPE, SWAP, LOP3)  # [32, BN] (SWAP: [BN, 32])
            if AHEAD:
                scale = _group_scale(s_tile, g)
            else:
                scale = tl.load(s_ptrs + g * stride_sg, mask=s_mask, other=0.0).to(tl.float32)  # [BN]
            if WIDE:
                if m % 2:
                    scale = scale * 0.0625
            if PRESCALE:
                if SWAP:
                    acc = tl.dot(w * scale.to(DTYPE)[:, None], a, acc)
                else:
                    acc = tl.dot(a, w * scale.to(DTYPE)[None, :], acc)
            elif SWAP:
                acc += tl.dot(w, a) * scale[:, None]
            else:
                acc += tl.dot(a, w) * scale[None, :]
    return acc


@triton.jit
def _orient(r, c, SWAP: tl.constexpr):
    """Row vector r [BM] and column vector c [BN] as broadcastable tile indices of a [BM, BN] tile, or of its
    transpose [BN, BM] with SWAP."""
    if SWAP:  # one return (Triton 3.6 rejects returns of different shapes in constexpr branches)
        r2, c2 = r[None, :], c[:, None]
    else:
        r2, c2 = r[:, None], c[None, :]
    return r2, c2


@triton.jit
def _acc_zeros(BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr):
    """fp32 zeros [BM, BN], or [BN, BM] with SWAP."""
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    return acc


@triton.jit
def _tile_cols(pid_n, stride_p, BN: tl.constexpr, PANEL: tl.constexpr, STEP: tl.constexpr = 1):
    """Offsets [BN / STEP] of N tile pid_n's columns (every STEP-th) within a row of words or scales: the columns
    themselves in the slab layout (PANEL 0), else panel (column // PANEL) times the panel stride plus
    column % PANEL (PANEL 1, the K-major layout: the column times the panel stride)."""
    cols = pid_n * BN + tl.arange(0, BN // STEP) * STEP  # [BN / STEP]
    if PANEL == 1:
        cols = cols.to(tl.int64) * stride_p
    elif PANEL:
        c0 = pid_n * BN  # PANEL % BN == 0: the tile lies in one panel
        cols = (c0 // PANEL).to(tl.int64) * stride_p + (c0 % PANEL) + tl.arange(0, BN // STEP) * STEP
    return cols


@triton.constexpr_function
def _scale_panel(PANEL):
    """The panel width of the scales: the words' (PANEL), but 0 (the slab layout) under K-major words (PANEL 1),
    so that a group's scales stay contiguous along N (4-byte and wider copies: Triton's pipeliner stages them)."""
    return PANEL if PANEL > 1 else 0


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the lines holding ptrs (a hint: no result to wait for; PTX prefetch, so not interpretable)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_slab(lines, slab, w_row):
    """Prefetch slab `slab`'s 32 rows of words from the 128-byte line offsets `lines` [1, BN / 32] of its first
    row."""
    rows = (slab * _SLAB_WORDS + tl.arange(0, _SLAB_WORDS))[:, None].to(tl.int64) * w_row  # [32, 1]
    _prefetch_l2(lines + rows)  # [32, BN / 32]


@triton.jit
def _slab_ptrs(w_base, s_base, a_rows, kw, kg, w_cols, s_cols, slab, w_row, s_row, SWAP: tl.constexpr):
    """Pointers of slab `slab`: words [16, BN] (first half), activations [BM, 32] (first group) from row
    pointers a_rows [BM], scales [BN] (first group), and k [32] (the first group's columns); with SWAP words
    [BN, 16] and activations [32, BM]. w_row and s_row are the row strides of words and scales (N in the slab
    layout, the panel width in the panel layout)."""
    k = kg + slab * _SLAB  # [32]
    word_rows, cols = _orient((kw + slab * _SLAB_WORDS).to(tl.int64) * w_row, w_cols, SWAP)
    a_r, a_k = _orient(a_rows, k, SWAP)
    return w_base + word_rows + cols, a_r + a_k, s_base + (slab * 8) * s_row + s_cols, k


@triton.jit
def _next_slab(w_ptrs, a_ptrs, s_ptrs, k, w_row, s_row):
    """The `_slab_ptrs` of the next slab, by increments (loop-carried pointers, no per-slab 64-bit products)."""
    return w_ptrs + _SLAB_WORDS * w_row, a_ptrs + _SLAB, s_ptrs + 8 * s_row, k + _SLAB


@triton.jit(do_not_specialize=["n_zero", "P", "CAPACITY", "NB_MAX"])
def _route_kernel(ids_ptr, sorted_ptr, block_expert_ptr, counts_ptr, offsets_ptr, rank_ptr, nb_ptr,
                  zero_ptr, n_zero, P, CAPACITY, NB_MAX,
                  BM: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program 0: sorted_ptr[slot] = pair id (or -1), block_expert_ptr[b] = expert of block b (or -1), nb_ptr[0]
    = the number of blocks filled (blocks 0 .. nb - 1).

    Other programs zero BLOCK-sized chunks of the int32/fp32 scratch at zero_ptr (n_zero 32-bit words).
    The phases are ordered by CTA barriers (bar.sync orders the global accesses, atomics included, of the
    threads it joins), so the atomics need no fences of their own.
    """
    pdl.enter(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if pid > 0:
        i = (pid - 1).to(tl.int64) * BLOCK + offs
        tl.store(zero_ptr + i, 0, mask=i < n_zero)
        return
    experts = tl.arange(0, E_PAD)
    tl.store(counts_ptr + experts, 0)
    for start in range(0, CAPACITY, BLOCK):
        tl.store(sorted_ptr + start + offs, -1, mask=start + offs < CAPACITY)
    for start in range(0, NB_MAX, BLOCK):
        tl.store(block_expert_ptr + start + offs, -1, mask=start + offs < NB_MAX)
    tl.debug_barrier()
    for start in range(0, P, BLOCK):
        p = start + offs
        e = tl.load(ids_ptr + p, mask=p < P, other=0)  # [BLOCK]
        rank = tl.atomic_add(counts_ptr + e, 1, mask=p < P, sem="relaxed")  # the pair's place among its expert's
        tl.store(rank_ptr + p, rank, mask=p < P)
    tl.debug_barrier()
    counts = tl.atomic_add(counts_ptr + experts, 0, sem="relaxed")  # [E_PAD], read at L2
    padded = (counts + BM - 1) // BM * BM
    tl.store(offsets_ptr + experts, tl.cumsum(padded, 0) - padded)
    tl.store(nb_ptr, tl.sum(padded, 0) // BM)
    tl.debug_barrier()
    for start in range(0, P, BLOCK):
        p = start + offs
        e = tl.load(ids_ptr + p, mask=p < P, other=0)
        slot = tl.load(offsets_ptr + e, mask=p < P, other=0) + tl.load(rank_ptr + p, mask=p < P, other=0)
        tl.store(sorted_ptr + slot, p, mask=p < P)
        tl.store(block_expert_ptr + slot // BM, e, mask=p < P)


@triton.jit
def _gate_up_sums(acc_g, acc_u, first_row, sums, counter, h_row, n, n_mask, split_k, I, SWAP: tl.constexpr):
    """DECODE's split-K epilogue: add the first rows [BN] of the partials acc_g, acc_u [BM, BN] (SWAP: [BN, BM];
    first_row broadcasts to them) into the pair's zeroed fp32 sums [2 I] at columns n [BN]; the last of split_k
    splits to arrive at `counter` reads those sums once, writes h = silu(gate) * up to h_row, and zeroes the sums
    and the counter for the next launch (no memset: CUDA graphs replay it as is)."""
    axis: tl.constexpr = 1 if SWAP else 0
    tl.atomic_add(sums + n, tl.sum(tl.where(first_row, acc_g, 0.0), axis), mask=n_mask, sem="relaxed")
    tl.atomic_add(sums + I + n, tl.sum(tl.where(first_row, acc_u, 0.0), axis), mask=n_mask, sem="relaxed")
    tl.debug_barrier()  # every thread's additions precede the arrival that releases them
    if tl.atomic_add(counter, 1, sem="acq_rel") == split_k - 1:
        g = tl.load(sums + n, mask=n_mask, other=0.0, cache_modifier=".cg")  # [BN]
        u = tl.load(sums + I + n, mask=n_mask, other=0.0, cache_modifier=".cg")
        tl.store(h_row + n, (g / (1.0 + tl.exp(-g)) * u).to(h_row.dtype.element_ty), mask=n_mask)
        tl.store(sums + n, tl.zeros_like(g), mask=n_mask)
        tl.store(sums + I + n, tl.zeros_like(u), mask=n_mask)
        tl.store(counter, 0)


@triton.jit(do_not_specialize=["n_slabs_per_split", "split_k", "stride_part"])
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, part_ptr, counter_ptr, sorted_ptr, block_expert_ptr,
                    D, I, n_slabs, n_slabs_per_split, split_k, stride_we, stride_se, stride_part,
                    w_row, s_row, stride_wp, stride_sp, up_w, up_s,
                    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, LEAN: tl.constexpr,
                    EVEN_N: tl.constexpr, DECODE: tl.constexpr, PANEL: tl.constexpr,
                    MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, EVEN_K: tl.constexpr,
                    SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr = False,
                    PRESCALE: tl.constexpr = False, MMA_V2: tl.constexpr = False):
    """h[slot, n] = silu(x W_gate^T) * (x W_up^T) for block pid 0's rows and N tile pid 1 of the intermediate.

    With SPLIT, pid 2 of split_k sums a range of slabs into part; the last split to arrive finishes the tile:
    it sums the split_k partials [split_k, capacity, 2 I], or with DECODE it reads the pair's fp32 sums part
    [P, 2 I], to which every split added its own (relaxed atomics), and zeroes them and its counter again.
    With SWAP the tiles are transposed ([BN, BM]: the weights are the MMA's M operand, see `_slab_dot`); LOP3
    dequantises with inline PTX (`_unpack_group`); AHEAD loads a slab's scales during the slab before (Triton
    pipelines only loads that feed a dot: the scales would otherwise wait a global load each slab). PDL
    (programmatic dependent launch): the down kernel may launch once every program has started; this kernel waits
    for the previous one (whatever wrote x, or the routing pass) first.
    Layout (TritonExperts): w_row / s_row are the row strides of words / scales, stride_wp / stride_sp their
    panel strides (PANEL > 0), up_w / up_s the offsets of the up columns from the gate columns.
    """
    pid_b, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pdl.enter(PDL)  # release after the wait: the down kernel reads the routing pass's output
    rows = pid_b * BM + tl.arange(0, BM)  # [BM] slots
    e = tl.load(block_expert_ptr + pid_b)
    if DECODE:  # block b holds pair b alone, in row 0 (block_expert_ptr is topk_ids; no routing pass)
        pair = tl.where(tl.arange(0, BM) == 0, pid_b, -1)
    elif LEAN:  # pair ids loaded before the early return, with the expert (volatile: not sunk past the branch)
        pair = tl.load(sorted_ptr + rows, volatile=True)
    if e < 0:
        return
    if not DECODE:
        if not LEAN:
            pair = tl.load(sorted_ptr + rows)
    DTYPE = x_ptr.dtype.element_ty
    token = tl.where(pair >= 0, pair // TOP_K, 0).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)  # [BN] gate columns; up columns are n + I
    n_mask = (n < I) | EVEN_N  # all-true (folded away) when BN divides I
    kw = tl.arange(0, _SLAB_WORDS // 2)
    kg = tl.arange(0, _GROUP)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    w_cols = _tile_cols(pid_n, stride_wp, BN, PANEL)  # [BN]
    s_cols = _tile_cols(pid_n, stride_sp, BN, _scale_panel(PANEL))
    two_i = 2 * I
    R, C = _orient(rows.to(tl.int64), n, SWAP)  # tile indices: [BM, 1], [1, BN] (SWAP: [1, BM], [BN, 1])
    _, col_mask = _orient(rows, n_mask, SWAP)
    acc_g = _acc_zeros(BM, BN, SWAP)
    acc_u = _acc_zeros(BM, BN, SWAP)
    first = pid_k * n_slabs_per_split
    end = tl.minimum(first + n_slabs_per_split, n_slabs)
    w_ptrs, a_ptrs, s_ptrs, k = _slab_ptrs(w_base, s_base, x_ptr + token * D, kw, kg, w_cols, s_cols, first,
                                           w_row, s_row, SWAP)
    sg, su = 0, 0  # with AHEAD: the gate and up scales [BN, 8] of the slab being computed
    if AHEAD:
        sg, su = _load_scales(s_ptrs, n_mask, s_row), _load_scales(s_ptrs + up_s, n_mask, s_row)
    for slab in range(first, end):
        if not LEAN:  # recomputed from the slab index (the measured default); LEAN carries them below
            w_ptrs, a_ptrs, s_ptrs, k = _slab_ptrs(w_base, s_base, x_ptr + token * D, kw, kg, w_cols, s_cols,
                                                   slab, w_row, s_row, SWAP)
        if AHEAD:
            s_next = s_base + (tl.minimum(slab + 1, end - 1) * 8) * s_row + s_cols  # [BN]
            sg_next, su_next = _load_scales(s_next, n_mask, s_row), _load_scales(s_next + up_s, n_mask, s_row)
        g0, g1 = _load_slab(w_ptrs, w_row, col_mask)  # [16, BN] each (SWAP: [BN, 16])
        u0, u1 = _load_slab(w_ptrs + up_w, w_row, col_mask)
        acc_g = _slab_dot(acc_g, a_ptrs, pair >= 0, k, D, g0, g1, s_ptrs, n_mask, s_row, sg, MAGIC, MAGIC_VALUE,
                          WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
        acc_u = _slab_dot(acc_u, a_ptrs, pair >= 0, k, D, u0, u1, s_ptrs + up_s, n_mask, s_row, su, MAGIC,
                          MAGIC_VALUE, WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
        if AHEAD:
            sg, su = sg_next, su_next
        if LEAN:
            w_ptrs, a_ptrs, s_ptrs, k = _next_slab(w_ptrs, a_ptrs, s_ptrs, k, w_row, s_row)
    out = R * I + C  # [BM, BN] (SWAP: [BN, BM])
    if SPLIT and DECODE:
        _gate_up_sums(acc_g, acc_u, R == pid_b * BM, part_ptr + pid_b * two_i,
                      counter_ptr + pid_b * tl.num_programs(1) + pid_n, h_ptr + (pid_b * BM).to(tl.int64) * I, n,
                      n_mask, split_k, I, SWAP)
    elif SPLIT:
        part = part_ptr + pid_k.to(tl.int64) * stride_part + R * two_i + C
        tl.store(part, acc_g, mask=col_mask)
        tl.store(part + I, acc_u, mask=col_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_b * tl.num_programs(1) + pid_n, 1)
        if arrived == split_k - 1:
            acc_g = _acc_zeros(BM, BN, SWAP)
            acc_u = _acc_zeros(BM, BN, SWAP)
            part = part_ptr + R * two_i + C
            for j in range(split_k):
                acc_g += tl.load(part + j * stride_part, mask=col_mask, other=0.0, cache_modifier=".cg")
                acc_u += tl.load(part + j * stride_part + I, mask=col_mask, other=0.0, cache_modifier=".cg")
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(h_ptr + out, h.to(DTYPE), mask=col_mask)
    else:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + out, h.to(DTYPE), mask=col_mask)


@triton.jit
def _plan_split(nb, n_tiles, n_slabs, G, cap, S_PAD: tl.constexpr, COST: tl.constexpr):
    """The K split of `_planned_gate_up_kernel` for nb blocks x n_tiles N tiles on G programs: of s = 1 ..
    min(S_PAD, n_slabs) splits, the one that minimises waves x (slabs a split + COST), waves = cdiv(items, G)
    (items = nb x n_tiles x s; at most `cap` when s > 1), ties to the fewer splits. -> (splits, slabs a split)."""
    s = tl.arange(0, S_PAD) + 1  # [S_PAD]
    per = tl.cdiv(n_slabs, s)
    s_eff = tl.cdiv(n_slabs, per)  # the splits that per slabs a split make
    items = nb * n_tiles * s_eff
    cost = tl.cdiv(items, G) * (per + COST)
    cost = tl.where((s <= n_slabs) & ((s_eff == 1) | (items <= cap)), cost, 1 << 30)
    best = tl.argmin(cost, 0, tie_break_left=True)
    split = tl.sum(tl.where(tl.arange(0, S_PAD) == best, s_eff, 0), 0)
    return split, tl.cdiv(n_slabs, split)


@triton.jit
def _planned_gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, part_ptr, counter_ptr, sorted_ptr, block_expert_ptr, nb_ptr,
                            D, I, n_slabs, cap, stride_we, stride_se, w_row, s_row, stride_wp, stride_sp, up_w, up_s,
                            TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TILES_N: tl.constexpr,
                            S_PAD: tl.constexpr, COST: tl.constexpr, EVEN_N: tl.constexpr, PANEL: tl.constexpr,
                            MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, EVEN_K: tl.constexpr,
                            SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr, PRESCALE: tl.constexpr,
                            PDL: tl.constexpr = False, MMA_V2: tl.constexpr = False):
    """`_gate_up_kernel` after the routing pass with the K split decided on the device: G programs take the work
    items (block, N tile, split) g, g + G, ... of the nb blocks the routing pass filled (nb_ptr), the split
    from `_plan_split` (the real number of blocks, not a host estimate). A split stores its partial tiles
    [2, BM, BN] at part [item]; the last of a tile's splits to arrive sums them in split order (deterministic)
    and writes h. Counters [nb_max, TILES_N] zeroed by the routing pass."""
    pdl.enter(PDL)
    pid, G = tl.program_id(0), tl.num_programs(0)
    nb = tl.load(nb_ptr)
    split, per_split = _plan_split(nb, TILES_N, n_slabs, G, cap, S_PAD, COST)
    DTYPE = x_ptr.dtype.element_ty
    kw, kg = tl.arange(0, _SLAB_WORDS // 2), tl.arange(0, _GROUP)
    for item in range(pid, nb * TILES_N * split, G):
        j = item % split
        t = (item // split) % TILES_N
        b = item // (split * TILES_N)
        rows = b * BM + tl.arange(0, BM)  # [BM] slots
        e = tl.load(block_expert_ptr + b)
        pair = tl.load(sorted_ptr + rows)
        valid = pair >= 0
        token = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
        n = t * BN + tl.arange(0, BN)  # [BN] gate columns; up columns are n + I
        n_mask = (n < I) | EVEN_N
        R, C = _orient(rows.to(tl.int64), n, SWAP)
        _, col_mask = _orient(rows, n_mask, SWAP)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        w_cols, s_cols = _tile_cols(t, stride_wp, BN, PANEL), _tile_cols(t, stride_sp, BN, _scale_panel(PANEL))
        a_rows = x_ptr + token * D
        first = j * per_split
        end = tl.minimum(first + per_split, n_slabs)
        acc_g = _acc_zeros(BM, BN, SWAP)
        acc_u = _acc_zeros(BM, BN, SWAP)
        sg, su = 0, 0  # with AHEAD: the gate and up scales [BN, 8] of the slab being computed
        if AHEAD:
            s0 = s_base + (first * 8) * s_row + s_cols
            sg, su = _load_scales(s0, n_mask, s_row), _load_scales(s0 + up_s, n_mask, s_row)
        for slab in range(first, end):
            w_ptrs, a_ptrs, s_ptrs, k = _slab_ptrs(w_base, s_base, a_rows, kw, kg, w_cols, s_cols, slab, w_row,
                                                   s_row, SWAP)
            if AHEAD:
                s_next = s_base + (tl.minimum(slab + 1, end - 1) * 8) * s_row + s_cols  # [BN]
                sg_next, su_next = _load_scales(s_next, n_mask, s_row), _load_scales(s_next + up_s, n_mask, s_row)
            g0, g1 = _load_slab(w_ptrs, w_row, col_mask)  # [16, BN] each (SWAP: [BN, 16])
            u0, u1 = _load_slab(w_ptrs + up_w, w_row, col_mask)
            acc_g = _slab_dot(acc_g, a_ptrs, valid, k, D, g0, g1, s_ptrs, n_mask, s_row, sg, MAGIC, MAGIC_VALUE,
                              WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
            acc_u = _slab_dot(acc_u, a_ptrs, valid, k, D, u0, u1, s_ptrs + up_s, n_mask, s_row, su, MAGIC,
                              MAGIC_VALUE, WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
            if AHEAD:
                sg, su = sg_next, su_next
        last = split == 1
        if split > 1:
            loc_r, loc_c = _orient(tl.arange(0, BM), tl.arange(0, BN), SWAP)
            loc = loc_r * BN + loc_c  # [BM, BN] (SWAP: [BN, BM]): a partial tile's offsets
            first_part = ((b * TILES_N + t) * split).to(tl.int64)  # the tile's split 0 (= item - j)
            part = part_ptr + (first_part + j) * (2 * BM * BN) + loc
            tl.store(part, acc_g)
            tl.store(part + BM * BN, acc_u)
            tl.debug_barrier()  # every thread's stores precede the arrival that releases them
            last = tl.atomic_add(counter_ptr + b * TILES_N + t, 1, sem="acq_rel") == split - 1
            if last:
                part = part_ptr + first_part * (2 * BM * BN) + loc
                acc_g = tl.load(part, cache_modifier=".cg")
                acc_u = tl.load(part + BM * BN, cache_modifier=".cg")
                for jj in range(1, split):  # in split order
                    acc_g += tl.load(part + jj * (2 * BM * BN), cache_modifier=".cg")
                    acc_u += tl.load(part + jj * (2 * BM * BN) + BM * BN, cache_modifier=".cg")
        if last:
            tl.store(h_ptr + R * I + C, (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(DTYPE), mask=col_mask)


@triton.jit
def _down_slabs(acc, w_base, s_base, h_rows, kw, kg, w_cols, s_cols, w_ptrs, a_ptrs, s_ptrs, k, valid, n_mask,
                col_mask, tile, first, end, I, w_row, s_row, MAGIC: tl.constexpr,
                MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, DTYPE: tl.constexpr, EVEN_K: tl.constexpr,
                SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr, LEAN: tl.constexpr,
                BN: tl.constexpr, PANEL: tl.constexpr, PRESCALE: tl.constexpr):
    """acc [BM, BN] (SWAP: [BN, BM]) += slabs first .. end - 1 of down N tile `tile` (its K loop; pointers of
    slab `first` given, as `_slab_ptrs` makes them)."""
    sc = 0  # with AHEAD: the scales [BN, 8] of the slab being computed (as in _gate_up_kernel)
    if AHEAD:
        sc = _load_scales(s_ptrs, n_mask, s_row)
    for slab in range(first, end):
        if not LEAN:
            w_ptrs, a_ptrs, s_ptrs, k = _slab_ptrs(w_base, s_base, h_rows, kw, kg, w_cols, s_cols, slab, w_row,
                                                   s_row, SWAP)
        if AHEAD:
            sc_next = _load_scales(s_base + (tl.minimum(slab + 1, end - 1) * 8) * s_row + s_cols, n_mask, s_row)
        w0, w1 = _load_slab(w_ptrs, w_row, col_mask)  # [16, BN] each (SWAP: [BN, 16])
        acc = _slab_dot(acc, a_ptrs, valid, k, I, w0, w1, s_ptrs, n_mask, s_row, sc, MAGIC, MAGIC_VALUE, WIDE,
                        DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
        if AHEAD:
            sc = sc_next
        if LEAN:
            w_ptrs, a_ptrs, s_ptrs, k = _next_slab(w_ptrs, a_ptrs, s_ptrs, k, w_row, s_row)
    return acc


@triton.jit
def _tile_scales(s_base, tile, stride_sp, s_row, D, BN: tl.constexpr, PANEL: tl.constexpr, EVEN_N: tl.constexpr):
    """Slab 0's 8 group scales [BN, 8] of down's N tile `tile` (`_load_scales`)."""
    n = tile * BN + tl.arange(0, BN)  # [BN]
    return _load_scales(s_base + _tile_cols(tile, stride_sp, BN, PANEL), (n < D) | EVEN_N, s_row)


@triton.jit
def _down_block(h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, pair, e, rows, pid_n, pid_k, D, I, n_slabs,
                n_slabs_per_split, stride_we, stride_se, w_row, s_row, stride_wp, stride_sp, TOP_K: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, LEAN: tl.constexpr, EVEN_N: tl.constexpr, PANEL: tl.constexpr,
                TILES: tl.constexpr, MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr,
                EVEN_K: tl.constexpr, SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr,
                ONE_SLAB: tl.constexpr, PDL: tl.constexpr, PRESCALE: tl.constexpr):
    """The work of one `_down_kernel` program: block `rows` [BM] (pair ids `pair`, expert e), N tiles TILES * pid_n
    .. TILES * pid_n + TILES - 1, K split pid_k."""
    DTYPE = h_ptr.dtype.element_ty
    valid = pair >= 0
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)  # [BM] fp32
    token = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    kw = tl.arange(0, _SLAB_WORDS // 2)
    kg = tl.arange(0, _GROUP)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    h_rows = h_ptr + rows.to(tl.int64) * I
    first = pid_k * n_slabs_per_split
    end = tl.minimum(first + n_slabs_per_split, n_slabs)
    if PDL:
        for t in tl.static_range(TILES):
            if PANEL == 1:  # a column's slab: 32 words, one 128-byte line
                _prefetch_l2(w_base + _tile_cols(pid_n * TILES + t, stride_wp, BN, PANEL) + first * _SLAB_WORDS)
            else:
                lines = w_base + _tile_cols(pid_n * TILES + t, stride_wp, BN, PANEL, 32)[None, :]  # [1, BN / 32]
                _prefetch_slab(lines, first, w_row)
        pdl.enter(PDL)  # then the next kernel may launch (it waits for this one)
    last = pid_n * TILES + TILES - 1  # this program's last N tile
    sc_tile = 0  # ONE_SLAB with AHEAD: the scales [BN, 8] of the tile being computed
    if ONE_SLAB:
        if AHEAD:
            sc_tile = _tile_scales(s_base, pid_n * TILES, stride_sp, s_row, D, BN, _scale_panel(PANEL), EVEN_N)
    for t in range(TILES):  # one after the other: index loads and activations set up once
        tile = pid_n * TILES + t
        n = tile * BN + tl.arange(0, BN)  # [BN] hidden columns
        n_mask = (n < D) | EVEN_N
        w_cols = _tile_cols(tile, stride_wp, BN, PANEL)  # [BN]
        s_cols = _tile_cols(tile, stride_sp, BN, _scale_panel(PANEL))
        T, C = _orient(token, n, SWAP)
        valid_r, col_mask = _orient(valid, n_mask, SWAP)
        acc = _acc_zeros(BM, BN, SWAP)
        w_ptrs, a_ptrs, s_ptrs, k = _slab_ptrs(w_base, s_base, h_rows, kw, kg, w_cols, s_cols, first, w_row, s_row,
                                               SWAP)
        if ONE_SLAB:  # no K loop: this loop is the innermost, so its loads are pipelined across tiles
            if AHEAD:
                sc_next = _tile_scales(s_base, tl.minimum(tile + 1, last), stride_sp, s_row, D, BN,
                                       _scale_panel(PANEL), EVEN_N)
            w0, w1 = _load_slab(w_ptrs, w_row, col_mask)  # [16, BN] each (SWAP: [BN, 16])
            acc = _slab_dot(acc, a_ptrs, valid, k, I, w0, w1, s_ptrs, n_mask, s_row, sc_tile, MAGIC, MAGIC_VALUE,
                            WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
            if AHEAD:
                sc_tile = sc_next
        else:
            acc = _down_slabs(acc, w_base, s_base, h_rows, kw, kg, w_cols, s_cols, w_ptrs, a_ptrs, s_ptrs, k, valid,
                              n_mask, col_mask, tile, first, end, I, w_row, s_row, MAGIC, MAGIC_VALUE,
                              WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, LEAN, BN, PANEL, PRESCALE)
        # relaxed: only atomicity is needed (the cast reads out in a later launch); the default acq_rel fences every
        # atomic (MEMBAR.ALL.GPU + L1 invalidation on sm_90)
        W, _ = _orient(weight, n, SWAP)
        tl.atomic_add(out_ptr + T * D + C, acc * W, mask=valid_r & col_mask, sem="relaxed")


@triton.jit(do_not_specialize=["n_slabs_per_split"])
def _down_kernel(h_ptr, w_ptr, s_ptr, out_ptr, y_ptr, counter_ptr, weights_ptr, sorted_ptr, block_expert_ptr,
                 D, I, n_slabs, n_slabs_per_split, stride_we, stride_se, w_row, s_row, stride_wp, stride_sp,
                 TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LEAN: tl.constexpr, EVEN_N: tl.constexpr,
                 DECODE: tl.constexpr, PANEL: tl.constexpr, TILES: tl.constexpr,
                 MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, EVEN_K: tl.constexpr,
                 SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr, ONE_SLAB: tl.constexpr = False,
                 PDL: tl.constexpr = False, PRESCALE: tl.constexpr = False, MMA_V2: tl.constexpr = False):
    """out[token, n] += topk_weight * (h @ W_down^T)[slot, n] for block pid 0's rows, N tiles TILES * pid 1 ..
    TILES * pid 1 + TILES - 1 (one after the other), K split pid 2 (layout arguments and SWAP as in
    `_gate_up_kernel`). With DECODE, out is the zeroed fp32 sums [M, D] and the last program of a token's
    tiles writes y [M, D] (`_down_sums`). ONE_SLAB (K within one slab, one split): no K loop, so the tile loop
    is the innermost and Triton's pipeliner stages tile t + 1's words while tile t is computed; with AHEAD the
    scales of tile t + 1 load during tile t. PDL: launched while the gate/up kernel runs, a program asks L2 for its
    first slab's words (they do not depend on h), then waits for the gate/up kernel before reading h."""
    pid_b, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_b * BM + tl.arange(0, BM)  # [BM] slots
    e = tl.load(block_expert_ptr + pid_b)
    if DECODE:  # block b holds pair b alone, in row 0 (block_expert_ptr is topk_ids; no routing pass)
        pair = tl.where(tl.arange(0, BM) == 0, pid_b, -1)
    elif LEAN:  # pair ids loaded before the early return, with the expert (volatile: not sunk past the branch)
        pair = tl.load(sorted_ptr + rows, volatile=True)
    if e < 0:
        return
    if not DECODE:
        if not LEAN:
            pair = tl.load(sorted_ptr + rows)
    _down_block(h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, pair, e, rows, pid_n, pid_k, D, I, n_slabs,
                n_slabs_per_split, stride_we, stride_se, w_row, s_row, stride_wp, stride_sp, TOP_K, BM, BN, LEAN,
                EVEN_N, PANEL, TILES, MAGIC, MAGIC_VALUE, WIDE, EVEN_K, SWAP, LOP3, AHEAD, ONE_SLAB, PDL, PRESCALE)
    if DECODE:
        token0 = pid_b // TOP_K
        _down_sums(out_ptr + token0 * D, y_ptr + token0 * D,
                   counter_ptr + token0 * tl.num_programs(1) + pid_n, pid_n * TILES, D, TOP_K * tl.num_programs(2),
                   BN, TILES, EVEN_N)


@triton.jit(do_not_specialize=["n_slabs_per_split", "split"])
def _persistent_down_kernel(h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, nb_ptr,
                            D, I, n_slabs, n_slabs_per_split, split, stride_we, stride_se, w_row, s_row, stride_wp,
                            stride_sp, TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUPS: tl.constexpr,
                            EVEN_N: tl.constexpr, PANEL: tl.constexpr, TILES: tl.constexpr, MAGIC: tl.constexpr,
                            MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                            LOP3: tl.constexpr, AHEAD: tl.constexpr, ONE_SLAB: tl.constexpr,
                            PRESCALE: tl.constexpr, PDL: tl.constexpr = False, MMA_V2: tl.constexpr = False):
    """`_down_kernel` after the routing pass on a persistent grid: G programs take the work items (block, group of
    TILES N tiles, K split) g, g + G, ... of the nb blocks the routing pass filled (nb_ptr), so no program is
    launched for the empty blocks of the static grid (cdiv(M k, BM) + min(E, M k) blocks, most of them empty when
    the tokens share experts)."""
    pdl.enter(PDL)
    pid, G = tl.program_id(0), tl.num_programs(0)
    nb = tl.load(nb_ptr)
    for item in range(pid, nb * GROUPS * split, G):
        j = item % split
        grp = (item // split) % GROUPS
        b = item // (split * GROUPS)
        rows = b * BM + tl.arange(0, BM)  # [BM] slots
        e = tl.load(block_expert_ptr + b)
        pair = tl.load(sorted_ptr + rows)
        _down_block(h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, pair, e, rows, grp, j, D, I, n_slabs,
                    n_slabs_per_split, stride_we, stride_se, w_row, s_row, stride_wp, stride_sp, TOP_K, BM, BN, False,
                    EVEN_N, PANEL, TILES, MAGIC, MAGIC_VALUE, WIDE, EVEN_K, SWAP, LOP3, AHEAD, ONE_SLAB, False,
                    PRESCALE)


@triton.jit
def _down_sums(sums, y_row, counter, tile0, D, arrivals, BN: tl.constexpr, TILES: tl.constexpr, EVEN_N: tl.constexpr):
    """DECODE's reduction over top-k: the last of `arrivals` programs (the token's pairs x K splits) to arrive at
    `counter` reads the token's fp32 sums of N tiles tile0 .. tile0 + TILES - 1 once, writes them to y_row in its
    dtype, and zeroes them and the counter for the next launch (no memset and no cast launch)."""
    tl.debug_barrier()  # every thread's additions precede the arrival that releases them
    if tl.atomic_add(counter, 1, sem="acq_rel") == arrivals - 1:
        for t in tl.static_range(TILES):
            n = (tile0 + t) * BN + tl.arange(0, BN)  # [BN]
            n_mask = (n < D) | EVEN_N
            v = tl.load(sums + n, mask=n_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_row + n, v.to(y_row.dtype.element_ty), mask=n_mask)
            tl.store(sums + n, tl.zeros_like(v), mask=n_mask)
        tl.store(counter, 0)


# ----------------------------------------------------------------------------------------------- repack


def _nibbles(packed):
    """compressed-tensors words [..., K/8] int32 -> nibbles [..., K] int32 (u = q + 8)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def _to_words(u):
    """Nibbles [..., 8] (u in [0, 16)) -> int32 words [...] with nibble p at bits 4p."""
    shifts = torch.arange(0, 32, 4, device=u.device, dtype=torch.int64)
    words = (u.to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def repack_int4(packed, scale):
    """compressed-tensors [E, N, K/8] int32 + [E, N, K/32] -> slab words [E, KP/8, N] int32 + scales [E, KP/32, N].

    KP = K rounded up to 256. Word w of slab t, column n, nibble p holds k = 256 t + SLAB_K[w][p]; padding
    nibbles hold u = 8 (q = 0) and padding scales are 0.
    """
    E, N, K = packed.shape[0], packed.shape[1], packed.shape[2] * PACK
    KP = triton.cdiv(K, SLAB) * SLAB
    index = torch.tensor(SLAB_K, device=packed.device).flatten()  # [256]: slab position -> k within the slab
    words = torch.empty((E, KP // PACK, N), dtype=torch.int32, device=packed.device)
    for e in range(E):  # one expert at a time keeps the int64 temporaries small
        u = torch.nn.functional.pad(_nibbles(packed[e]), (0, KP - K), value=8).view(N, KP // SLAB, SLAB)
        u = u[:, :, index].view(N, KP // SLAB, SLAB_WORDS, PACK)  # [N, slab, w, p]
        words[e] = _to_words(u).permute(1, 2, 0).reshape(KP // PACK, N)
    scales = torch.nn.functional.pad(scale, (0, KP // GROUP - K // GROUP)).transpose(1, 2).contiguous()
    return words, scales


def unpack_int4(words, scales, K):
    """Exact inverse of `repack_int4`: -> compressed-tensors [E, N, K/8] int32 and [E, N, K/32]."""
    E, KP8, N = words.shape
    index = torch.tensor(SLAB_K, device=words.device).flatten()
    packed = torch.empty((E, N, K // PACK), dtype=torch.int32, device=words.device)
    for e in range(E):
        u = _nibbles(words[e].view(KP8 // SLAB_WORDS, SLAB_WORDS, N).permute(2, 0, 1))  # [N, slab, 256] slab order
        k_order = torch.empty_like(u)
        k_order[:, :, index] = u
        packed[e] = _to_words(k_order.reshape(N, KP8 * PACK)[:, :K].reshape(N, K // PACK, PACK))
    return packed, scales.transpose(1, 2)[:, :, : K // GROUP].contiguous()


PAD_WORD = -0x77777778  # 0x88888888: eight nibbles u = 8 (q = 0), the padding of panel columns


def to_panels(t, panel, parts):
    """Slab layout [E, R, N] -> panel layout [E, parts * NP / panel, R, panel]: N is cut into `parts` equal
    column ranges (gate and up: 2), each padded to NP, a multiple of `panel` (words with PAD_WORD, scales 0)."""
    E, R, N = t.shape
    n = N // parts
    n_pad = triton.cdiv(n, panel) * panel
    fill = PAD_WORD if t.dtype == torch.int32 else 0
    t = torch.nn.functional.pad(t.view(E, R, parts, n), (0, n_pad - n), value=fill)  # [E, R, parts, NP]
    return t.view(E, R, parts * n_pad // panel, panel).permute(0, 2, 1, 3).contiguous()


def from_panels(t, N, parts):
    """Exact inverse of `to_panels`: [E, panels, R, panel] -> [E, R, N]."""
    E, n_panels, R, panel = t.shape
    n_pad = n_panels * panel // parts
    return t.permute(0, 2, 1, 3).reshape(E, R, parts, n_pad)[..., : N // parts].reshape(E, R, N).contiguous()


def prepare_moe(gate_up_packed, gate_up_scale, down_packed, down_scale, panels=None):
    """Repack compressed-tensors experts (see ops.prepare_moe) into `TritonExperts`; panels = (gate/up panel,
    down panel) widths, 0 for the slab layout (default: moe_configs.layout_for the device)."""
    D, I = down_packed.shape[1], gate_up_packed.shape[1] // 2
    p_gu, p_dn = panels if panels is not None else layout_for(gate_up_packed.device)
    gate_up, gate_up_s = repack_int4(gate_up_packed, gate_up_scale)
    down, down_s = repack_int4(down_packed, down_scale)
    if p_gu:  # panel 1 (K-major words): the scales keep the slab layout
        gate_up, gate_up_s = to_panels(gate_up, p_gu, 2), to_panels(gate_up_s, p_gu, 2) if p_gu > 1 else gate_up_s
    if p_dn:
        down, down_s = to_panels(down, p_dn, 1), to_panels(down_s, p_dn, 1) if p_dn > 1 else down_s
    return TritonExperts(gate_up, gate_up_s, down, down_s, hidden=D, intermediate=I, panel_gate_up=p_gu,
                         panel_down=p_dn)


def unprepare_moe(experts):
    """The compressed-tensors tensors `prepare_moe` was given: (gate_up_packed, gate_up_scale, down_packed,
    down_scale)."""
    D, I = experts.hidden, experts.intermediate
    gate_up, gate_up_s, down, down_s = experts.gate_up, experts.gate_up_scale, experts.down, experts.down_scale
    if experts.panel_gate_up:
        gate_up = from_panels(gate_up, 2 * I, 2)
        gate_up_s = from_panels(gate_up_s, 2 * I, 2) if experts.panel_gate_up > 1 else gate_up_s
    if experts.panel_down:
        down = from_panels(down, D, 1)
        down_s = from_panels(down_s, D, 1) if experts.panel_down > 1 else down_s
    return (*unpack_int4(gate_up, gate_up_s, D), *unpack_int4(down, down_s, I))


# ----------------------------------------------------------------------------------------------- launcher


PLAN_COST = 1  # `_plan_split`: a work item's fixed cost (epilogue, index loads), in slabs


def _split(n_slabs, work, sms, waves=2):
    """K splits so that about `waves` x SMs programs run, each split holding at least one slab."""
    return max(1, min(n_slabs, triton.cdiv(waves * sms, max(work, 1))))


def _expected_experts(E, pairs):
    """Expected distinct experts touched by `pairs` uniformly random choices (a static estimate for the grid)."""
    return min(E, pairs, max(1, round(E * (1 - (1 - 1 / E) ** pairs))))


def _flags(kernel_cfg, N, ptx=True):
    """LEAN / EVEN_N / SWAP / LOP3 / AHEAD / PRESCALE / MMA_V2 constexprs of a kernel config: `lean` carries the slab
    pointers across the K loop, drops the column masks when BN divides N and loads a block's pair ids with its
    expert; `swap` computes the transposed tile, weights as the MMA's M
    operand (`_slab_dot`); `lop3` dequantises with one PTX lop3 for the mask and the magic exponent
    (`_unpack_group`), the same result as the plain form the interpreter runs (ptx=False); `scales_ahead` loads
    each slab's group scales one slab early; `prescale` scales the weights before the MMA (`_slab_dot`); `mma_v2`
    compiles the dots to mma.sync (`aot.mma_v2_only`; the constexpr itself only keys the compiled kernel)."""
    lean = kernel_cfg.get("lean", False)
    return dict(LEAN=lean, EVEN_N=lean and N % kernel_cfg["BN"] == 0,
                SWAP=kernel_cfg.get("swap", False), LOP3=ptx and kernel_cfg.get("lop3", False),
                AHEAD=kernel_cfg.get("scales_ahead", False), PRESCALE=kernel_cfg.get("prescale", False),
                MMA_V2=kernel_cfg.get("mma_v2", False))


_PERSISTENT_FLAGS = ("SWAP", "LOP3", "AHEAD", "PRESCALE", "MMA_V2")  # the _flags the persistent kernels take


def _launch(kernel_cfg, use_pdl):
    """Launch options of a kernel config: num_warps, num_stages, its register cap `maxnreg` if any and, with
    use_pdl, programmatic dependent launch."""
    return dict(num_warps=kernel_cfg["num_warps"], num_stages=kernel_cfg["num_stages"],
                **({"maxnreg": kernel_cfg["maxnreg"]} if kernel_cfg.get("maxnreg") else {}),
                **({"launch_pdl": True} if use_pdl else {}))


def _layout(words, scales, panel, BN, up=0):
    """Layout arguments of a GEMM kernel: row strides w_row / s_row, panel strides stride_wp / stride_sp,
    PANEL, and with `up` (the intermediate size, gate/up only) the offsets up_w / up_s of the up columns."""
    if panel > 1 and panel % BN:
        raise ValueError(f"moe (triton): BN {BN} must divide the layout's panel width {panel}")
    if not panel:
        args = dict(w_row=words.stride(1), s_row=scales.stride(1), stride_wp=0, stride_sp=0, PANEL=0)
        return {**args, **(dict(up_w=up, up_s=up) if up else {})}
    if panel == 1:  # K-major words [E, N, KP/8], scales in the slab layout
        args = dict(w_row=1, s_row=scales.stride(1), stride_wp=words.stride(1), stride_sp=0, PANEL=1)
        return {**args, **(dict(up_w=up * words.stride(1), up_s=up) if up else {})}
    args = dict(w_row=panel, s_row=panel, stride_wp=words.stride(1), stride_sp=scales.stride(1), PANEL=panel)
    first_up = triton.cdiv(up, panel)  # the first up panel: gate panels are padded to whole panels
    return {**args, **(dict(up_w=first_up * words.stride(1), up_s=first_up * scales.stride(1)) if up else {})}


def _route(topk_ids, scratch, E, BM, capacity, nb_max, use_pdl=False):
    """Launch `_route_kernel` (it also zeroes `scratch`): -> (sorted pair ids [capacity], block experts [nb_max],
    the number of blocks filled [1])."""
    P = topk_ids.numel()
    ints = torch.empty(2 * 1024 + P + capacity + nb_max + 1, dtype=torch.int32, device=topk_ids.device)
    counts, offsets, nb = ints[:1024], ints[1024:2048], ints[-1:]
    rank, sorted_pairs = ints[2048 : 2048 + P], ints[2048 + P : 2048 + P + capacity]
    block_expert = ints[2048 + P + capacity : -1]
    e_pad = triton.next_power_of_2(E)
    if e_pad > 1024:
        raise ValueError(f"moe (triton): at most 1024 experts, got {E}")
    block = 1024
    _route_kernel[(1 + triton.cdiv(scratch.numel(), block),)](
        topk_ids, sorted_pairs, block_expert, counts, offsets, rank, nb, scratch, scratch.numel(), P, capacity, nb_max,
        BM=BM, E_PAD=e_pad, BLOCK=block, PDL=use_pdl, **({"launch_pdl": True} if use_pdl else {}))
    return sorted_pairs, block_expert, nb


DECODE_ROWS = 16  # the decode path's scratch is sized for this many tokens at least (see _decode_scratch)


def _decode_scratch(device, M, top_k, D, I, gu_tiles, dn_tiles):
    """Zeroed scratch of the decode path, in one buffer that the kernels leave zeroed (counters.arrival_counters,
    owner "moe_w4a16"): gate/up counters [M k, gu_tiles] and down counters [M, dn_tiles] (int32), the pairs'
    fp32 gate/up sums [M k, 2 I] and the tokens' fp32 output sums [M, D]. Sized for max(M, DECODE_ROWS)
    tokens so that the CUDA graphs of the small buckets all capture the same buffer (a larger M grows it)."""
    def sizes(m):  # each section rounded up to 128 bytes (aligned vector loads)
        return [triton.cdiv(n, 32) * 32 for n in (m * top_k * gu_tiles, m * dn_tiles, m * top_k * 2 * I, m * D)]

    buf = arrival_counters("moe_w4a16", device, sum(sizes(max(M, DECODE_ROWS))))
    ends = list(itertools.accumulate(sizes(M)))
    gu_counters, dn_counters = buf[: ends[0]], buf[ends[0] : ends[1]]
    sums = buf[ends[1] : ends[2]].view(torch.float32)[: M * top_k * 2 * I].view(M * top_k, 2 * I)
    out = buf[ends[2] : ends[3]].view(torch.float32)[: M * D].view(M, D)
    return gu_counters, dn_counters, sums, out


_GRID = {}  # (kernel, device, dtype, constexprs) -> programs of a persistent kernel the GPU holds at once


def _occupancy(kernel, device):
    """CTAs of a compiled kernel that one SM of `device` holds at once, by its registers, shared memory and
    warps (the CUDA occupancy rules: registers allocated per warp in units of 256, 1 KB of shared memory reserved
    per CTA)."""
    kernel._init_handles()
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    warp_regs = triton.cdiv(max(kernel.n_regs, 1) * 32, 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // warp_regs // warps
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // (kernel.metadata.shared + 1024)
    by_warps = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return max(1, min(by_regs, by_smem, by_warps, 16))


def _resident_programs(kernel, args, constexprs, device, dtype):
    """Programs of `kernel` (launched with args and constexprs) that the GPU holds at once: SMs x its CTAs an SM
    (`_occupancy` of the compiled kernel, compiled once here)."""
    key = (kernel.fn.__name__, device, dtype, *sorted(constexprs.items()))
    if key not in _GRID:
        _GRID[key] = sm_count(device) * _occupancy(kernel.warmup(*args, **constexprs, grid=(1,)), device)
    return _GRID[key]


def _planned_gate_up(x, experts, h, counters, sorted_pairs, block_expert, nb, g, BM, top_k, ptx, use_pdl=False):
    """Launch `_planned_gate_up_kernel` (gate/up config g with `device_split`): as many programs as the GPU holds
    at once (in the interpreter, `waves` x 4), partials for up to 4 x that many work items."""
    D, I, dev = x.shape[1], experts.intermediate, x.device
    BN, slabs = g["BN"], experts.gate_up.shape[-2] // SLAB_WORDS
    constexprs = dict(TOP_K=top_k, BM=BM, BN=BN, TILES_N=triton.cdiv(I, BN), S_PAD=triton.next_power_of_2(slabs),
                      COST=PLAN_COST, EVEN_N=I % BN == 0, EVEN_K=D % SLAB == 0, **UNPACK[x.dtype],
                      **{k: v for k, v in _flags(g, I, ptx).items() if k in _PERSISTENT_FLAGS},
                      PDL=use_pdl, **_launch(g, use_pdl))
    cap = 4 * g["waves"] * sm_count(dev)  # work items with partials, at most (`_plan_split`)
    part = torch.empty(cap * 2 * BM * BN, dtype=torch.float32, device=dev)
    layout = _layout(experts.gate_up, experts.gate_up_scale, experts.panel_gate_up, BN, up=I)
    constexprs["PANEL"] = layout.pop("PANEL")
    args = [x, experts.gate_up, experts.gate_up_scale, h, part, counters, sorted_pairs, block_expert, nb, D, I, slabs,
            cap, experts.gate_up.stride(0), experts.gate_up_scale.stride(0),
            *(layout[k] for k in ("w_row", "s_row", "stride_wp", "stride_sp", "up_w", "up_s"))]
    programs = _resident_programs(_planned_gate_up_kernel, args, constexprs, dev, x.dtype) if ptx else cap // 4
    _planned_gate_up_kernel[(programs,)](*args, **constexprs)


def _persistent_down(h, experts, out, topk_weights, sorted_pairs, block_expert, nb, d, BM, top_k, tiles, split,
                     per_split, dtype, ptx, use_pdl=False):
    """Launch `_persistent_down_kernel` (down config d with `persistent`): as many programs as the GPU holds at
    once (in the interpreter, `waves` x 4)."""
    D, I, dev = out.shape[1], experts.intermediate, out.device
    BN, slabs = d["BN"], experts.down.shape[-2] // SLAB_WORDS
    layout = _layout(experts.down, experts.down_scale, experts.panel_down, BN)
    constexprs = dict(TOP_K=top_k, BM=BM, BN=BN, GROUPS=triton.cdiv(D, BN) // tiles, EVEN_N=D % BN == 0,
                      PANEL=layout.pop("PANEL"), TILES=tiles, EVEN_K=I % SLAB == 0,
                      ONE_SLAB=slabs == 1 and tiles > 1, **UNPACK[dtype],
                      **{k: v for k, v in _flags(d, D, ptx).items() if k in _PERSISTENT_FLAGS},
                      PDL=use_pdl, **_launch(d, use_pdl))
    args = [h, experts.down, experts.down_scale, out, topk_weights, sorted_pairs, block_expert, nb, D, I, slabs,
            per_split, split, experts.down.stride(0), experts.down_scale.stride(0),
            *(layout[k] for k in ("w_row", "s_row", "stride_wp", "stride_sp"))]
    programs = _resident_programs(_persistent_down_kernel, args, constexprs, dev, dtype) if ptx else d["waves"] * 4
    _persistent_down_kernel[(programs,)](*args, **constexprs)


def moe(x, topk_ids, topk_weights, experts, keep_sums=False, config=None):
    """Triton backend of ops.moe (see there): x [M, D] bf16/fp16, topk_ids [M, k] int32, topk_weights [M, k] fp32.
    keep_sums: the routing-pass path returns its fp32 sums, without the cast (the decode path writes x's dtype).
    `config` overrides the moe_configs entry (benchmark sweeps).
    """
    if x.dtype not in UNPACK:
        raise ValueError(f"moe (triton): x must be bfloat16 or float16, got {x.dtype}")
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise ValueError(f"moe (triton): topk_ids must be int32 and topk_weights float32, "
                         f"got {topk_ids.dtype} and {topk_weights.dtype}")
    x, topk_ids, topk_weights = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    M, D = x.shape
    top_k, E, I = topk_ids.shape[1], experts.num_experts, experts.intermediate
    P = M * top_k
    cfg = config or config_for(x.device, M, intermediate=I)
    layout = (experts.panel_gate_up, experts.panel_down)
    if tuple(cfg.get("panels", layout)) != layout:
        raise ValueError(f"moe (triton): config for panels {cfg['panels']}, experts laid out with {layout}")
    BM, decode = cfg["BM"], cfg.get("decode", False)
    nb_max = P if decode else triton.cdiv(P, BM) + min(E, P)
    capacity = nb_max * BM
    sms = sm_count(x.device)
    est_blocks = P if decode else _expected_experts(E, P) + triton.cdiv(P, BM)

    gu_bn = cfg["gate_up"]["BN"]
    gu_tiles = triton.cdiv(I, gu_bn)
    gu_slabs = experts.gate_up.shape[-2] // SLAB_WORDS
    gu_split = _split(gu_slabs, est_blocks * gu_tiles, sms, cfg["gate_up"]["waves"])
    gu_per_split = triton.cdiv(gu_slabs, gu_split)
    gu_split = triton.cdiv(gu_slabs, gu_per_split)
    dn_bn, dn_per_cta = cfg["down"]["BN"], cfg["down"].get("tiles", 1)
    if dn_per_cta > 1 and D % (dn_bn * dn_per_cta):
        if config is not None:
            raise ValueError(f"moe (triton): down tiles {dn_per_cta} x BN {dn_bn} must divide the hidden size {D}")
        dn_per_cta = 1  # a table entry's tiles on a hidden size they do not divide: one tile a program
    dn_tiles = triton.cdiv(D, dn_bn) // dn_per_cta  # programs along N
    dn_slabs = experts.down.shape[-2] // SLAB_WORDS
    dn_split = _split(dn_slabs, est_blocks * dn_tiles, sms, cfg["down"]["waves"])
    dn_per_split = triton.cdiv(dn_slabs, dn_split)
    dn_split = triton.cdiv(dn_slabs, dn_per_split)

    dev = x.device
    ptx = dev.type == "cuda"  # inline PTX (lop3) compiles; the interpreter runs the plain forms
    # programmatic dependent launch (sm_90 and newer) of the GEMMs, and of the routing pass before them, where the
    # entry asks for it
    use_pdl = ptx and cfg.get("pdl", False) and pdl.active(x)
    h = torch.empty((capacity, I), dtype=x.dtype, device=dev)
    if decode:  # no routing pass, no memset, no cast: zeroed sums and counters that the kernels zero again
        sorted_pairs = block_expert = topk_ids
        y = torch.empty((M, D), dtype=x.dtype, device=dev)
        gu_counters, dn_counters, part, out = _decode_scratch(dev, M, top_k, D, I, gu_tiles, dn_tiles)
        counters = gu_counters
    else:
        planned = cfg["gate_up"].get("device_split", False)
        n_counters = nb_max * gu_tiles if gu_split > 1 or planned else 0
        scratch = torch.empty(M * D + n_counters, dtype=torch.float32, device=dev)  # zeroed by _route_kernel
        sorted_pairs, block_expert, nb = _route(topk_ids, scratch, E, BM, capacity, nb_max, use_pdl)
        out, counters = scratch[: M * D].view(M, D), scratch[M * D :].view(torch.int32)
        y, dn_counters = out, counters  # unused
        part = torch.empty((gu_split if gu_split > 1 else 0, capacity, 2 * I), dtype=torch.float32, device=dev)
    magic = UNPACK[x.dtype]
    gu_layout = _layout(experts.gate_up, experts.gate_up_scale, experts.panel_gate_up, gu_bn, up=I)
    dn_layout = _layout(experts.down, experts.down_scale, experts.panel_down, dn_bn)
    g, d = cfg["gate_up"], cfg["down"]
    with mma_v2_only(g.get("mma_v2", False)):  # each kernel compiled (at its first launch) as its config asks
        if not decode and planned:
            _planned_gate_up(x, experts, h, counters, sorted_pairs, block_expert, nb, g, BM, top_k, ptx, use_pdl)
        else:
            _gate_up_kernel[(nb_max, gu_tiles, gu_split)](
                x, experts.gate_up, experts.gate_up_scale, h, part, counters, sorted_pairs, block_expert,
                D, I, gu_slabs, gu_per_split, gu_split, experts.gate_up.stride(0), experts.gate_up_scale.stride(0),
                part.stride(0) if gu_split > 1 and not decode else 0, **gu_layout,
                TOP_K=top_k, BM=BM, BN=gu_bn, SPLIT=gu_split > 1, EVEN_K=D % SLAB == 0, **_flags(g, I, ptx),
                DECODE=decode, PDL=use_pdl, **_launch(g, use_pdl), **magic)
    with mma_v2_only(d.get("mma_v2", False)):
        if not decode and d.get("persistent", False):
            _persistent_down(h, experts, out, topk_weights, sorted_pairs, block_expert, nb, d, BM, top_k, dn_per_cta,
                             dn_split, dn_per_split, x.dtype, ptx, use_pdl)
            return out if keep_sums else out.to(x.dtype)
        _down_kernel[(nb_max, dn_tiles, dn_split)](
            h, experts.down, experts.down_scale, out, y, dn_counters, topk_weights, sorted_pairs, block_expert,
            D, I, dn_slabs, dn_per_split, experts.down.stride(0), experts.down_scale.stride(0), **dn_layout,
            TOP_K=top_k, BM=BM, BN=dn_bn, EVEN_K=I % SLAB == 0, **_flags(d, D, ptx), DECODE=decode, TILES=dn_per_cta,
            ONE_SLAB=dn_slabs == 1 and dn_per_cta > 1, PDL=use_pdl, **_launch(d, use_pdl), **magic)
    return y if decode else out if keep_sums else out.to(x.dtype)


def jit_specialisation(kernel, signature, constexprs, I=256):
    """`aot.compile_for` keywords that compile a `compile_specs` launch as the JIT specialises the call at
    intermediate size I: 16-byte aligned pointers, D, I and the strides multiples of 16, and as the constant 1
    K-major words' row stride (PANEL 1) and a down kernel's slab count when I is one slab."""
    ones = ["w_row"] if constexprs.get("PANEL") == 1 else []
    if kernel in (_down_kernel, _persistent_down_kernel) and I <= SLAB:
        ones.append("n_slabs")
    strides = ("D", "I", "stride_we", "stride_se", "w_row", "s_row", "stride_wp", "stride_sp", "up_w", "up_s")
    return dict(aligned=True, divisible=[n for n in strides if n in signature and n not in ones], ones=ones)


def compile_specs(cfg, dtype="bf16", top_k=8, arch=120, D=7168, I=256):
    """(kernel, (signature, constexprs, arch, num_warps, num_stages, maxnreg)) for each GEMM kernel under config
    `cfg` at hidden D / intermediate I (for EVEN_N), for ahead-of-time checks with triton_kernels.aot.compile_for."""
    magic = UNPACK[torch.bfloat16 if dtype == "bf16" else torch.float16]
    common = dict(sorted_ptr="*i32", block_expert_ptr="*i32", D="i32", I="i32", n_slabs="i32",
                  n_slabs_per_split="i32")
    layout = dict(w_row="i32", s_row="i32", stride_wp="i32", stride_sp="i32")
    gate_up = dict(x_ptr=f"*{dtype}", w_ptr="*i32", s_ptr="*bf16", h_ptr=f"*{dtype}", part_ptr="*fp32",
                   counter_ptr="*i32", **common, split_k="i32", stride_we="i64", stride_se="i64", stride_part="i64",
                   **layout, up_w="i32", up_s="i32")
    down = dict(h_ptr=f"*{dtype}", w_ptr="*i32", s_ptr="*bf16", out_ptr="*fp32", y_ptr=f"*{dtype}",
                counter_ptr="*i32", weights_ptr="*fp32", **common,
                stride_we="i64", stride_se="i64", **layout)
    g, d, decode = cfg["gate_up"], cfg["down"], cfg.get("decode", False)
    p_gu, p_dn = cfg.get("panels", (0, 0))
    use_pdl = cfg.get("pdl", False)
    if g.get("device_split", False) and not decode:
        planned = dict(x_ptr=f"*{dtype}", w_ptr="*i32", s_ptr="*bf16", h_ptr=f"*{dtype}", part_ptr="*fp32",
                       counter_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32", nb_ptr="*i32", D="i32",
                       I="i32", n_slabs="i32", cap="i32", stride_we="i64", stride_se="i64", **layout, up_w="i32",
                       up_s="i32")
        flags = {k: v for k, v in _flags(g, I).items() if k in _PERSISTENT_FLAGS}
        gu_spec = (_planned_gate_up_kernel, (planned, dict(
            TOP_K=top_k, BM=cfg["BM"], BN=g["BN"], TILES_N=triton.cdiv(I, g["BN"]), S_PAD=32, COST=PLAN_COST,
            EVEN_N=I % g["BN"] == 0, PANEL=p_gu, EVEN_K=True, **flags, PDL=use_pdl, **magic), arch, g["num_warps"],
            g["num_stages"], g.get("maxnreg")))
    else:
        gu_spec = (_gate_up_kernel, (gate_up, dict(TOP_K=top_k, BM=cfg["BM"], BN=g["BN"], SPLIT=True, EVEN_K=True,
                                                   **_flags(g, I), DECODE=decode, PANEL=p_gu,
                                                   PDL=use_pdl, **magic), arch, g["num_warps"],
                                   g["num_stages"], g.get("maxnreg")))
    if d.get("persistent", False) and not decode:
        tiles = d.get("tiles", 1)
        persistent = dict(h_ptr=f"*{dtype}", w_ptr="*i32", s_ptr="*bf16", out_ptr="*fp32", weights_ptr="*fp32",
                          sorted_ptr="*i32", block_expert_ptr="*i32", nb_ptr="*i32", D="i32", I="i32", n_slabs="i32",
                          n_slabs_per_split="i32", split="i32", stride_we="i64", stride_se="i64", **layout)
        flags = {k: v for k, v in _flags(d, D).items() if k in _PERSISTENT_FLAGS}
        return [gu_spec, (_persistent_down_kernel, (persistent, dict(
            TOP_K=top_k, BM=cfg["BM"], BN=d["BN"], GROUPS=D // (d["BN"] * tiles), EVEN_N=D % d["BN"] == 0,
            PANEL=p_dn, TILES=tiles, EVEN_K=True, ONE_SLAB=I <= SLAB and tiles > 1, **flags, PDL=use_pdl, **magic),
            arch, d["num_warps"], d["num_stages"], d.get("maxnreg")))]
    return [
        gu_spec,
        (_down_kernel, (down, dict(TOP_K=top_k, BM=cfg["BM"], BN=d["BN"], EVEN_K=True, **_flags(d, D), DECODE=decode,
                                   PANEL=p_dn, TILES=d.get("tiles", 1), ONE_SLAB=I <= SLAB and d.get("tiles", 1) > 1,
                                   PDL=use_pdl, **magic), arch, d["num_warps"], d["num_stages"],
                    d.get("maxnreg"))),
    ]
