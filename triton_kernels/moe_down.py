"""The W4A16 MoE's second GEMM: out[token] += topk_weight * (h W_down^T) per (block of pairs, group of N tiles of the
hidden size, K split), atomically added into the token's fp32 row (the reduction over top-k). Two kernels, each
followed by its launcher: `_down_kernel` on a static grid (the decode path's sums included) and
`_persistent_down_kernel` on a persistent grid over the blocks the routing pass filled (`persistent`)."""

import triton
import triton.language as tl

from triton_kernels import pdl
from triton_kernels.moe_layout import SLAB, SLAB_WORDS, UNPACK
from triton_kernels.moe_tiles import (LAYOUT_SIGNATURE, SIGNATURE_DTYPES, acc_zeros, aot_options, block_expert,
                                      block_pairs, expert_bases, flags, launch_options, layout_args, load_scales,
                                      load_slab, orient, prefetch_slab, resident_programs, slab_dot, slab_ptrs,
                                      slab_scales, tile_cols, tile_columns, tokens_of, work_item)

_SLAB_WORDS = tl.constexpr(SLAB_WORDS)


@triton.jit
def _down_slabs(acc, w_base, s_base, h_rows, w_cols, s_cols, valid, n_mask, col_mask, first, end, I, w_row, s_row,
                MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, DTYPE: tl.constexpr,
                EVEN_K: tl.constexpr, SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr,
                PRESCALE: tl.constexpr):
    """acc [BM, BN] (SWAP: [BN, BM]) += slabs first .. end - 1 of an N tile (its K loop; AHEAD: each slab's
    scales loaded during the slab before)."""
    sc = 0  # with AHEAD: the scales [BN, 8] of the slab being computed
    if AHEAD:
        sc = slab_scales(s_base, s_cols, first, s_row, n_mask)
    for slab in range(first, end):
        w_ptrs, a_ptrs, s_ptrs, k = slab_ptrs(w_base, s_base, h_rows, w_cols, s_cols, slab, w_row, s_row, SWAP)
        if AHEAD:
            sc_next = slab_scales(s_base, s_cols, tl.minimum(slab + 1, end - 1), s_row, n_mask)
        w0, w1 = load_slab(w_ptrs, w_row, col_mask)  # [16, BN] each (SWAP: [BN, 16])
        acc = slab_dot(acc, a_ptrs, valid, k, I, w0, w1, s_ptrs, n_mask, s_row, sc, MAGIC, MAGIC_VALUE, WIDE,
                       DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
        if AHEAD:
            sc = sc_next
    return acc


@triton.jit
def _tile_scales(s_base, tile, s_row, D, BN: tl.constexpr, EVEN_N: tl.constexpr):
    """Slab 0's 8 group scales [BN, 8] of N tile `tile` (`load_scales`)."""
    n = tile * BN + tl.arange(0, BN)  # [BN]
    return load_scales(s_base + tile_cols(tile, 0, BN, False), (n < D) | EVEN_N, s_row)


@triton.jit
def _down_block(h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, pair, e, rows, pid_n, pid_k, D, I, n_slabs,
                n_slabs_per_split, stride_we, stride_se, w_row, s_row, stride_wn, TOP_K: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, EVEN_N: tl.constexpr, KMAJOR: tl.constexpr,
                TILES: tl.constexpr, MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr,
                EVEN_K: tl.constexpr, SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr,
                ONE_SLAB: tl.constexpr, PDL: tl.constexpr, PRESCALE: tl.constexpr):
    """The work of one `_down_kernel` program: block `rows` [BM] (pair ids `pair`, expert e), N tiles TILES * pid_n
    .. TILES * pid_n + TILES - 1, K split pid_k."""
    DTYPE = h_ptr.dtype.element_ty
    valid = pair >= 0
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)  # [BM] fp32
    token = tokens_of(pair, TOP_K)
    w_base, s_base = expert_bases(w_ptr, s_ptr, e, stride_we, stride_se)
    h_rows = h_ptr + rows.to(tl.int64) * I
    first = pid_k * n_slabs_per_split
    end = tl.minimum(first + n_slabs_per_split, n_slabs)
    if PDL:
        for t in tl.static_range(TILES):
            if KMAJOR:  # a column's slab: 32 words, one 128-byte line
                pdl.prefetch_l2(w_base + tile_cols(pid_n * TILES + t, stride_wn, BN, KMAJOR) + first * _SLAB_WORDS)
            else:
                lines = w_base + tile_cols(pid_n * TILES + t, stride_wn, BN, KMAJOR, 32)[None, :]  # [1, BN / 32]
                prefetch_slab(lines, first, w_row)
        pdl.enter(PDL)  # then the next kernel may launch (it waits for this one)
    last = pid_n * TILES + TILES - 1  # this program's last N tile
    sc_tile = 0  # ONE_SLAB with AHEAD: the scales [BN, 8] of the tile being computed
    if ONE_SLAB:
        if AHEAD:
            sc_tile = _tile_scales(s_base, pid_n * TILES, s_row, D, BN, EVEN_N)
    for t in range(TILES):  # one after the other: index loads and activations set up once
        tile = pid_n * TILES + t
        n, n_mask, w_cols, s_cols = tile_columns(tile, D, stride_wn, BN, KMAJOR, EVEN_N)  # hidden columns n
        T, C = orient(token, n, SWAP)
        valid_r, col_mask = orient(valid, n_mask, SWAP)
        acc = acc_zeros(BM, BN, SWAP)
        if ONE_SLAB:  # no K loop: this loop is the innermost, so its loads are pipelined across tiles
            w_ptrs, a_ptrs, s_ptrs, k = slab_ptrs(w_base, s_base, h_rows, w_cols, s_cols, first, w_row, s_row, SWAP)
            if AHEAD:
                sc_next = _tile_scales(s_base, tl.minimum(tile + 1, last), s_row, D, BN, EVEN_N)
            w0, w1 = load_slab(w_ptrs, w_row, col_mask)  # [16, BN] each (SWAP: [BN, 16])
            acc = slab_dot(acc, a_ptrs, valid, k, I, w0, w1, s_ptrs, n_mask, s_row, sc_tile, MAGIC, MAGIC_VALUE,
                           WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
            if AHEAD:
                sc_tile = sc_next
        else:
            acc = _down_slabs(acc, w_base, s_base, h_rows, w_cols, s_cols, valid, n_mask, col_mask, first, end, I,
                              w_row, s_row, MAGIC, MAGIC_VALUE, WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
        # relaxed: only atomicity is needed (the cast reads out in a later launch); the default acq_rel fences every
        # atomic (MEMBAR.ALL.GPU + L1 invalidation on sm_90)
        W, _ = orient(weight, n, SWAP)
        tl.atomic_add(out_ptr + T * D + C, acc * W, mask=valid_r & col_mask, sem="relaxed")


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


@triton.jit(do_not_specialize=["n_slabs_per_split"])
def _down_kernel(h_ptr, w_ptr, s_ptr, out_ptr, y_ptr, counter_ptr, weights_ptr, sorted_ptr, block_expert_ptr,
                 D, I, n_slabs, n_slabs_per_split, stride_we, stride_se, w_row, s_row, stride_wn,
                 TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 DECODE: tl.constexpr, KMAJOR: tl.constexpr, TILES: tl.constexpr,
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
    rows, e = block_expert(block_expert_ptr, pid_b, BM)  # [BM] slots
    if e < 0:
        return
    pair = block_pairs(sorted_ptr, rows, pid_b, BM, DECODE)
    _down_block(h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, pair, e, rows, pid_n, pid_k, D, I, n_slabs,
                n_slabs_per_split, stride_we, stride_se, w_row, s_row, stride_wn, TOP_K, BM, BN, False, KMAJOR,
                TILES, MAGIC, MAGIC_VALUE, WIDE, EVEN_K, SWAP, LOP3, AHEAD, ONE_SLAB, PDL, PRESCALE)
    if DECODE:
        token0 = pid_b // TOP_K
        _down_sums(out_ptr + token0 * D, y_ptr + token0 * D,
                   counter_ptr + token0 * tl.num_programs(1) + pid_n, pid_n * TILES, D, TOP_K * tl.num_programs(2),
                   BN, TILES, False)


def down_constexprs(d, BM, top_k, dtype, tiles, slabs, decode, even_k, kmajor, use_pdl, ptx=True):
    """The constexprs of `_down_kernel` under down config d (`tiles` N tiles a program, `slabs` along K)."""
    return dict(TOP_K=top_k, BM=BM, BN=d["BN"], DECODE=decode, KMAJOR=kmajor, TILES=tiles, **UNPACK[dtype],
                EVEN_K=even_k, **flags(d, ptx), ONE_SLAB=slabs == 1 and tiles > 1, PDL=use_pdl)


def down(h, experts, out, y, counters, topk_weights, sorted_pairs, block_expert, d, BM, top_k, blocks, tiles, split,
         per_split, decode, dtype, ptx, use_pdl):
    """Launch `_down_kernel` (down config d) over `blocks` blocks x the hidden size's groups of `tiles` N tiles x
    `split` K splits of per_split slabs: out [M, D] fp32 += the top-k weighted products (with `decode`, out is the
    zeroed sums and y [M, D] in `dtype` gets the result)."""
    D, I = out.shape[1], experts.intermediate
    _down_kernel[(blocks, triton.cdiv(D, d["BN"]) // tiles, split)](
        h, experts.down, experts.down_scale, out, y, counters, topk_weights, sorted_pairs, block_expert,
        D, I, experts.down_slabs, per_split, experts.down.stride(0), experts.down_scale.stride(0),
        **layout_args(experts.down, experts.down_scale, experts.kmajor),
        **down_constexprs(d, BM, top_k, dtype, tiles, experts.down_slabs, decode, I % SLAB == 0, experts.kmajor,
                          use_pdl, ptx),
        **launch_options(d, use_pdl))


@triton.jit(do_not_specialize=["n_slabs_per_split", "split"])
def _persistent_down_kernel(h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, nb_ptr,
                            D, I, n_slabs, n_slabs_per_split, split, stride_we, stride_se, w_row, s_row, stride_wn,
                            TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUPS: tl.constexpr,
                            EVEN_N: tl.constexpr, KMAJOR: tl.constexpr, TILES: tl.constexpr, MAGIC: tl.constexpr,
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
        b, grp, j, rows, e, pair = work_item(item, split, block_expert_ptr, sorted_ptr, GROUPS, BM)
        _down_block(h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, pair, e, rows, grp, j, D, I, n_slabs,
                    n_slabs_per_split, stride_we, stride_se, w_row, s_row, stride_wn, TOP_K, BM, BN, EVEN_N, KMAJOR,
                    TILES, MAGIC, MAGIC_VALUE, WIDE, EVEN_K, SWAP, LOP3, AHEAD, ONE_SLAB, False, PRESCALE)


def persistent_down_constexprs(d, BM, top_k, dtype, D, tiles, slabs, even_k, kmajor, use_pdl, ptx=True):
    """The constexprs of `_persistent_down_kernel` under down config d (D: the hidden size)."""
    f = flags(d, ptx)
    return dict(TOP_K=top_k, BM=BM, BN=d["BN"], GROUPS=triton.cdiv(D, d["BN"]) // tiles, EVEN_N=D % d["BN"] == 0,
                KMAJOR=kmajor, TILES=tiles, **UNPACK[dtype], EVEN_K=even_k, SWAP=f["SWAP"], LOP3=f["LOP3"],
                AHEAD=f["AHEAD"], ONE_SLAB=slabs == 1 and tiles > 1, PRESCALE=f["PRESCALE"], PDL=use_pdl,
                MMA_V2=f["MMA_V2"])


def persistent_down(h, experts, out, topk_weights, sorted_pairs, block_expert, nb, d, BM, top_k, tiles, split,
                    per_split, dtype, ptx, use_pdl):
    """Launch `_persistent_down_kernel` (down config d with `persistent`): as many programs as the GPU holds at
    once (in the interpreter, `waves` x 4)."""
    D, I, dev = out.shape[1], experts.intermediate, out.device
    layout = layout_args(experts.down, experts.down_scale, experts.kmajor)
    constexprs = persistent_down_constexprs(d, BM, top_k, dtype, D, tiles, experts.down_slabs, I % SLAB == 0,
                                            experts.kmajor, use_pdl, ptx)
    constexprs.update(launch_options(d, use_pdl))
    args = [h, experts.down, experts.down_scale, out, topk_weights, sorted_pairs, block_expert, nb, D, I,
            experts.down_slabs, per_split, split, experts.down.stride(0), experts.down_scale.stride(0),
            *(layout[k] for k in ("w_row", "s_row", "stride_wn"))]
    programs = resident_programs(_persistent_down_kernel, args, constexprs, dev, dtype) if ptx else d["waves"] * 4
    _persistent_down_kernel[(programs,)](*args, **constexprs)


def down_spec(cfg, top_k, dtype, key, D, I):
    """(kernel, signature, constexprs, aot options) of the down kernel that `moe_w4a16.moe` launches under entry
    `cfg` (hidden D, intermediate I, activations of `dtype`; split over K), compiled for arch `key`."""
    d, BM, decode, kmajor, use_pdl = cfg["down"], cfg["BM"], cfg.get("decode", False), cfg.get("kmajor", False), \
        cfg.get("pdl", False)
    slabs, tiles = triton.cdiv(I, SLAB), d.get("tiles", 1)
    x = SIGNATURE_DTYPES[dtype]
    signature = dict(h_ptr=f"*{x}", w_ptr="*i32", s_ptr="*bf16", out_ptr="*fp32")
    if d.get("persistent", False) and not decode:
        kernel = _persistent_down_kernel
        signature.update(weights_ptr="*fp32", sorted_ptr="*i32", block_expert_ptr="*i32", nb_ptr="*i32", D="i32",
                         I="i32", n_slabs="i32", n_slabs_per_split="i32", split="i32")
        constexprs = persistent_down_constexprs(d, BM, top_k, dtype, D, tiles, slabs, I % SLAB == 0, kmajor, use_pdl)
    else:
        kernel = _down_kernel
        signature.update(y_ptr=f"*{x}", counter_ptr="*i32", weights_ptr="*fp32", sorted_ptr="*i32",
                         block_expert_ptr="*i32", D="i32", I="i32", n_slabs="i32", n_slabs_per_split="i32")
        constexprs = down_constexprs(d, BM, top_k, dtype, tiles, slabs, decode, I % SLAB == 0, kmajor, use_pdl)
    signature.update(stride_we="i64", stride_se="i64", **LAYOUT_SIGNATURE)
    return kernel, signature, constexprs, aot_options(signature, d, key, kmajor, slabs == 1)
