"""Probe: the W4A16 GEMM's inner loop hand-laid in Gluon (sm_90), against the Triton MoE's gate/up kernel.

Issue #7: from 65 tokens on the MoE's gate/up is bound by instructions, not bytes (808 SASS instructions for 256
weights a thread; triton_kernels/README.md, MoE session 18). This probe asks how far a loop with no layout shuffles
gets. Each thread loads, straight into registers, the words whose nibbles are its own elements of the wgmma's A
operand (the weights, transposed: 64 rows of N a program): one int32 word a 16-wide k-step holds rows r and r + 8 at
k = 2c, 2c + 1, 2c + 8, 2c + 9 (c = lane % 4), nibble p and p + 4 the same row's two neighbours, so one lop3 makes
one bf16 pair of the operand's register. The tokens (the wgmma's N: BM of them) arrive by TMA; a group's product is
scaled into the fp32 accumulator by an FFMA while the next group's wgmma runs (as the Triton kernels' default does:
no rounding of q * scale).

The probe's GEMM: block b = expert b's BM token rows, out[b BM + t, n] = sum_k x[b BM + t, k] W_b[n, k], K split
over `splits` programs that add into out (fp32 atomics). The Triton side is `moe()` on routing that gives every
expert of the same count exactly BM tokens (its gate/up kernel's time, from the profiler).

    python bench/probe_gluon_moe.py --sass               # CPU: compile for sm_90, SASS opcodes of the K loop
    python bench/probe_gluon_moe.py --out DIR            # H200: correctness, then us against the Triton kernel
    python bench/probe_gluon_moe.py --out DIR --gather-ab  # H200: the activations by TMA against plain loads

H200 results: bench/results/moe_gluon_probe_h200_s20.json and moe_gluon_gather_ab_h200_s20.json, read in
triton_kernels/README.md (MoE, sessions 19-20).
"""

import argparse
import collections
import datetime
import json
import os
import subprocess
import tempfile

import torch
import triton
from bench_moe import _loop_opcodes, random_triton_layer, rel_err
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # Triton >= 3.7 / 3.6
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6 / newer

ROWS, SLAB, GROUP = 64, 256, 32  # weight rows a program (the wgmma's M), K a loop trip, K a scale group
OFFSET = gl.constexpr(136.0)  # 128 + 8: q = u - 8
_ROWS, _SLAB, _GROUP = gl.constexpr(ROWS), gl.constexpr(SLAB), gl.constexpr(GROUP)

# A slab's words [32 rr, 4 kl, 4 c, 4 sl]: thread 4 rr + kl (warp rr // 8) holds k-step s = 4 c + sl's word in
# register s; sl innermost in memory, so a thread's 4 words of a 64-wide chunk are one 16-byte load.
WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0]],
    lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
    warp_bases=[[8, 0, 0, 0], [16, 0, 0, 0]], block_bases=[], shape=[32, 4, 4, 4]))
# A slab's scales [32 rr, 2 b1, 8 g] (bf16): rows 16 (rr // 8) + 8 b1 + rr % 8, the 4 lanes of a row share them.
SCALES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0]],
    lane_bases=[[0, 0, 0], [0, 0, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[8, 0, 0], [16, 0, 0]], block_bases=[], shape=[32, 2, 8]))


@gluon.jit
def _offsets(layout: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr, D3: gl.constexpr,
             s0, s1, s2, s3):
    """Offsets [D0, D1, D2, D3] in `layout`: sum of index_i * s_i (D3 of 1 makes it 3-D-like)."""
    l3: gl.constexpr = gl.SliceLayout(3, layout)
    l2: gl.constexpr = gl.SliceLayout(2, l3)
    i0 = gl.arange(0, D0, layout=gl.SliceLayout(1, l2))
    i1 = gl.arange(0, D1, layout=gl.SliceLayout(0, l2))
    i2 = gl.arange(0, D2, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    i3 = gl.arange(0, D3, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
    o01 = (i0 * s0)[:, None] + (i1 * s1)[None, :]
    o2 = (i2 * s2)[None, None, :]
    return (o01[:, :, None] + o2)[:, :, :, None] + (i3 * s3)[None, None, None, :]


@gluon.jit
def _scale_offsets():
    """Offsets [32, 2, 8] of a slab's scales in SCALES (rr * 16 + b1 * 8 + g)."""
    l2: gl.constexpr = gl.SliceLayout(2, SCALES)
    i0 = gl.arange(0, 32, layout=gl.SliceLayout(1, l2))
    i1 = gl.arange(0, 2, layout=gl.SliceLayout(0, l2))
    i2 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, SCALES)))
    return ((i0 * 16)[:, None] + (i1 * 8)[None, :])[:, :, None] + i2[None, None, :]


@gluon.jit
def _pick(t, g: gl.constexpr):
    """t [..., 2, 2, 2] -> t[..., g // 4, (g // 2) % 2, g % 2] (register selections only)."""
    lo, hi = gl.split(t)
    t = hi if g % 2 else lo
    lo, hi = gl.split(t)
    t = hi if (g // 2) % 2 else lo
    lo, hi = gl.split(t)
    return hi if g // 4 else lo


@gluon.jit
def _nibble_pairs(x):
    """int32 words [...] -> bf16 [..., 2]: 128 + the nibbles at bits 0 and 16, one lop3 (x & 0x000F000F) |
    0x43004300 into the packed pair (ptxas takes one immediate an instruction; the pair's two halves are the two
    elements of one inline-asm call, so the 32-bit result is the register the MMA reads)."""
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, 1124090624, 0xEA;", "=r,r,r", [gl.join(x, x)],
                                     dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit
def _group_operand(words, g: gl.constexpr, a_layout: gl.constexpr):
    """Group g's weights [64, 32] bf16 (q = u - 8, unscaled) in the wgmma's A layout, from a slab's words."""
    w = gl.reshape(words, [32, 4, 2, 2, 2, 2])  # rr, kl, c1, c0, slh, sp: k-step 4 c + 2 slh + sp, g = 2 c + slh
    w = _pick(gl.permute(w, (0, 1, 5, 2, 3, 4)), g)  # [32 rr, 4 kl, 2 sp]
    w = gl.permute(w, (0, 2, 1))  # [32, 2 sp, 4 kl]
    p01 = gl.join(_nibble_pairs(w), _nibble_pairs(w >> 4))  # [.., 2 j, 2 b1]: nibble pairs 0 and 1
    p23 = gl.join(_nibble_pairs(w >> 8), _nibble_pairs(w >> 12))
    v = gl.join(p01, p23) - OFFSET  # [32, 2 sp, 4 kl, 2 j, 2 b1, 2 b2]
    v = gl.reshape(v, [4, 8, 2, 4, 2, 2, 2])  # rw, r8, sp, kl, j, b1, b2
    v = gl.reshape(gl.permute(v, (0, 5, 1, 2, 6, 3, 4)), [64, 32])  # row 16 rw + 8 b1 + r8, k 16 sp + 8 b2 + 2 kl + j
    return gl.convert_layout(v, a_layout, assert_trivial=True)


@gluon.jit
def _group_scale(scales, g: gl.constexpr, row_layout: gl.constexpr, dtype: gl.constexpr):
    """Group g's scales [64] in `row_layout` as `dtype`, from a slab's [32, 2, 8] (bf16)."""
    s = _pick(gl.reshape(scales, [32, 2, 2, 2, 2]), g)  # [32 rr, 2 b1]
    s = gl.reshape(gl.permute(gl.reshape(s, [4, 8, 2]), (0, 2, 1)), [64])
    return gl.convert_layout(s.to(dtype), row_layout, assert_trivial=True)


@gluon.jit
def _slab_product(acc, words, scales, x_smem, slot, a_layout: gl.constexpr, PRESCALE: gl.constexpr):
    """acc [64, BM] += one slab's dequantised weights [64, 256] @ the slot's activations [256, BM]. PRESCALE: the
    weights times their scale in bf16 (one rounding, as a bf16 weight has), the 8 groups' MMAs chained through acc;
    else each group's product scaled into acc by an FFMA while the next group's MMA runs."""
    mma: gl.constexpr = acc.type.layout
    if PRESCALE:
        a_prev = _group_operand(words, 0, a_layout) * _group_scale(scales, 0, gl.SliceLayout(1, a_layout),
                                                                   gl.bfloat16)[:, None]
        acc = warpgroup_mma(a_prev, _x_group(x_smem, slot, 0), acc, is_async=True)
        for g in gl.static_range(1, 8):
            a_g = _group_operand(words, g, a_layout) * _group_scale(scales, g, gl.SliceLayout(1, a_layout),
                                                                    gl.bfloat16)[:, None]
            acc = warpgroup_mma(a_g, _x_group(x_smem, slot, g), acc, is_async=True)
            acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
            a_prev = a_g
        acc, a_prev = warpgroup_mma_wait(0, deps=[acc, a_prev])
    else:
        zero = gl.zeros(acc.shape, gl.float32, mma)
        a = _group_operand(words, 0, a_layout)
        prev = warpgroup_mma(a, _x_group(x_smem, slot, 0), zero, use_acc=False, is_async=True)
        for g in gl.static_range(1, 8):
            a_g = _group_operand(words, g, a_layout)
            cur = warpgroup_mma(a_g, _x_group(x_smem, slot, g), zero, use_acc=False, is_async=True)
            done, a = warpgroup_mma_wait(1, deps=[prev, a])
            acc = acc + done * _group_scale(scales, g - 1, gl.SliceLayout(1, mma), gl.float32)[:, None]
            prev, a = cur, a_g
        done, a = warpgroup_mma_wait(0, deps=[prev, a])
        acc = acc + done * _group_scale(scales, 7, gl.SliceLayout(1, mma), gl.float32)[:, None]
    return acc


@gluon.jit
def _issue_x(x_desc, x_smem, bars, row, slab, slot, BM: gl.constexpr):
    """TMA of the block's activations for one slab, [BM, 256] as 4 [BM, 64] tiles, into ring slot `slot`."""
    bar = bars.index(slot)
    mbarrier.expect(bar, 4 * x_desc.block_type.nbytes)
    for c in gl.static_range(4):
        _tma_load(x_desc, [row, slab * _SLAB + c * 64], bar, x_smem.index(slot * 4 + c))


@gluon.jit
def _x_group(x_smem, slot, g: gl.constexpr):
    """Group g's activations of ring slot `slot` as the wgmma's B operand [32, BM]."""
    return x_smem.index(slot * 4 + g // 2).slice((g % 2) * _GROUP, _GROUP, dim=1).permute((1, 0))


@gluon.jit
def _load_slab(w_tile, s_tile, w_offs, s_offs, w_step, s_step, slab, TILES: gl.constexpr):
    """A slab's words and scales of the first tile and (TILES 2) the next one (else the first's again)."""
    words0 = gl.load(w_tile + slab * 2048 + w_offs)
    scales0 = gl.load(s_tile + slab * 512 + s_offs)
    words1, scales1 = words0, scales0
    if TILES == 2:
        words1 = gl.load(w_tile + w_step + slab * 2048 + w_offs)
        scales1 = gl.load(s_tile + s_step + slab * 512 + s_offs)
    return words0, scales0, words1, scales1


@gluon.jit
def _gather_x(x_rows, slab, x_layout: gl.constexpr):
    """A slab's activations [BM, 256] by plain loads, as 4 chunks [BM, 64] (the Gluon MoE's gathered rows)."""
    ptrs = x_rows[:, None] + (slab * _SLAB + gl.arange(0, 64, layout=gl.SliceLayout(0, x_layout)))[None, :]
    return gl.load(ptrs), gl.load(ptrs + 64), gl.load(ptrs + 128), gl.load(ptrs + 192)


@gluon.jit
def _w4_gemm_kernel(x_desc, x_ptr, w_ptr, s_ptr, out_ptr, N, n_slabs, slabs_per_split,
                    BM: gl.constexpr, STAGES: gl.constexpr, TILES: gl.constexpr, PRESCALE: gl.constexpr,
                    GATHER: gl.constexpr):
    """out[b BM + t, n] += sum over split pid 2's slabs of x[b BM + t, k] (q[b, n, k]) scale[b, n, k // 32], for
    rows n of the TILES 64-row tiles from TILES pid 1 on and block pid 0 (TILES 2: two accumulators share each
    slab of activations, as gate and up do). Words [E, N/64, K/64, 128, 4] int32, scales [E, N/64, K/256, 32, 2,
    8] bf16 (`fragment_layout`)."""
    pid_b, pid_t, pid_k = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    first = pid_k * slabs_per_split
    end = gl.minimum(first + slabs_per_split, n_slabs)
    tile = pid_b * (N // _ROWS) + pid_t * TILES
    w_tile = w_ptr + tile.to(gl.int64) * n_slabs * 2048  # 2048 words a slab
    s_tile = s_ptr + tile.to(gl.int64) * n_slabs * 512
    w_offs = _offsets(WORDS, 32, 4, 4, 4, 16, 4, 512, 1)
    s_offs = _scale_offsets()
    w_step = n_slabs * 2048  # the next tile's
    s_step = n_slabs * 512

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 4, BM, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    if GATHER:  # the activations by plain loads one slab ahead, through ring slot 0 (as a gathered MoE block's)
        x_layout: gl.constexpr = gl.BlockedLayout([1, BM // 2], [BM // 4, 128 // BM], [4, 1], [1, 0])
        rows = pid_b * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, x_layout))
        x_rows = x_ptr + rows.to(gl.int64) * (n_slabs * _SLAB)
        x_next = _gather_x(x_rows, first, x_layout)
    else:
        for st in gl.static_range(STAGES - 1):
            if first + st < end:
                _issue_x(x_desc, x_smem, bars, pid_b * BM, first + st, st, BM)

    acc0 = gl.zeros([_ROWS, BM], gl.float32, mma)
    acc1 = gl.zeros([_ROWS, BM], gl.float32, mma)
    words0, scales0, words1, scales1 = _load_slab(w_tile, s_tile, w_offs, s_offs, w_step, s_step, first, TILES)
    for slab in range(first, end):
        i = slab - first
        nxt = gl.minimum(slab + 1, end - 1)  # the next slab's words and scales, in flight during this one
        words0_next, scales0_next, words1_next, scales1_next = _load_slab(w_tile, s_tile, w_offs, s_offs, w_step,
                                                                          s_step, nxt, TILES)
        _cta_barrier()  # every warp's MMAs on the slot refilled below are done (each waited for its own)
        if GATHER:
            for c in gl.static_range(4):
                x_smem.index(c).store(x_next[c])
            fence_async_shared()
            _cta_barrier()
            x_next = _gather_x(x_rows, nxt, x_layout)
            slot = 0
        else:
            if slab + STAGES - 1 < end:
                _issue_x(x_desc, x_smem, bars, pid_b * BM, slab + STAGES - 1, (i + STAGES - 1) % STAGES, BM)
            slot = i % STAGES
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        acc0 = _slab_product(acc0, words0, scales0, x_smem, slot, a_layout, PRESCALE)
        if TILES == 2:
            acc1 = _slab_product(acc1, words1, scales1, x_smem, slot, a_layout, PRESCALE)
        words0, scales0, words1, scales1 = words0_next, scales0_next, words1_next, scales1_next

    n = pid_t * TILES * _ROWS + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, mma))
    t = pid_b * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    gl.atomic_add(out_ptr + t.to(gl.int64)[None, :] * N + n[:, None], acc0, sem="relaxed")
    if TILES == 2:
        gl.atomic_add(out_ptr + t.to(gl.int64)[None, :] * N + n[:, None] + _ROWS, acc1, sem="relaxed")


# ----------------------------------------------------------------------------------------------- host side


def fragment_layout(u, scale):
    """u [E, N, K] uint8 nibbles (q + 8), scale [E, N, K // 32] bf16 -> (words [E, N/64, K/64, 128, 4] int32,
    scales [E, N/64, K/256, 32, 2, 8] bf16) as `_w4_gemm_kernel` reads them."""
    E, N, K = u.shape
    tau = torch.arange(128, device=u.device)
    w, lane = tau // 32, tau % 32
    p = torch.arange(8, device=u.device)
    row = 16 * w[:, None] + lane[:, None] // 4 + 8 * (p[None, :] % 4 % 2)  # [128, 8]
    kk = 2 * (lane[:, None] % 4) + 8 * (p[None, :] % 4 // 2) + p[None, :] // 4
    steps = torch.arange(K // 16, device=u.device)
    words = torch.empty(E, N // ROWS, K // 64, 128, 4, dtype=torch.int32, device=u.device)
    for e in range(E):  # one expert at a time: the int64 nibbles take 8 bytes a weight
        tiles = u[e].view(N // ROWS, ROWS, K)
        nib = tiles[:, row[None, :, :].expand(K // 16, -1, -1), 16 * steps[:, None, None] + kk[None]]  # [T,S,128,8]
        word = (nib.to(torch.int64) << (4 * p)).sum(-1)
        word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # [T, K/16, 128]
        words[e] = word.view(N // ROWS, K // 64, 4, 128).permute(0, 1, 3, 2)
    s = scale.view(E, N // ROWS, 4, 2, 8, K // SLAB, 8)  # n = 16 rw + 8 b1 + r8; k group = 8 slab + g
    scales = s.permute(0, 1, 5, 2, 4, 3, 6).reshape(E, N // ROWS, K // SLAB, 32, 2, 8).contiguous()
    return words, scales


def reference(x, u, scale, BM):
    """fp32 out [E BM, N] of the probe's GEMM."""
    E, N, K = u.shape
    w = (u.float() - 8) * scale.float().repeat_interleave(GROUP, -1)  # [E, N, K]
    return torch.einsum("ebk,enk->ebn", x.float().view(E, BM, K), w).reshape(E * BM, N)


def launch(x, words, scales, out, BM, splits, stages=3, tiles=2, prescale=False, gather=False):
    """out [E BM, N] fp32 (zeroed) += the probe's GEMM of x [E BM, K] bf16 (gather: x by plain loads, not TMA)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, T, n_chunks = words.shape[:3]
    n_slabs = n_chunks // 4
    per = triton.cdiv(n_slabs, splits)
    layout = gl.NVMMASharedLayout.get_default_for([BM, 64], gl.bfloat16)
    x_desc = TensorDescriptor.from_tensor(x, [BM, 64], layout)
    _w4_gemm_kernel[(E, T // tiles, triton.cdiv(n_slabs, per))](x_desc, x, words, scales, out, T * ROWS, n_slabs,
                                                                per, BM=BM, STAGES=stages, TILES=tiles,
                                                                PRESCALE=prescale, GATHER=gather, num_warps=4)


def compile_sass(BM=16, stages=3, tiles=2, prescale=False, gather=False):
    """Compile for sm_90 on this machine: (SASS text, registers, spill bytes, shared bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from triton_kernels.aot import _ptxas_report

    x = torch.empty(4 * BM, 7168, dtype=torch.bfloat16)
    desc = TensorDescriptor.from_tensor(x, [BM, 64], gl.NVMMASharedLayout.get_default_for([BM, 64], gl.bfloat16))
    signature = dict(x_desc=mangle_type(desc), x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", out_ptr="*fp32", N="i32",
                     n_slabs="i32", slabs_per_split="i32", BM="constexpr", STAGES="constexpr", TILES="constexpr",
                     PRESCALE="constexpr", GATHER="constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i in (1, 2, 3, 4)}
    src = GluonASTSource(_w4_gemm_kernel, signature, attrs=attrs,
                         constexprs=dict(BM=BM, STAGES=stages, TILES=tiles, PRESCALE=prescale, GATHER=gather))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    registers, spills = _ptxas_report(compiled.asm["ptx"], 90)
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    return sass, registers, spills, compiled.metadata.shared


def sass_report(BM, tiles=2, prescale=False):
    sass, registers, spills, shared = compile_sass(BM, tiles=tiles, prescale=prescale)
    ops = collections.Counter(_loop_opcodes(sass))
    weights = tiles * ROWS * SLAB / 128  # a thread's weights a trip
    return dict(BM=BM, tiles=tiles, prescale=prescale, registers=registers, spill_bytes=spills, shared=shared, instructions=sum(ops.values()),
                per_256_weights=round(sum(ops.values()) * 256 / weights, 1),
                opcodes=dict(sorted(ops.items(), key=lambda kv: -kv[1])))


# ----------------------------------------------------------------------------------------------- GPU


def equal_routing(E_used, BM, top_k=8):
    """topk ids [M, top_k] that give experts 0 .. E_used - 1 exactly BM tokens each (M = E_used BM / top_k)."""
    M = E_used * BM // top_k
    t = torch.arange(M)[:, None]
    j = torch.arange(top_k)[None, :]
    step = next(s for s in range(E_used // top_k, E_used) if len({(s * i) % E_used for i in range(top_k)}) == top_k)
    return ((t + step * j) % E_used).int()


def profile_us(fn, calls=8):
    """Device us per call of each kernel fn launches (torch.profiler), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key[:40]: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}


VARIANTS = [(tiles, prescale) for tiles in (1, 2) for prescale in (False, True)]
# (name, experts, N, K, BM, K splits tried): the Triton MoE's gate/up and down at the verify's 65 and 129 tokens
# (every expert BM tokens: 143 blocks, the step's count at 129 tokens) and at one token (8 experts, the decode path)
CASES = [("gate_up", 143, 512, 7168, 8, (1, 2, 4)), ("down", 143, 7168, 256, 8, (1,)),
         ("gate_up", 143, 512, 7168, 16, (1, 2, 4)), ("down", 143, 7168, 256, 16, (1,)),
         ("gate_up", 8, 512, 7168, 8, (4, 7, 14, 28)), ("down", 8, 7168, 256, 8, (1,))]


def _recorder():
    """(rows, record): record(row) appends the row and prints it as a JSON line."""
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    return rows, record


def _write(out_dir, name, rows):
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


def _random_experts(gen, E, N, K):
    """Random nibbles (q + 8) [E, N, K] uint8 and group scales [E, N, K / 32] bf16 on the GPU."""
    u = torch.randint(0, 16, (E, N, K), generator=gen, device="cuda", dtype=torch.uint8)
    return u, (torch.rand(E, N, K // GROUP, generator=gen, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)


def check(gen, BM, N, K, record):
    """Every variant against the fp32 reference on 3 experts, with 1 and 3 K splits."""
    E = 3
    u, sc = _random_experts(gen, E, N, K)
    x = torch.randn(E * BM, K, generator=gen, device="cuda").to(torch.bfloat16)
    words, scales = fragment_layout(u, sc)
    ref = reference(x, u, sc, BM)
    for tiles, prescale in VARIANTS:
        for splits in (1, 3):
            out = torch.zeros(E * BM, N, device="cuda")
            launch(x, words, scales, out, BM, splits, tiles=tiles, prescale=prescale)
            record(dict(check=True, BM=BM, N=N, K=K, tiles=tiles, prescale=prescale, splits=splits,
                        rel_err=rel_err(out, ref)))


def triton_times(gen, E_used, BM, K, N, variant=None):
    """us of the Triton MoE's kernels (profiler) where E_used experts get BM tokens each (BM 8 and 16: the entries
    for 65 and 129+ tokens), or for one token on 8 experts (E_used 8: the decode path)."""
    from triton_kernels.moe_configs import config_for
    from triton_kernels.moe_w4a16 import moe

    layer = random_triton_layer(384, K, N // 2, gen)
    ids = (torch.arange(8)[None, :].int() if E_used == 8 else equal_routing(E_used, BM)).cuda()
    M = ids.shape[0]
    xm = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    wts = torch.rand(M, 8, generator=gen, device="cuda")
    cfg = config_for(torch.device("cuda"), 1 if E_used == 8 else 286 if BM == 16 else 65)
    if variant:  # a moe_configs.VARIANTS entry on top (the Gluon gate/up: `gluon`, ...)
        from triton_kernels.moe_configs import with_variant

        cfg = with_variant(cfg, variant)
    return M, cfg["BM"], profile_us(lambda: moe(xm, ids, wts, layer, config=cfg))


def gpu_run(out_dir):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, record = _recorder()

    for BM in (8, 16):
        check(gen, BM, 512, 7168, record)
        check(gen, BM, 256, 256, record)
    for name, E, N, K, BM, split_list in CASES:
        u, sc = _random_experts(gen, E, N, K)
        words, scales = fragment_layout(u, sc)
        del u
        x = torch.randn(E * BM, K, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.zeros(E * BM, N, device="cuda")
        weight_mb = words.numel() * 4 / 1e6 + scales.numel() * 2 / 1e6
        for tiles, prescale in VARIANTS:
            for splits in split_list:
                for stages in (2, 3):
                    us = profile_us(lambda: launch(x, words, scales, out, BM, splits, stages, tiles, prescale))
                    k_us = sum(v for k, v in us.items() if "w4_gemm" in k)
                    record(dict(case=name, kernel="gluon", E=E, BM=BM, tiles=tiles, prescale=prescale, splits=splits,
                                stages=stages, us=round(k_us, 1), GBps=round(weight_mb / k_us * 1e3, 1)))
        if name == "gate_up":  # the Triton MoE on the same routing: its gate/up and down
            M, tBM, us = triton_times(gen, E, BM, K, N)
            record(dict(case="triton", E=E, BM=tBM, M=M, us={k: round(v, 1) for k, v in us.items()},
                        gate_up_MB=round(weight_mb, 1)))
    _write(out_dir, "gluon_moe_probe.json", rows)


def gather_ab(out_dir):
    """The probe's activations by TMA against plain loads through shared memory (the MoE's gathered rows), and
    the MoE on the same uniform routing: its Triton default and, where moe_configs has them (the session-20 patch,
    bench/results/wip_s20_gluon_gate_up.patch), the Gluon gate/up variants."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, record = _recorder()

    for BM in (8, 16):
        E, N, K = 3, 512, 7168
        u, sc = _random_experts(gen, E, N, K)
        x = torch.randn(E * BM, K, generator=gen, device="cuda").to(torch.bfloat16)
        words, scales = fragment_layout(u, sc)
        ref = reference(x, u, sc, BM)
        out = torch.zeros(E * BM, N, device="cuda")
        launch(x, words, scales, out, BM, 3, tiles=2, prescale=False, gather=True)
        record(dict(check=True, gather=True, BM=BM, rel_err=rel_err(out, ref)))
    for BM in (8, 16):
        E, N, K = 143, 512, 7168
        u, sc = _random_experts(gen, E, N, K)
        words, scales = fragment_layout(u, sc)
        del u
        x = torch.randn(E * BM, K, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.zeros(E * BM, N, device="cuda")
        for prescale in (False, True):
            for splits in (1, 2):
                for gather in (False, True):
                    us = profile_us(lambda: launch(x, words, scales, out, BM, splits, 2, 2, prescale, gather))
                    record(dict(case="gate_up", kernel="probe", BM=BM, prescale=prescale, splits=splits,
                                x="gather" if gather else "tma",
                                us=round(sum(v for k, v in us.items() if "w4_gemm" in k), 1)))
        from triton_kernels.moe_configs import VARIANTS

        for variant in [None] + [v for v in ("gluon", "gluon_pre", "gluon_pre_r128") if v in VARIANTS]:
            M, tBM, us = triton_times(gen, E, BM, K, N, variant)
            record(dict(case="moe", variant=variant or "default", BM=tBM, M=M,
                        us={k: round(v, 1) for k, v in us.items()}))
    _write(out_dir, "gluon_moe_gather_ab.json", rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sass", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--gather-ab", action="store_true", help="with --out: gather_ab only")
    args = parser.parse_args()
    if args.sass:
        for BM in (8, 16):
            for tiles in (1, 2):
                for prescale in (False, True):
                    r = sass_report(BM, tiles, prescale)
                    print(json.dumps({k: v for k, v in r.items() if k != "opcodes"}))
                    print("  ", json.dumps(r["opcodes"]))
    else:
        os.makedirs(args.out, exist_ok=True)
        (gather_ab if args.gather_ab else gpu_run)(args.out)


if __name__ == "__main__":
    main()
