"""The W4A16 MoE's first GEMM: h = silu(x W_gate^T) * (x W_up^T) per (block of pairs, N tile of the intermediate),
split over K. Two kernels, each followed by its launcher: `_gate_up_kernel` on a static grid (the routing pass's
bound on the blocks, or one block per pair on the decode path) and `_planned_gate_up_kernel` on a persistent grid
whose K split is chosen on the device from the blocks the routing pass filled (`device_split`)."""

import torch
import triton
import triton.language as tl

from triton_kernels import arch, pdl
from triton_kernels.moe_layout import SLAB, UNPACK
from triton_kernels.moe_tiles import (LAYOUT_SIGNATURE, SIGNATURE_DTYPES, acc_zeros, aot_options, block_expert,
                                      block_pairs, expert_bases, flags, launch_options, layout_args, load_scales,
                                      load_slab, orient, resident_programs, slab_dot, slab_ptrs, tile_columns,
                                      tokens_of, work_item)

PLAN_COST = 1  # `_plan_split`: a work item's fixed cost (epilogue, index loads), in slabs


@triton.jit
def _gate_up_slabs(w_base, s_base, a_rows, w_cols, s_cols, valid, n_mask, col_mask, first, end, D, w_row, s_row,
                   up_w, up_s, BM: tl.constexpr, BN: tl.constexpr, MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr,
                   WIDE: tl.constexpr, DTYPE: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                   LOP3: tl.constexpr, AHEAD: tl.constexpr, PRESCALE: tl.constexpr):
    """The K loop over slabs first .. end - 1: gate and up partial tiles acc_g, acc_u [BM, BN] (SWAP: [BN, BM]).
    AHEAD loads a slab's scales during the slab before (Triton pipelines only loads that feed a dot: the scales
    would otherwise wait a global load each slab)."""
    acc_g = acc_zeros(BM, BN, SWAP)
    acc_u = acc_zeros(BM, BN, SWAP)
    sg, su = 0, 0  # with AHEAD: the gate and up scales [BN, 8] of the slab being computed
    if AHEAD:
        s0 = s_base + (first * 8) * s_row + s_cols
        sg, su = load_scales(s0, n_mask, s_row), load_scales(s0 + up_s, n_mask, s_row)
    for slab in range(first, end):
        w_ptrs, a_ptrs, s_ptrs, k = slab_ptrs(w_base, s_base, a_rows, w_cols, s_cols, slab, w_row, s_row, SWAP)
        if AHEAD:
            s_next = s_base + (tl.minimum(slab + 1, end - 1) * 8) * s_row + s_cols  # [BN]
            sg_next, su_next = load_scales(s_next, n_mask, s_row), load_scales(s_next + up_s, n_mask, s_row)
        g0, g1 = load_slab(w_ptrs, w_row, col_mask)  # [16, BN] each (SWAP: [BN, 16])
        u0, u1 = load_slab(w_ptrs + up_w, w_row, col_mask)
        acc_g = slab_dot(acc_g, a_ptrs, valid, k, D, g0, g1, s_ptrs, n_mask, s_row, sg, MAGIC, MAGIC_VALUE,
                         WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
        acc_u = slab_dot(acc_u, a_ptrs, valid, k, D, u0, u1, s_ptrs + up_s, n_mask, s_row, su, MAGIC,
                         MAGIC_VALUE, WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
        if AHEAD:
            sg, su = sg_next, su_next
    return acc_g, acc_u


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
                    w_row, s_row, stride_wn, up_w, up_s,
                    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                    DECODE: tl.constexpr, KMAJOR: tl.constexpr,
                    MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, WIDE: tl.constexpr, EVEN_K: tl.constexpr,
                    SWAP: tl.constexpr, LOP3: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr = False,
                    PRESCALE: tl.constexpr = False, MMA_V2: tl.constexpr = False):
    """h[slot, n] = silu(x W_gate^T) * (x W_up^T) for block pid 0's rows and N tile pid 1 of the intermediate.

    With SPLIT, pid 2 of split_k sums a range of slabs into part; the last split to arrive finishes the tile:
    it sums the split_k partials [split_k, capacity, 2 I], or with DECODE it reads the pair's fp32 sums part
    [P, 2 I], to which every split added its own (relaxed atomics), and zeroes them and its counter again.
    PDL (programmatic dependent launch): the down kernel may launch once every program has started; this kernel
    waits for the previous one (whatever wrote x, or the routing pass) first.
    Layout (`moe_tiles.layout_args`): w_row / s_row are the row strides of words / scales, stride_wn the column
    stride of K-major words, up_w / up_s the offsets of the up columns from the gate columns.
    """
    pid_b, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pdl.enter(PDL)  # release after the wait: the down kernel reads the routing pass's output
    rows, e = block_expert(block_expert_ptr, pid_b, BM)  # [BM] slots
    if e < 0:
        return
    pair = block_pairs(sorted_ptr, rows, pid_b, BM, DECODE)
    DTYPE = x_ptr.dtype.element_ty
    token = tokens_of(pair, TOP_K)
    n, n_mask, w_cols, s_cols = tile_columns(pid_n, I, stride_wn, BN, KMAJOR, False)  # gate columns n
    w_base, s_base = expert_bases(w_ptr, s_ptr, e, stride_we, stride_se)
    two_i = 2 * I  # up columns are n + I
    R, C = orient(rows.to(tl.int64), n, SWAP)  # tile indices: [BM, 1], [1, BN] (SWAP: [1, BM], [BN, 1])
    _, col_mask = orient(rows, n_mask, SWAP)
    first = pid_k * n_slabs_per_split
    end = tl.minimum(first + n_slabs_per_split, n_slabs)
    acc_g, acc_u = _gate_up_slabs(w_base, s_base, x_ptr + token * D, w_cols, s_cols, pair >= 0, n_mask, col_mask,
                                  first, end, D, w_row, s_row, up_w, up_s, BM, BN, MAGIC, MAGIC_VALUE, WIDE, DTYPE,
                                  EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
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
            acc_g = acc_zeros(BM, BN, SWAP)
            acc_u = acc_zeros(BM, BN, SWAP)
            part = part_ptr + R * two_i + C
            for j in range(split_k):
                acc_g += tl.load(part + j * stride_part, mask=col_mask, other=0.0, cache_modifier=".cg")
                acc_u += tl.load(part + j * stride_part + I, mask=col_mask, other=0.0, cache_modifier=".cg")
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(h_ptr + out, h.to(DTYPE), mask=col_mask)
    else:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + out, h.to(DTYPE), mask=col_mask)


def gate_up_constexprs(g, BM, top_k, dtype, split, decode, even_k, kmajor, use_pdl, ptx=True):
    """The constexprs of `_gate_up_kernel` under gate/up config g."""
    return dict(TOP_K=top_k, BM=BM, BN=g["BN"], SPLIT=split, DECODE=decode, KMAJOR=kmajor, **UNPACK[dtype],
                EVEN_K=even_k, **flags(g, ptx), PDL=use_pdl)


def gate_up(x, experts, h, part, counters, sorted_pairs, block_expert, g, BM, top_k, blocks, split, per_split,
            decode, ptx, use_pdl):
    """Launch `_gate_up_kernel` (gate/up config g) over `blocks` blocks x the intermediate's N tiles x `split` K
    splits of per_split slabs: h [blocks BM, I] from x [M, D]; the partials `part` and arrival `counters` are
    the routing pass's (or with `decode` the zeroed sums and counters of `moe_w4a16.decode_scratch`)."""
    D, I = x.shape[1], experts.intermediate
    _gate_up_kernel[(blocks, triton.cdiv(I, g["BN"]), split)](
        x, experts.gate_up, experts.gate_up_scale, h, part, counters, sorted_pairs, block_expert,
        D, I, experts.gate_up_slabs, per_split, split, experts.gate_up.stride(0), experts.gate_up_scale.stride(0),
        part.stride(0) if split > 1 and not decode else 0,
        **layout_args(experts.gate_up, experts.gate_up_scale, experts.kmajor, up=I),
        **gate_up_constexprs(g, BM, top_k, x.dtype, split > 1, decode, D % SLAB == 0, experts.kmajor, use_pdl, ptx),
        **launch_options(g, use_pdl))


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
                            D, I, n_slabs, cap, stride_we, stride_se, w_row, s_row, stride_wn, up_w, up_s,
                            TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TILES_N: tl.constexpr,
                            S_PAD: tl.constexpr, COST: tl.constexpr, EVEN_N: tl.constexpr, KMAJOR: tl.constexpr,
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
    for item in range(pid, nb * TILES_N * split, G):
        b, t, j, rows, e, pair = work_item(item, split, block_expert_ptr, sorted_ptr, TILES_N, BM)
        token = tokens_of(pair, TOP_K)
        w_base, s_base = expert_bases(w_ptr, s_ptr, e, stride_we, stride_se)
        n, n_mask, w_cols, s_cols = tile_columns(t, I, stride_wn, BN, KMAJOR, EVEN_N)  # gate columns n
        R, C = orient(rows.to(tl.int64), n, SWAP)
        _, col_mask = orient(rows, n_mask, SWAP)
        first = j * per_split
        end = tl.minimum(first + per_split, n_slabs)
        acc_g, acc_u = _gate_up_slabs(w_base, s_base, x_ptr + token * D, w_cols, s_cols, pair >= 0, n_mask,
                                      col_mask, first, end, D, w_row, s_row, up_w, up_s, BM, BN, MAGIC, MAGIC_VALUE,
                                      WIDE, DTYPE, EVEN_K, SWAP, LOP3, AHEAD, PRESCALE)
        last = split == 1
        if split > 1:
            loc_r, loc_c = orient(tl.arange(0, BM), tl.arange(0, BN), SWAP)
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


def planned_gate_up_constexprs(g, BM, top_k, dtype, I, slabs, even_k, kmajor, use_pdl, ptx=True):
    """The constexprs of `_planned_gate_up_kernel` under gate/up config g (I: the intermediate size)."""
    f = flags(g, ptx)
    return dict(TOP_K=top_k, BM=BM, BN=g["BN"], TILES_N=triton.cdiv(I, g["BN"]), S_PAD=triton.next_power_of_2(slabs),
                COST=PLAN_COST, EVEN_N=I % g["BN"] == 0, KMAJOR=kmajor, **UNPACK[dtype], EVEN_K=even_k,
                SWAP=f["SWAP"], LOP3=f["LOP3"], AHEAD=f["AHEAD"], PRESCALE=f["PRESCALE"], PDL=use_pdl,
                MMA_V2=f["MMA_V2"])


def planned_gate_up(x, experts, h, counters, sorted_pairs, block_expert, nb, g, BM, top_k, ptx, use_pdl):
    """Launch `_planned_gate_up_kernel` (gate/up config g with `device_split`): as many programs as the GPU holds
    at once (in the interpreter, `waves` x 4), partials for up to 4 x that many work items."""
    D, I, dev = x.shape[1], experts.intermediate, x.device
    constexprs = planned_gate_up_constexprs(g, BM, top_k, x.dtype, I, experts.gate_up_slabs, D % SLAB == 0,
                                            experts.kmajor, use_pdl, ptx)
    cap = 4 * g["waves"] * arch.sm_count(dev)  # work items with partials, at most (`_plan_split`)
    part = torch.empty(cap * 2 * BM * g["BN"], dtype=torch.float32, device=dev)
    layout = layout_args(experts.gate_up, experts.gate_up_scale, experts.kmajor, up=I)
    args = [x, experts.gate_up, experts.gate_up_scale, h, part, counters, sorted_pairs, block_expert, nb, D, I,
            experts.gate_up_slabs, cap, experts.gate_up.stride(0), experts.gate_up_scale.stride(0),
            *(layout[k] for k in ("w_row", "s_row", "stride_wn", "up_w", "up_s"))]
    constexprs.update(launch_options(g, use_pdl))
    programs = resident_programs(_planned_gate_up_kernel, args, constexprs, dev, x.dtype) if ptx else cap // 4
    _planned_gate_up_kernel[(programs,)](*args, **constexprs)


def gate_up_spec(cfg, top_k, dtype, key, D, I):
    """(kernel, signature, constexprs, aot options) of the gate/up kernel that `moe_w4a16.moe` launches under entry
    `cfg` (hidden D, intermediate I, activations of `dtype`; split over K), compiled for arch `key`."""
    g, BM, decode, kmajor, use_pdl = cfg["gate_up"], cfg["BM"], cfg.get("decode", False), cfg.get("kmajor", False), \
        cfg.get("pdl", False)
    slabs = triton.cdiv(D, SLAB)
    x = SIGNATURE_DTYPES[dtype]
    signature = dict(x_ptr=f"*{x}", w_ptr="*i32", s_ptr="*bf16", h_ptr=f"*{x}", part_ptr="*fp32", counter_ptr="*i32",
                     sorted_ptr="*i32", block_expert_ptr="*i32")
    if g.get("device_split", False) and not decode:
        kernel = _planned_gate_up_kernel
        signature.update(nb_ptr="*i32", D="i32", I="i32", n_slabs="i32", cap="i32", stride_we="i64", stride_se="i64")
        constexprs = planned_gate_up_constexprs(g, BM, top_k, dtype, I, slabs, D % SLAB == 0, kmajor, use_pdl)
    else:
        kernel = _gate_up_kernel
        signature.update(D="i32", I="i32", n_slabs="i32", n_slabs_per_split="i32", split_k="i32", stride_we="i64",
                         stride_se="i64", stride_part="i64")
        constexprs = gate_up_constexprs(g, BM, top_k, dtype, True, decode, D % SLAB == 0, kmajor, use_pdl)
    signature.update(**LAYOUT_SIGNATURE, up_w="i32", up_s="i32")
    return kernel, signature, constexprs, aot_options(signature, g, key, kmajor, slabs == 1)
