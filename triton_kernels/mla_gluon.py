"""The MLA split kernel hand-scheduled in Gluon for sm_90 (Hopper): `mla_attention(..., gluon=True)`.

The same work and outputs as `mla_attention._mla_split_kernel` with its 64x64 config (64-row query tiles, 64-entry
cache tiles, all 512 values a program): split bounds from `cache_lens` on the device (the tail split too), the
prefix's whole tiles streamed by TMA through a ring of STAGES buffers signalled by mbarriers, the last tiles
(ragged edge and tree) loaded with masks (entries past the length read as 0: the cache there may hold anything)
and masked by the tree's bits or causally. Two warpgroups each compute half of S = Q K^T's columns (wgmma, Q and
K in shared memory: 229,904 bytes with two stages), the online softmax runs in registers (exp2 domain), P goes
to shared memory, and each warpgroup takes 256 value columns of O += P V from the same cache tile (V is the latent
part of K). What Triton decides for itself is written out here, and it hardly spills (Triton 3.6: 254-255
registers, 8 bytes in the tree form; the Triton kernel spills 556 bytes).

Gluon has no interpreter: the CPU suite compiles it for sm_90 (tests/test_attention_kernel.py) and the GPU
tests run it. Where it is measured: triton_kernels/README.md (attention, sessions 12 and 13).
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from triton_kernels.mla_attention import program_range

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # Triton >= 3.7 / 3.6
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6 / newer
_NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # Triton >= 3.7 / 3.6

ENTRY, LAT, PE, ROWS, BLOCK_N, STAGES = 576, 512, 64, 64, 64, 2  # host ints: entry, its parts, the tiles, the ring
D_LAT, D_PE, BM = gl.constexpr(LAT), gl.constexpr(PE), gl.constexpr(ROWS)  # the same, for the kernel


@gluon.jit
def _issue_tile(k_lat_desc, k_pe_desc, k_lat, k_pe, bars, row, slot):
    """TMA of cache rows [row, row + BN) into ring slot `slot`, signalled on its barrier."""
    bar = bars.index(slot)
    mbarrier.expect(bar, k_lat_desc.block_type.nbytes + k_pe_desc.block_type.nbytes)
    _tma_load(k_lat_desc, [row, 0], bar, k_lat.index(slot))
    _tma_load(k_pe_desc, [row, 0], bar, k_pe.index(slot))


@gluon.jit
def _fill_tile(kv_ptr, row0, count, k_lat, k_pe, BN: gl.constexpr):
    """Cache rows [row0, row0 + count) of kv_ptr ([.., 576] rows) into k_lat [BN, 512] and k_pe [BN, 64], rows
    past count as 0 (masked loads: the cache past a sequence's length may hold anything)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])  # 16-byte loads
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, D_PE, layout=gl.SliceLayout(0, ld))
    ptrs = kv_ptr + (row0 + r).to(gl.int64)[:, None] * (D_LAT + D_PE) + c[None, :]
    ok = (r < count)[:, None]
    for chunk in gl.static_range(D_LAT // D_PE):  # 64 columns at a time (registers)
        k_lat.slice(chunk * D_PE, D_PE, dim=1).store(gl.load(ptrs + chunk * D_PE, mask=ok, other=0.0))
    k_pe.store(gl.load(ptrs + D_LAT, mask=ok, other=0.0))
    fence_async_shared()
    _cta_barrier()


@gluon.jit
def _scores(q_lat, q_pe, k_lat, k_pe, s_layout: gl.constexpr, BN: gl.constexpr):
    """S = Q_lat K_lat^T + Q_pe K_pe^T [BM, BN], fp32."""
    s = gl.zeros([BM, BN], gl.float32, s_layout)
    s = warpgroup_mma(q_lat, k_lat.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(q_pe, k_pe.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(0, deps=[s])


@gluon.jit
def _online_step(s, m_i, l_i, acc, p_smem, v, row_o: gl.constexpr):
    """One tile of the online softmax: s [BM, BN] scaled scores (log2 units, -inf where invisible), v the tile's
    latent [BN, 512] in shared memory. Returns (m, l, acc)."""
    m_new = gl.maximum(m_i, gl.max(s, 1))  # m_i starts finite (-1e30): a fully masked row gives p = 0, not NaN
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    _cta_barrier()  # all of P (both warpgroups' columns) is in shared memory
    acc = warpgroup_mma(p_smem, v, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    _cta_barrier()  # both warpgroups are done with P and with the tile's buffers
    return m_new, l_i, acc


@gluon.jit
def _ready(i, n_full, bars, kv_ptr, row0, count, k_lat, k_pe, BN: gl.constexpr, STAGES: gl.constexpr):
    """Tile i in its ring slot: a prefix tile waited for (TMA), one of the last few (ragged edge, tree) loaded with
    masks from cache rows [row0, row0 + count); every load the ring was given has been waited for by then."""
    slot = i % STAGES
    if i < n_full:
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
    else:
        _fill_tile(kv_ptr, row0, count, k_lat.index(slot), k_pe.index(slot), BN)


@gluon.jit
def _visible(s, j0, end, tree_start, offs_m, rows, b, T, mask_ptr, H: gl.constexpr, CAUSAL: gl.constexpr,
             s_layout: gl.constexpr, BN: gl.constexpr):
    """s [BM, BN] of the tile of entries [j0, j0 + BN) with -inf where invisible: past end, or a tree entry that is
    not the row's node or its ancestor (tree bits), or (causal) a later token's."""
    t_row = offs_m // H  # [BM] the new token of each row (row = t*H + h)
    offs_n = j0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))  # [BN]
    n_ok = offs_n < end
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
def _store_partials(o, ring, o_part_ptr, o_rows, o_ok):
    """o [BM, 512] (registers, the MMA's layout) -> o_part rows o_rows [BM] (where o_ok), through the cache ring's
    shared memory (free by now): from the MMA's layout a thread group stores 8 bytes of a row (16-bit partials: half
    a sector), from a row-major one each warp 512 contiguous bytes."""
    dtype: gl.constexpr = o_part_ptr.dtype.element_ty
    vec: gl.constexpr = 128 // dtype.primitive_bitwidth  # 16 bytes
    # 16-byte units XOR-swizzled by row % 8: the MMA layout's stores (8 rows x 8 columns) take the fewest wavefronts
    swizzled: gl.constexpr = gl.SwizzledSharedLayout(vec, 1, 8, [1, 0])
    if _NEW_REINTERPRET:
        stage = ring.reinterpret(dtype, [BM, D_LAT], swizzled)
    else:
        stage = ring._reinterpret(dtype, [BM, D_LAT], swizzled)
    stage.store(o.to(dtype))
    _cta_barrier()
    rowwise: gl.constexpr = gl.BlockedLayout([1, vec], [1, 32], [gl.num_warps(), 1], [1, 0])
    rows = gl.convert_layout(o_rows.to(gl.int64), gl.SliceLayout(1, rowwise))
    ok = gl.convert_layout(o_ok, gl.SliceLayout(1, rowwise))
    cols = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, rowwise))
    gl.store(o_part_ptr + (rows * D_LAT)[:, None] + cols[None, :], stage.load(rowwise), mask=ok[:, None])


@gluon.jit
def _split_kernel(q_lat_desc, q_pe_desc, k_lat_desc, k_pe_desc, kv_ptr, lens_ptr, mask_ptr, o_part_ptr,
                  lse_part_ptr, T, rows_kb, sm_scale_log2,
                  H: gl.constexpr, CAUSAL: gl.constexpr, TAIL_SPLIT: gl.constexpr, BN: gl.constexpr,
                  STAGES: gl.constexpr):
    """Split pid 1 of query tile pid 0 of sequence pid 2 -> partials o [B, splits, rows, 512] (o / l) and lse
    [B, splits, rows] (log2 domain, -inf for an empty split), as `_mla_split_kernel` writes them (one split too:
    the merge then divides by 1)."""
    gl.static_assert(gl.num_warps() == 8, "two warpgroups")
    pid_m, pid_s, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    num_splits = gl.num_programs(1)
    rows = T * H
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BN // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D_LAT // 2, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    length = gl.load(lens_ptr + b)
    tree_start, start, end, n_full = program_range(length, T, pid_m, pid_s, num_splits, H, CAUSAL, TAIL_SPLIT, BM, BN)

    q_lat = gl.allocate_shared_memory(gl.bfloat16, [BM, D_LAT], q_lat_desc.layout)
    q_pe = gl.allocate_shared_memory(gl.bfloat16, [BM, D_PE], q_pe_desc.layout)
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, D_LAT], k_lat_desc.layout)
    k_pe = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, D_PE], k_pe_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], gl.NVMMASharedLayout.get_default_for([BM, BN],
                                                                                                   gl.bfloat16))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_lat_desc.block_type.nbytes + q_pe_desc.block_type.nbytes)
    _tma_load(q_lat_desc, [b * rows + pid_m * BM, 0], q_bar, q_lat)  # rows past this sequence's: never stored
    _tma_load(q_pe_desc, [b * rows + pid_m * BM, 0], q_bar, q_pe)
    base = b * rows_kb  # the sequence's first cache row
    for st in gl.static_range(STAGES):
        if st < n_full:
            _issue_tile(k_lat_desc, k_pe_desc, k_lat, k_pe, bars, base + start + st * BN, st)
    mbarrier.wait(q_bar, 0)

    m_i = gl.full([BM], -1.0e30, gl.float32, row_s)
    l_i = gl.zeros([BM], gl.float32, row_s)
    acc = gl.zeros([BM, D_LAT], gl.float32, o_layout)
    offs_m = pid_m * BM + gl.arange(0, BM, layout=row_s)  # [BM] row = t*H + h
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BN)
    for i in range(n_tiles):
        slot, j0 = i % STAGES, start + i * BN
        _ready(i, n_full, bars, kv_ptr, base + j0, end - j0, k_lat, k_pe, BN, STAGES)
        s = _scores(q_lat, q_pe, k_lat.index(slot), k_pe.index(slot), s_layout, BN) * sm_scale_log2
        if i >= n_full:
            s = _visible(s, j0, end, tree_start, offs_m, rows, b, T, mask_ptr, H, CAUSAL, s_layout, BN)
        m_i, l_i, acc = _online_step(s, m_i, l_i, acc, p_smem, k_lat.index(slot), row_o)
        if i + STAGES < n_full:
            _issue_tile(k_lat_desc, k_pe_desc, k_lat, k_pe, bars, base + start + (i + STAGES) * BN, slot)

    l_safe = gl.where(l_i > 0, l_i, 1.0)
    part_row = (b * num_splits + pid_s) * rows + offs_m  # [BM]
    lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
    gl.store(lse_part_ptr + part_row, lse, mask=offs_m < rows)
    o = acc / gl.convert_layout(l_safe, row_o)[:, None]
    o_ok = (offs_m < rows) & (start < end)  # an empty split stores no o, only lse = -inf
    _store_partials(o, k_lat, o_part_ptr, part_row, o_ok)


def usable(q, kv_cache, config):
    """Whether the Gluon kernel can run this call: a Hopper GPU (not the interpreter), bf16, the 64x64 config with
    all 512 values a program, 16-byte aligned q and cache rows."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9 and q.dtype == torch.bfloat16
            and tuple(config[:2]) == (ROWS, BLOCK_N) and config[4] == LAT and q.data_ptr() % 16 == 0
            and kv_cache.data_ptr() % 16 == 0 and kv_cache.is_contiguous())


def _desc(t, block):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def split(q, kv_cache, cache_lens, mask, o_part, lse_part, num_splits, scale_log2, causal, tail_split):
    """Launch the split kernel as `mla_attention` launches `_mla_split_kernel`: q [B, T, H, 576] bf16 contiguous,
    kv_cache [B, L_max, 576] contiguous, cache_lens [B] int32, mask the tree mask (or anything with causal) ->
    the partials o_part [B, splits, T*H, 512] and lse_part [B, splits, T*H] for `_merge_kernel`."""
    B, T, H, _ = q.shape
    rows = T * H
    q2, kv2 = q.view(B * rows, ENTRY), kv_cache.view(-1, ENTRY)
    _split_kernel[(triton.cdiv(rows, ROWS), num_splits, B)](
        _desc(q2[:, :LAT], [ROWS, LAT]), _desc(q2[:, LAT:], [ROWS, PE]), _desc(kv2[:, :LAT], [BLOCK_N, LAT]),
        _desc(kv2[:, LAT:], [BLOCK_N, PE]), kv_cache, cache_lens, mask, o_part, lse_part, T,
        kv_cache.stride(0) // ENTRY, scale_log2, H=H, CAUSAL=causal, TAIL_SPLIT=tail_split and num_splits > 1,
        BN=BLOCK_N, STAGES=STAGES, num_warps=8)


def compile_report(H=8, causal=False, tail_split=True):
    """Compile the split kernel (bf16 partials, the op's) for sm_90 on this machine (no GPU needed): (shared bytes,
    registers, spill bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from triton_kernels.aot import Resources, _ptxas_report

    q = torch.empty(ROWS, ENTRY, dtype=torch.bfloat16)
    kv = torch.empty(4 * BLOCK_N, ENTRY, dtype=torch.bfloat16)
    descs = dict(q_lat_desc=(q[:, :LAT], [ROWS, LAT]), q_pe_desc=(q[:, LAT:], [ROWS, PE]),
                 k_lat_desc=(kv[:, :LAT], [BLOCK_N, LAT]), k_pe_desc=(kv[:, LAT:], [BLOCK_N, PE]))
    signature = {name: mangle_type(_desc(*args)) for name, args in descs.items()}
    signature.update(kv_ptr="*bf16", lens_ptr="*i32", mask_ptr="*i32", o_part_ptr="*bf16",
                     lse_part_ptr="*fp32", T="i32", rows_kb="i32", sm_scale_log2="fp32")
    constexprs = dict(H=H, CAUSAL=causal, TAIL_SPLIT=tail_split, BN=BLOCK_N, STAGES=STAGES)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(list(signature).index(name),): [["tt.divisibility", 16]] for name in ("kv_ptr", "o_part_ptr")}
    src = GluonASTSource(_split_kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    registers, spills = _ptxas_report(compiled.asm["ptx"], 90)
    return Resources(shared=compiled.metadata.shared, registers=registers, spill_bytes=spills)
