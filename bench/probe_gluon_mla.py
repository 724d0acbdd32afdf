"""A hand-scheduled MLA split tile in Gluon (sm_90), against the Triton split kernel (issue #6).

The Triton kernel's 64-row tile reaches ~62% of the measured bf16 matmul rate where it is compute-bound and
~4 us a 64-entry tile where it streams the cache; the issue's note says the rest needs a tile scheduled by hand.
This probe is the first step: the unmasked prefix loop of one split as a Gluon kernel, with what Triton decides
for itself written out. Q ([64, 512] latent + [64, 64] rope) comes in once through TMA; cache tiles
[BN, 512] + [BN, 64] stream through a ring of STAGES buffers, each filled by TMA and signalled by an mbarrier;
two warpgroups each compute half of S = Q K^T's columns (wgmma, Q and K from shared memory), the online softmax
runs in registers (exp2 domain), P goes to shared memory and both warpgroups take their 256 value columns of
O += P V from the same cache tile (V is the latent part of K). ASYNC overlaps the next tile's QK^T with this
tile's softmax (issued before it, waited after). Each split writes the merge kernel's partials (o / l in fp32,
lse = m + log2 l), so the project's own merge finishes both kernels' outputs.

    python bench/probe_gluon_mla.py --out DIR            # GPU: check against torch, time against the Triton op
    python bench/probe_gluon_mla.py --compile            # CPU: compile for sm_90 (this Triton), report resources

Only the unmasked path: the cache length must be a multiple of BN x splits, the rows of 64.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # Triton >= 3.7 / 3.6
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6 / newer

ENTRY, LAT, PE, ROWS = 576, 512, 64, 64  # a cache entry, its latent and rope parts; rows a program (host ints)
D_LAT, D_PE, BM = gl.constexpr(LAT), gl.constexpr(PE), gl.constexpr(ROWS)  # the same, for the kernel


@gluon.jit
def _issue_tile(k_lat_desc, k_pe_desc, k_lat, k_pe, bars, row, slot):
    """TMA of cache rows [row, row + BN) into ring slot `slot`, signalled on its barrier."""
    bar = bars.index(slot)
    mbarrier.expect(bar, k_lat_desc.block_type.nbytes + k_pe_desc.block_type.nbytes)
    _tma_load(k_lat_desc, [row, 0], bar, k_lat.index(slot))
    _tma_load(k_pe_desc, [row, 0], bar, k_pe.index(slot))


@gluon.jit
def _scores(q_lat, q_pe, k_lat, k_pe, s_layout: gl.constexpr, BN: gl.constexpr):
    """Issue S = Q_lat K_lat^T + Q_pe K_pe^T [BM, BN] (async wgmma; the caller waits)."""
    s = gl.zeros([BM, BN], gl.float32, s_layout)
    s = warpgroup_mma(q_lat, k_lat.permute((1, 0)), s, is_async=True)
    return warpgroup_mma(q_pe, k_pe.permute((1, 0)), s, is_async=True)


@gluon.jit
def _split_kernel(q_lat_desc, q_pe_desc, k_lat_desc, k_pe_desc, o_ptr, lse_ptr, R, split_len, scale_log2,
                  BN: gl.constexpr, STAGES: gl.constexpr, ASYNC: gl.constexpr):
    pid_m, split = gl.program_id(0), gl.program_id(1)
    num_warps: gl.constexpr = gl.num_warps()
    gl.static_assert(num_warps == 8, "two warpgroups")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D_LAT // 2, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

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

    start = split * split_len
    n_tiles = split_len // BN
    mbarrier.expect(q_bar, q_lat_desc.block_type.nbytes + q_pe_desc.block_type.nbytes)
    _tma_load(q_lat_desc, [pid_m * BM, 0], q_bar, q_lat)
    _tma_load(q_pe_desc, [pid_m * BM, 0], q_bar, q_pe)
    for st in gl.static_range(STAGES):
        _issue_tile(k_lat_desc, k_pe_desc, k_lat, k_pe, bars, start + st * BN, st)
    mbarrier.wait(q_bar, 0)

    m_i = gl.full([BM], -1.0e30, gl.float32, row_s)
    l_i = gl.zeros([BM], gl.float32, row_s)
    acc = gl.zeros([BM, D_LAT], gl.float32, o_layout)
    mbarrier.wait(bars.index(0), 0)
    s_next = _scores(q_lat, q_pe, k_lat.index(0), k_pe.index(0), s_layout, BN)
    for i in range(n_tiles):
        slot = i % STAGES
        s_tok = s_next
        if ASYNC:  # the next tile's QK^T goes to the tensor cores before this tile's softmax
            s = warpgroup_mma_wait(0, deps=[s_tok])
            if i + 1 < n_tiles:
                nxt = (i + 1) % STAGES
                mbarrier.wait(bars.index(nxt), ((i + 1) // STAGES) & 1)
                s_next = _scores(q_lat, q_pe, k_lat.index(nxt), k_pe.index(nxt), s_layout, BN)
        else:
            s = warpgroup_mma_wait(0, deps=[s_tok])
        s = s * scale_log2
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()  # all of P (both warpgroups' columns) is in shared memory
        acc = warpgroup_mma(p_smem, k_lat.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])  # with ASYNC also the next tile's QK^T (waits for all)
        _cta_barrier()  # both warpgroups are done with P and with this slot
        if i + STAGES < n_tiles:
            _issue_tile(k_lat_desc, k_pe_desc, k_lat, k_pe, bars, start + (i + STAGES) * BN, slot)
        if not ASYNC:
            if i + 1 < n_tiles:
                nxt = (i + 1) % STAGES
                mbarrier.wait(bars.index(nxt), ((i + 1) // STAGES) & 1)
                s_next = _scores(q_lat, q_pe, k_lat.index(nxt), k_pe.index(nxt), s_layout, BN)

    rows_o = pid_m * BM + gl.arange(0, BM, layout=row_o)
    cols = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, o_layout))
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    gl.store(o_ptr + ((split * R + rows_o) * D_LAT)[:, None] + cols[None, :], out.to(o_ptr.dtype.element_ty))
    rows_s = pid_m * BM + gl.arange(0, BM, layout=row_s)
    gl.store(lse_ptr + split * R + rows_s, m_i + gl.log2(l_i))


def _descriptors(q2, kv2, BN):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    return (desc(q2[:, :LAT], [ROWS, LAT]), desc(q2[:, LAT:], [ROWS, PE]),
            desc(kv2[:, :LAT], [BN, LAT]), desc(kv2[:, LAT:], [BN, PE]))


def gluon_partials(q2, kv2, splits, scale, BN=64, stages=2, asynchronous=False, partials=torch.float32):
    """The split kernel alone: q2 [R, 576] (R a multiple of 64), kv2 [L, 576] (L a multiple of BN x splits), bf16.
    Returns (o [splits, R, 512] in `partials`, lse [splits, R] fp32, log2 domain), the merge kernel's partials."""
    R, L = q2.shape[0], kv2.shape[0]
    if R % ROWS or L % (BN * splits):
        raise ValueError(f"gluon_partials: rows {R} must be a multiple of {ROWS}, length {L} of {BN} x {splits}")
    o = torch.empty(splits, R, LAT, dtype=partials, device=q2.device)
    lse = torch.empty(splits, R, dtype=torch.float32, device=q2.device)
    _split_kernel[(R // ROWS, splits)](*_descriptors(q2, kv2, BN), o, lse, R, L // splits, scale * 1.4426950408889634,
                                     BN=BN, STAGES=stages, ASYNC=asynchronous, num_warps=8)
    return o, lse


def gluon_attention(q2, kv2, splits, scale, **kw):
    """gluon_partials merged by the project's merge kernel: [R, 512] in q's dtype."""
    from triton_kernels.mla_attention import _merge_kernel, merge_blocks

    o, lse = gluon_partials(q2, kv2, splits, scale, **kw)
    R = q2.shape[0]
    out = torch.empty(R, LAT, dtype=q2.dtype, device=q2.device)
    block_s, block_d, warps = merge_blocks(splits)
    _merge_kernel[(R, LAT // block_d, 1)](o[None], lse[None], out, R, splits, BLOCK_S=block_s, BLOCK_D=block_d,
                                            num_warps=warps)
    return out


def compile_report(BN=64, stages=2, asynchronous=False):
    """Compile the split kernel for sm_90 on this machine (no GPU): shared memory, registers, spills."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from triton_kernels.aot import _ptxas_report

    q = torch.empty(ROWS, ENTRY, dtype=torch.bfloat16)
    kv = torch.empty(4 * BN, ENTRY, dtype=torch.bfloat16)

    def sig(t, block):
        return mangle_type(TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block,
                                                                                                       gl.bfloat16)))

    signature = dict(q_lat_desc=sig(q[:, :LAT], [ROWS, LAT]), q_pe_desc=sig(q[:, LAT:], [ROWS, PE]),
                     k_lat_desc=sig(kv[:, :LAT], [BN, LAT]), k_pe_desc=sig(kv[:, LAT:], [BN, PE]),
                     o_ptr="*fp32", lse_ptr="*fp32", R="i32", split_len="i32", scale_log2="fp32",
                     BN="constexpr", STAGES="constexpr", ASYNC="constexpr")
    src = GluonASTSource(_split_kernel, signature, constexprs={"BN": BN, "STAGES": stages, "ASYNC": asynchronous})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    registers, spills = _ptxas_report(compiled.asm["ptx"], 90)
    return dict(shared=compiled.metadata.shared, registers=registers, spill_bytes=spills)


def _time_us(fn, calls):
    """us per call of `calls` back-to-back calls (each its own cache copy) replayed in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(calls):
            fn(c)
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=60, return_mode="median")
    return ms * 1e3 / calls


def measure(L, H, T, splits, copies=6, seed=0):
    """One case: the Gluon split + merge and the Triton op at the same split count (all tree entries visible,
    so both compute full attention over L), outputs against a torch fp32 reference, cache cold in L2."""
    from triton_kernels.mla_attention import mla_attention

    gen = torch.Generator("cuda").manual_seed(seed)
    R = T * H
    scale = 1.0 / math.sqrt(192)
    q = torch.randn(1, T, H, ENTRY, generator=gen, device="cuda").to(torch.bfloat16)
    kvs = [torch.randn(1, L, ENTRY, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    lens = torch.full((1,), L, dtype=torch.int32, device="cuda")
    everything = torch.full((1, T, triton.cdiv(T, 32)), -1, dtype=torch.int32, device="cuda")
    q2 = q.view(R, ENTRY)
    ref = torch.softmax((q2.float() @ kvs[0][0].float().T) * scale, -1) @ kvs[0][0, :, :LAT].float()
    row = dict(L=L, H=H, T=T, splits=splits)
    runs = {name: (lambda c, kw=kw: gluon_attention(q2, kvs[c][0], splits, scale, **kw)) for name, kw in VARIANTS.items()}
    runs["triton"] = lambda c: mla_attention(q, kvs[c], lens, everything, scale, num_splits=splits)
    for name, run in runs.items():
        try:
            out = run(0).reshape(R, LAT).float()
            row[f"{name}_rel_err"] = float((out - ref).norm() / ref.norm())
            row[f"{name}_us"] = round(_time_us(run, copies), 2)
        except Exception as e:  # a variant that fails to build or launch is reported, the others still run
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


VARIANTS = {  # gluon_partials keywords by name
    "bn64_s2": dict(BN=64, stages=2), "bn64_s2_bf16": dict(BN=64, stages=2, partials=torch.bfloat16),
    "bn32_s3_bf16": dict(BN=32, stages=3, partials=torch.bfloat16),
    "bn32_s4_bf16": dict(BN=32, stages=4, partials=torch.bfloat16)}
CASES = [  # (L, H, T, splits): issue #6's 32k cases over 2x, and a compute-bound one
    (32768, 64, 1, 128), (32768, 8, 8, 128), (32768, 8, 32, 32), (32768, 64, 8, 16), (32768, 64, 128, 1),
    (131072, 64, 1, 128)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--compile", action="store_true", help="CPU: compile for sm_90 and report resources")
    args = parser.parse_args()
    if args.compile:
        for BN, stages, asynchronous in ((64, 2, False), (64, 2, True), (32, 3, False), (32, 4, False)):
            print(f"BN {BN} STAGES {stages} ASYNC {asynchronous}", compile_report(BN, stages, asynchronous), flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(0), triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    rows = []
    for L, H, T, splits in CASES:
        rows.append(measure(L, H, T, splits))
        print(json.dumps(rows[-1]), flush=True)
        (out / "gluon_mla.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
