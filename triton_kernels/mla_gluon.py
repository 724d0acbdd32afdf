"""The MLA split kernel hand-scheduled in Gluon for sm_90 (Hopper), the default there (`mla_attention.GLUON`).

The same work and outputs as `mla_attention._mla_split_kernel` with its 64-row config (64-row query tiles, all 512
values a program): split bounds from `cache_lens` on the device (the tail split too), partials o (bf16) and lse.
Scheduled as FlashMLA's "seesaw": the cache tiles go in pairs to two warpgroups. Warpgroup 0 computes the scores
S = Q K^T [64, BN] and the softmax of a pair's first tile while warpgroup 1 computes its second's; each takes half
of the 512 value columns of O += P V for both tiles, the other's P and running max passed through shared memory
(P over the tile's rope part, which the scores have read). So one warpgroup's softmax runs under the other's MMAs,
and no reduction crosses warpgroups inside a tile. A loader partition streams Q and the tiles by TMA through a
ring of STAGES slots (two pairs of 32-entry tiles where the query block has at most 64 rows, one pair of 64-entry
tiles above: RINGS), at most RING_IN_FLIGHT of them in flight; a split's ragged last tile is loaded right-aligned
at the split's end (no entry past the sequence, where the cache may hold NaN, is ever loaded; the tile's entries
before its own are masked), the tree's tiles have their scores masked by the tree's bits (or causally). Launched
with programmatic dependent launch (`pdl.py`): the programs wait for the previous grid before their first load.

Gluon has no interpreter: the CPU suite compiles it for sm_90 (tests/test_attention_kernel.py) and the GPU tests
run it.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from triton_kernels import aot, arch, pdl
from triton_kernels.mla_splits import D_LAT as LAT, D_PE as PE, ENTRY, program_range

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # Triton >= 3.7 / 3.6
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6 / newer
_NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # Triton >= 3.7 / 3.6

ROWS = 64  # query rows a program
D_LAT, D_PE, BM = gl.constexpr(LAT), gl.constexpr(PE), gl.constexpr(ROWS)  # the same, for the kernel
HALF = gl.constexpr(LAT // 2)  # value columns a warpgroup owns
# The ring, (cache entries a tile, tiles in the ring), by query rows: the first whose rows (None: any) fit. Two
# pairs of 32-entry tiles where the query block has at most 64 rows, one pair of 64-entry tiles above: the faster
# at every timed shape (bench/results/attention_gluon_h200_s14_seesaw.json).
RINGS = ((ROWS, (32, 4)), (None, (64, 2)))
# Tiles the loader keeps in flight, by ring (the ring's size where not listed): it issues tile i once tile i - n has
# landed. All programs ask for their ring at once at the start, and a tile lands when its last bytes do, so with the
# whole ring in flight the first tile lands about when the last does; 2 of the (32, 4) ring's 4 are 2-5% faster at
# 32k (bench/results/attention_gluon_h200_s17_in_flight.json), fewer of the (64, 2) ring's slower.
RING_IN_FLIGHT = {(32, 4): 2}
# Registers a thread of each of the two compute warpgroups. With the loader's (the kernel's 4 warps, the default
# partition, which gets what is left: 24) that is 12 warps, so the launch's maxnreg is MAXNREG = 65,536 / 384
# rounded down to a multiple of 8.
PARTITION_REGS, MAXNREG = gl.constexpr(240), 168


@gluon.jit
def _issue_tile(k_lat_desc, k_pe_desc, k_lat, k_pe, bars, b, entry, slot):
    """TMA of sequence b's cache entries [entry, entry + BN) into ring slot `slot`, signalled on its barrier (entries
    outside [0, L_max) arrive as zeros: the descriptors are [B, L_max, C])."""
    bar = bars.index(slot)
    mbarrier.expect(bar, k_lat_desc.block_type.nbytes + k_pe_desc.block_type.nbytes)
    _tma_load(k_lat_desc, [b, entry, 0], bar, _as_box(k_lat.index(slot), k_lat_desc))
    _tma_load(k_pe_desc, [b, entry, 0], bar, _as_box(k_pe.index(slot), k_pe_desc))


@gluon.jit
def _as_box(tile, desc):
    """A ring slot [BN, C] viewed as the descriptor's [1, BN, C] box (the same bytes)."""
    return _reinterpret(tile, tile.dtype, gl.constexpr(desc.block_type.shape), gl.constexpr(desc.layout))


@gluon.jit
def _reinterpret(buffer, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """The same shared memory viewed as `shape` of `dtype` in `layout` (the method's name differs by Triton)."""
    if _NEW_REINTERPRET:
        view = buffer.reinterpret(dtype, shape, layout)
    else:
        view = buffer._reinterpret(dtype, shape, layout)
    return view


@gluon.jit
def _tile_start(i, start, end, BN: gl.constexpr):
    """The first entry loaded for a split's tile i: start + i * BN, except that a ragged last tile is loaded
    right-aligned at the split's end, so that every entry it holds is inside the sequence (the cache past its length
    may hold NaN, which P V would spread even where P is 0); the entries before the tile's own are masked."""
    return gl.minimum(start + i * BN, end - BN)


@gluon.jit
def _scores(q_lat, q_pe, k_lat, k_pe, s_layout: gl.constexpr, BN: gl.constexpr):
    """S = Q_lat K_lat^T + Q_pe K_pe^T [BM, BN], fp32."""
    s = gl.zeros([BM, BN], gl.float32, s_layout)
    s = warpgroup_mma(q_lat, k_lat.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(q_pe, k_pe.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(0, deps=[s])


@gluon.jit
def _visible(s, j0, lo, end, tree_start, offs_m, rows, b, T, mask_ptr, H: gl.constexpr, CAUSAL: gl.constexpr,
             s_layout: gl.constexpr, BN: gl.constexpr):
    """s [BM, BN] of the tile of entries [j0, j0 + BN) with -inf where invisible: outside [lo, end), or a tree entry
    that is not the row's node or its ancestor (tree bits), or (causal) a later token's."""
    t_row = offs_m // H  # [BM] the new token of each row (row = t*H + h)
    offs_n = j0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))  # [BN]
    n_ok = (offs_n >= lo) & (offs_n < end)
    node = offs_n - tree_start  # new-token index of each entry (< 0: prefix)
    in_tree = node >= 0
    if CAUSAL:
        seen = node[None, :] <= t_row[:, None]
    else:
        node_c = gl.maximum(node, 0)
        words = gl.load(mask_ptr + (b * T + t_row)[:, None] * ((T + 31) // 32) + (node_c // 32)[None, :],
                        mask=(offs_m < rows)[:, None] & (in_tree & n_ok)[None, :], other=0)
        seen = ((words >> (node_c % 32)[None, :]) & 1) != 0
    return gl.where(n_ok[None, :] & (~in_tree[None, :] | seen), s, float("-inf"))


@gluon.jit
def _store_partials(o, ring, o_part_ptr, o_rows, o_ok, col0):
    """o [BM, W] (registers, the MMA's layout) -> o_part rows o_rows [BM] (where o_ok), columns [col0, col0 + W),
    through the cache ring's shared memory (free by now): from the MMA's layout a thread group stores 8 bytes of a row
    (16-bit partials: half a sector), from a row-major one each warp 512 contiguous bytes."""
    dtype: gl.constexpr = o_part_ptr.dtype.element_ty
    width: gl.constexpr = o.shape[1]
    vec: gl.constexpr = 128 // dtype.primitive_bitwidth  # 16 bytes
    # 16-byte units XOR-swizzled by row % 8: the MMA layout's stores (8 rows x 8 columns) take the fewest wavefronts
    swizzled: gl.constexpr = gl.SwizzledSharedLayout(vec, 1, 8, [1, 0])
    stage = _reinterpret(ring, dtype, gl.constexpr([BM, width]), swizzled)
    stage.store(o.to(dtype))
    _cta_barrier()
    rowwise: gl.constexpr = gl.BlockedLayout([1, vec], [1, 32], [gl.num_warps(), 1], [1, 0])
    rows = gl.convert_layout(o_rows.to(gl.int64), gl.SliceLayout(1, rowwise))
    ok = gl.convert_layout(o_ok, gl.SliceLayout(1, rowwise))
    cols = col0 + gl.arange(0, width, layout=gl.SliceLayout(0, rowwise))
    gl.store(o_part_ptr + (rows * D_LAT)[:, None] + cols[None, :], stage.load(rowwise), mask=ok[:, None])


@gluon.jit
def _opaque_zero(x):
    """0, which the compiler cannot see through: a shared-memory view indexed by it (`buffer.index(slot + zero)`) is
    addressed in the loop, where its MMA needs it, instead of the MMA's per-step descriptors being computed before the
    loop and held in registers (Triton 3.6: 2,708 bytes spilled a thread without it, 0 with it)."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_previous_grid(x):
    """griddepcontrol.wait (programmatic dependent launch, triton_kernels/pdl.py), returning 0 for an address to
    depend on."""
    return gl.inline_asm_elementwise("griddepcontrol.wait;\n\tmov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _tile_scores(i, q_lat, q_pe, k_lat, k_pe, ready, work, offs_m, s_layout: gl.constexpr, H: gl.constexpr,
                 CAUSAL: gl.constexpr, BN: gl.constexpr):
    """Scaled, masked scores [BM, BN] of the split's tile i once it has landed in its ring slot."""
    b, T, rows, tree_start, start, end, n_full, n_tiles, sm_scale_log2, mask_ptr = work
    slot = i % k_lat.shape[0]
    mbarrier.wait(ready.index(slot), (i // k_lat.shape[0]) & 1)
    zero = _opaque_zero(i)
    s = _scores(q_lat.index(zero), q_pe, k_lat.index(slot + zero), k_pe.index(slot + zero), s_layout, BN)
    s = s * sm_scale_log2
    if i >= n_full:
        s = _visible(s, _tile_start(i, start, end, BN), start + i * BN, end, tree_start, offs_m, rows, b, T, mask_ptr,
                     H, CAUSAL, s_layout, BN)
    return s


@gluon.jit
def _p_view(k_pe, slot):
    """Ring slot `slot`'s rope part [BN, 64] (free once the tile's scores are computed) as P [BM, BN], bf16."""
    BN: gl.constexpr = k_pe.shape[1]
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
    if BN == D_PE:
        view = k_pe.index(slot)
    else:
        view = _reinterpret(k_pe.index(slot), gl.bfloat16, gl.constexpr([BM, BN]), layout)
    return view


@gluon.jit
def _publish(p, p_smem, m, m_smem, done):
    """P (bf16) and its row max to shared memory for the other warpgroup, then arrive on `done`."""
    p_smem.store(p.to(p_smem.dtype))
    m_smem.store(m)
    fence_async_shared()
    _cta_barrier()  # every thread's part is written before the one arrive
    mbarrier.arrive(done, count=1)


@gluon.jit
def _add_pv(acc, k_pe, k_lat, slot, col0, empty):
    """acc [BM, 256] += P V with P over ring slot `slot`'s rope part and V its value columns [col0, col0 + 256), then
    this warpgroup is done with the slot."""
    zero = _opaque_zero(slot)
    v = k_lat.index(slot + zero).slice(col0, HALF, dim=1)
    acc = warpgroup_mma(_p_view(k_pe, slot + zero), v, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(empty.index(slot), count=1)
    return acc


@gluon.jit
def _start(pid_m, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """A compute warpgroup's rows of this query tile (offs_m [BM], row = t*H + h), running max, sum and O half."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_m = pid_m * BM + gl.arange(0, BM, layout=row_s)
    m_i = gl.full([BM], -1.0e30, gl.float32, row_s)
    l_i = gl.zeros([BM], gl.float32, row_s)
    return offs_m, m_i, l_i, gl.zeros([BM, HALF], gl.float32, o_layout)


@gluon.jit
def _finish(acc, m_i, l_i, offs_m, wg: gl.constexpr, l_smem, fin, k_lat, work, part_row_base, o_part_ptr,
            lse_part_ptr):
    """Both warpgroups' sums added (through shared memory), then this one's value half of o = acc / l stored to the
    partials (staged in its ring slot, free by then), and warpgroup 0 stores lse."""
    b, T, rows, tree_start, start, end, n_full, n_tiles, sm_scale_log2, mask_ptr = work
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    m_i, l_i = gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o)
    offs_m = gl.convert_layout(offs_m, row_o)
    part_row = part_row_base + offs_m
    l_smem[wg].store(l_i)
    _cta_barrier()
    mbarrier.arrive(fin, count=1)
    mbarrier.wait(fin, 0)  # both sums written, both warpgroups' MMAs done: the ring is free
    l_i = l_i + l_smem[1 - wg].load(l_i.type.layout)
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    if wg == 0:
        lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
        gl.store(lse_part_ptr + part_row, lse, mask=offs_m < rows)
    o = acc / l_safe[:, None]
    o_ok = (offs_m < rows) & (start < end)  # an empty split stores no o, only lse = -inf
    _store_partials(o, k_lat.index(wg), o_part_ptr, part_row, o_ok, wg * HALF)


@gluon.jit
def _warpgroup(descs, smem, bars, work, pid_m, part_row_base, o_part_ptr, lse_part_ptr, H: gl.constexpr,
               CAUSAL: gl.constexpr, BN: gl.constexpr, WG: gl.constexpr):
    """Compute warpgroup WG (a partition of 4 warps): its rows' running max, sum and O half over the split's tile
    pairs (WG 0: _left, 1: _right), then its part of the partials (_finish)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    q_bar, ready, empty, a_done, b_done, fin = bars
    rows: gl.constexpr = (gl.SliceLayout(1, s_layout), gl.SliceLayout(1, o_layout))  # a value a row of S, of O
    offs_m, m_i, l_i, acc = _start(pid_m, s_layout, o_layout)
    mbarrier.wait(q_bar, 0)
    if WG == 0:
        acc, m_i, l_i = _left(acc, m_i, l_i, offs_m, smem, bars, work, s_layout, rows[0], rows[1], H, CAUSAL, BN)
    else:
        acc, m_i, l_i = _right(acc, m_i, l_i, offs_m, smem, bars, work, s_layout, rows[0], rows[1], H, CAUSAL, BN)
    _finish(acc, m_i, l_i, offs_m, WG, smem[5], fin, smem[2], work, part_row_base, o_part_ptr, lse_part_ptr)


@gluon.jit
def _left(acc, m_i, l_i, offs_m, smem, bars, work, s_layout: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr,
          H: gl.constexpr, CAUSAL: gl.constexpr, BN: gl.constexpr):
    """Warpgroup 0's pairs: the scores of each pair's first tile, and value columns [0, 256) of both."""
    q_lat, q_pe, k_lat, k_pe, m_smem, l_smem = smem
    q_bar, ready, empty, a_done, b_done, fin = bars
    b, T, rows, tree_start, start, end, n_full, n_tiles, sm_scale_log2, mask_ptr = work
    STAGES: gl.constexpr = k_lat.shape[0]
    for k in range(gl.cdiv(n_tiles, 2)):
        i = 2 * k
        slot_a, slot_b = i % STAGES, (i + 1) % STAGES
        s = _tile_scores(i, q_lat, q_pe, k_lat, k_pe, ready, work, offs_m, s_layout, H, CAUSAL, BN)
        m_a = gl.maximum(m_i, gl.max(s, 1))  # m_i: the previous pair's last max (finite: no NaN from -inf rows)
        p = gl.exp2(s - m_a[:, None])
        alpha = gl.exp2(m_i - m_a)
        l_i = l_i * alpha + gl.sum(p, 1)
        _publish(p, _p_view(k_pe, slot_a), m_a, m_smem[0], a_done)  # over the tile's rope part: S has read it
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = _add_pv(acc, k_pe, k_lat, slot_a, 0, empty)
        m_i = m_a
        if i + 1 < n_tiles:  # the pair's second tile: warpgroup 1's P at its max, which includes m_a
            mbarrier.wait(b_done, k & 1)
            mbarrier.wait(ready.index(slot_b), ((i + 1) // STAGES) & 1)
            m_b = m_smem[1].load(row_s)
            beta = gl.exp2(m_i - m_b)
            l_i = l_i * beta
            acc = acc * gl.convert_layout(beta, row_o)[:, None]
            acc = _add_pv(acc, k_pe, k_lat, slot_b, 0, empty)
            m_i = m_b
    return acc, m_i, l_i


@gluon.jit
def _right(acc, m_i, l_i, offs_m, smem, bars, work, s_layout: gl.constexpr, row_s: gl.constexpr,
           row_o: gl.constexpr, H: gl.constexpr, CAUSAL: gl.constexpr, BN: gl.constexpr):
    """Warpgroup 1's pairs: the scores of each pair's second tile, and value columns [256, 512) of both."""
    q_lat, q_pe, k_lat, k_pe, m_smem, l_smem = smem
    q_bar, ready, empty, a_done, b_done, fin = bars
    b, T, rows, tree_start, start, end, n_full, n_tiles, sm_scale_log2, mask_ptr = work
    STAGES: gl.constexpr = k_lat.shape[0]
    for k in range(gl.cdiv(n_tiles, 2)):
        i = 2 * k
        slot_a, slot_b = i % STAGES, (i + 1) % STAGES
        has_b = i + 1 < n_tiles
        s = gl.full([BM, BN], float("-inf"), gl.float32, s_layout)
        if has_b:  # overlaps warpgroup 0's softmax of the first tile
            s = _tile_scores(i + 1, q_lat, q_pe, k_lat, k_pe, ready, work, offs_m, s_layout, H, CAUSAL, BN)
        mbarrier.wait(a_done, k & 1)
        m_a = m_smem[0].load(row_s)
        m_b = gl.maximum(m_a, gl.max(s, 1))  # m_a where there is no second tile (s -inf)
        p = gl.exp2(s - m_b[:, None])
        if has_b:  # published before this warpgroup's P V, for warpgroup 0's
            _publish(p, _p_view(k_pe, slot_b), m_b, m_smem[1], b_done)
        alpha = gl.exp2(m_i - m_a)
        beta = gl.exp2(m_a - m_b)
        l_i = l_i * alpha * beta + gl.sum(p, 1)
        mbarrier.wait(ready.index(slot_a), (i // STAGES) & 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = _add_pv(acc, k_pe, k_lat, slot_a, HALF, empty)
        if has_b:
            acc = acc * gl.convert_layout(beta, row_o)[:, None]
            acc = _add_pv(acc, k_pe, k_lat, slot_b, HALF, empty)
        m_i = m_b
    return acc, m_i, l_i


@gluon.jit
def _loader(descs, smem, bars, work, pid_m, part_row_base, o_part_ptr, lse_part_ptr, H: gl.constexpr,
            CAUSAL: gl.constexpr, BN: gl.constexpr, IN_FLIGHT: gl.constexpr):
    """The loader (the default partition: its 4 warps wait, one thread issues): Q, then the split's tiles by TMA
    into the ring as the warpgroups free the slots, at most IN_FLIGHT of them not yet landed."""
    q_lat_desc, q_pe_desc, k_lat_desc, k_pe_desc, q_row = descs
    q_lat, q_pe, k_lat, k_pe, m_smem, l_smem = smem
    q_bar, ready, empty, a_done, b_done, fin = bars
    b, T, rows, tree_start, start, end, n_full, n_tiles, sm_scale_log2, mask_ptr = work
    mbarrier.expect(q_bar, q_lat_desc.block_type.nbytes + q_pe_desc.block_type.nbytes)
    _tma_load(q_lat_desc, [q_row, 0], q_bar, q_lat.index(0))  # rows past this sequence's: never stored
    _tma_load(q_pe_desc, [q_row, 0], q_bar, q_pe)
    STAGES: gl.constexpr = k_lat.shape[0]
    for i in range(n_tiles):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        if IN_FLIGHT < STAGES:
            if i >= IN_FLIGHT:  # tile i - IN_FLIGHT has landed (its slot is refilled at tile i - IN_FLIGHT + STAGES)
                mbarrier.wait(ready.index((i - IN_FLIGHT) % STAGES), ((i - IN_FLIGHT) // STAGES) & 1)
        fence_async_shared()  # the warpgroups' generic writes (P) before the TMA's
        _issue_tile(k_lat_desc, k_pe_desc, k_lat, k_pe, ready, b, _tile_start(i, start, end, BN), slot)


@gluon.jit
def _split_kernel(q_lat_desc, q_pe_desc, k_lat_desc, k_pe_desc, lens_ptr, mask_ptr, o_part_ptr, lse_part_ptr, T,
                   sm_scale_log2, H: gl.constexpr, CAUSAL: gl.constexpr, TAIL_SPLIT: gl.constexpr,
                   BN: gl.constexpr, STAGES: gl.constexpr, IN_FLIGHT: gl.constexpr, PDL: gl.constexpr = False):
    """Split pid 1 of query tile pid 0 of sequence pid 2 -> partials o [B, splits, rows, 512] (o / l) and lse
    [B, splits, rows] (log2 domain, -inf for an empty split), as `_mla_split_kernel` writes them (with one split the
    op passes its output as o: no merge). The partitions: the loader (the kernel's 4 warps) and two compute
    warpgroups (_warpgroup: 4 warps each)."""
    pid_m, pid_s, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    num_splits = gl.num_programs(1)
    rows = T * H
    if PDL:  # launched early: wait for the previous grid before the first load (the partitions start after this)
        b = b + _wait_previous_grid(b)
    length = gl.load(lens_ptr + b)
    tree_start, start, end, n_full = program_range(length, T, pid_m, pid_s, num_splits, H, CAUSAL, TAIL_SPLIT, BM, BN)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BN)

    q_lat = gl.allocate_shared_memory(gl.bfloat16, [1, BM, D_LAT], q_lat_desc.layout)  # indexed by _opaque_zero
    q_pe = gl.allocate_shared_memory(gl.bfloat16, [BM, D_PE], q_pe_desc.layout)
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, D_LAT],
                                      gl.NVMMASharedLayout.get_default_for([BN, D_LAT], gl.bfloat16))
    k_pe = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, D_PE],
                                     gl.NVMMASharedLayout.get_default_for([BN, D_PE], gl.bfloat16))
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # a value a row: the max and sum exchanges
    m_smem = (gl.allocate_shared_memory(gl.float32, [BM], row_layout),
              gl.allocate_shared_memory(gl.float32, [BM], row_layout))
    l_smem = (gl.allocate_shared_memory(gl.float32, [BM], row_layout),
              gl.allocate_shared_memory(gl.float32, [BM], row_layout))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    b_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)  # both warpgroups
    mbarrier.init(a_done, count=1)
    mbarrier.init(b_done, count=1)
    mbarrier.init(fin, count=2)
    fence_async_shared()

    descs = (q_lat_desc, q_pe_desc, k_lat_desc, k_pe_desc, b * rows + pid_m * BM)
    smem = (q_lat, q_pe, k_lat, k_pe, m_smem, l_smem)
    bars = (q_bar, ready, empty, a_done, b_done, fin)
    work = (b, T, rows, tree_start, start, end, n_full, n_tiles, sm_scale_log2, mask_ptr)
    part_row_base = (b * num_splits + pid_s) * rows
    gl.warp_specialize([
        (_loader, (descs, smem, bars, work, pid_m, part_row_base, o_part_ptr, lse_part_ptr, H, CAUSAL, BN,
                   IN_FLIGHT)),
        (_warpgroup, (descs, smem, bars, work, pid_m, part_row_base, o_part_ptr, lse_part_ptr, H, CAUSAL, BN, 0)),
        (_warpgroup, (descs, smem, bars, work, pid_m, part_row_base, o_part_ptr, lse_part_ptr, H, CAUSAL, BN, 1)),
    ], [4, 4], [PARTITION_REGS, PARTITION_REGS])


def usable(q, kv_cache, tiles, partials):
    """Whether the Gluon kernel can run this call: a Hopper GPU running sm_90's tables (`arch.hopper_features`; not
    the interpreter), bf16, the op's 64x64 tiles, 16-byte aligned q and cache rows, and partials of `partials`
    (dtype) that `stages_partials` allows."""
    return (q.is_cuda and arch.hopper_features(q.device) and q.dtype == torch.bfloat16
            and (tiles.block_m, tiles.block_n) == (ROWS, 64) and q.data_ptr() % 16 == 0
            and kv_cache.data_ptr() % 16 == 0 and kv_cache.is_contiguous()
            and stages_partials(ring_for(q.shape[1] * q.shape[2]), partials))


def stages_partials(ring, partials):
    """Whether a warpgroup's partials [64, 256] of dtype `partials` fit the `ring` slot it stages them in
    (`_store_partials`): fp32 ones fill a 64-entry slot, twice a 32-entry one. Triton 3.9 refuses that view; 3.6
    compiles it, and warpgroup 0's staging would then run into warpgroup 1's slot (fp32 partials are only used
    when asked for: `mla_attention(partials=torch.float32)`)."""
    return ROWS * (LAT // 2) * partials.itemsize <= ring[0] * LAT * 2


def _desc(t, block):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def ring_for(rows):
    """(cache entries a tile, tiles in the ring) for a query block of `rows` = T*H rows (RINGS)."""
    return next(ring for max_rows, ring in RINGS if max_rows is None or rows <= max_rows)


def in_flight(ring):
    """Tiles the loader keeps in flight with `ring` (entries a tile, tiles in the ring): RING_IN_FLIGHT."""
    return RING_IN_FLIGHT.get(tuple(ring), ring[1])


def split(q, kv_cache, cache_lens, mask, o_part, lse_part, num_splits, scale_log2, causal, tail_split):
    """Launch the split kernel as `mla_attention` launches `_mla_split_kernel`: q [B, T, H, 576] bf16 contiguous,
    kv_cache [B, L_max, 576] contiguous, cache_lens [B] int32, mask the tree mask (or anything with causal) ->
    the partials o_part [B, splits, T*H, 512] and lse_part [B, splits, T*H] for the merge, with the ring of
    `ring_for(T*H)`."""
    B, T, H, _ = q.shape
    rows = T * H
    block_n, stages = ring = ring_for(rows)
    if not stages_partials(ring, o_part.dtype):
        raise ValueError(f"mla_gluon.split: {o_part.dtype} partials do not fit the ring {ring}'s slots")
    q2 = q.view(B * rows, ENTRY)
    _split_kernel[(triton.cdiv(rows, ROWS), num_splits, B)](
        _desc(q2[:, :LAT], [ROWS, LAT]), _desc(q2[:, LAT:], [ROWS, PE]), _desc(kv_cache[..., :LAT], [1, block_n, LAT]),
        _desc(kv_cache[..., LAT:], [1, block_n, PE]), cache_lens, mask, o_part, lse_part, T, scale_log2, H=H,
        CAUSAL=causal, TAIL_SPLIT=tail_split and num_splits > 1, BN=block_n, STAGES=stages,
        IN_FLIGHT=in_flight((block_n, stages)), num_warps=4,
        maxnreg=MAXNREG, **pdl.options(q))


def compile_report(H=8, causal=False, tail_split=True, ring=RINGS[-1][1]):
    """Compile the split kernel (bf16 partials, the op's) with `ring` for sm_90 on this machine (no GPU needed):
    (shared bytes, registers, spill bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty(ROWS, ENTRY, dtype=torch.bfloat16)
    block_n, stages = ring
    kv = torch.empty(2, 4 * block_n, ENTRY, dtype=torch.bfloat16)
    descs = dict(q_lat_desc=(q[:, :LAT], [ROWS, LAT]), q_pe_desc=(q[:, LAT:], [ROWS, PE]),
                 k_lat_desc=(kv[..., :LAT], [1, block_n, LAT]), k_pe_desc=(kv[..., LAT:], [1, block_n, PE]))
    signature = {name: mangle_type(_desc(*args)) for name, args in descs.items()}
    signature.update(lens_ptr="*i32", mask_ptr="*i32", o_part_ptr="*bf16", lse_part_ptr="*fp32", T="i32",
                     sm_scale_log2="fp32")
    constexprs = dict(H=H, CAUSAL=causal, TAIL_SPLIT=tail_split, BN=block_n, STAGES=stages,
                      IN_FLIGHT=in_flight(ring), PDL=True)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(list(signature).index("o_part_ptr"),): [["tt.divisibility", 16]]}
    src = GluonASTSource(_split_kernel, signature, constexprs=constexprs, attrs=attrs)
    return aot.resources(triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                        options=dict(num_warps=4, maxnreg=MAXNREG)))
