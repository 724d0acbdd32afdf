"""MLA's absorbed projections as Triton kernels (`ops.absorb`): per-head skinny GEMMs that cuBLAS runs as batched
GEMMs of a few rows, with the query's RoPE, the [latent ; rope] concatenation and the new tokens' cache entries
folded into the query kernel and the head-major output written in place."""

import math

import torch
import triton
import triton.language as tl

from triton_kernels import arch, pdl
from triton_kernels.glue import rope_pairs, write_latent_rows


@triton.jit
def _absorb_query_kernel(qn_ptr, qp_ptr, w_ptr, pos_ptr, freq_ptr, out_ptr, N, H, stride_qn, stride_qnh,
                         stride_qp, stride_qph, stride_wh, stride_wd, factor,
                         ckv_ptr, lw_ptr, starts_ptr, kv_ptr, T, stride_ckv, stride_kb, eps,
                         DN: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_C: tl.constexpr, WRITE: tl.constexpr = False, LATENT: tl.constexpr = 1,
                         PDL: tl.constexpr = False):
    """Grid (heads, R / BLOCK_C latent columns, N / BLOCK_N tokens). WRITE: program (0, 0, n) also writes the cache
    entries of its tokens (`glue.write_latent_rows`, latent width LATENT), with the same positions and rope."""
    pdl.enter(PDL)
    h, pid_c, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < N)[:, None]
    rows = offs_n[:, None].to(tl.int64)
    offs_d = tl.arange(0, DN)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    q = tl.load(qn_ptr + rows * stride_qn + h * stride_qnh + offs_d[None, :], mask=n_ok, other=0.0)  # [BN, DN]
    w = tl.load(w_ptr + h * stride_wh + offs_d[:, None] * stride_wd + offs_c[None, :])  # [DN, BC]
    out_row = out_ptr + rows * H * (R + 2 * HALF) + h * (R + 2 * HALF)  # [BN, 1]
    ty = out_ptr.dtype.element_ty
    tl.store(out_row + offs_c[None, :], tl.dot(q, w).to(ty), mask=n_ok)
    if pid_c == 0:  # the rope part of the same rows: interleaved pairs turned by position * inv_freq
        offs_i = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + offs_n, mask=offs_n < N, other=0).to(tl.float32)
        angle = pos[:, None] * tl.load(freq_ptr + offs_i)[None, :]  # [BN, HALF]
        rope_pairs(qp_ptr + rows * stride_qp + h * stride_qph + 2 * offs_i[None, :], out_row + R + 2 * offs_i[None, :],
                   angle, factor, n_ok, ty)
        if WRITE:
            if h == 0:
                write_latent_rows(ckv_ptr, lw_ptr, pos_ptr, freq_ptr, starts_ptr, kv_ptr, offs_n, offs_n < N, T,
                                  stride_ckv, stride_kb, eps, factor, LATENT, HALF)


@triton.jit
def _absorb_output_kernel(o_ptr, w_ptr, out_ptr, N, H, stride_on, stride_oh, stride_wh, stride_wd,
                          R: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    h, pid_d, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < N)[:, None]
    rows = offs_n[:, None].to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    o_rows = o_ptr + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_on + h * stride_oh  # clamped, not
    for k in range(0, R, BLOCK_K):  # masked, so the loads pipeline (rows past N feed outputs never stored)
        o = tl.load(o_rows + k + offs_k[None, :])  # [BN, BK]
        w = tl.load(w_ptr + h * stride_wh + offs_d[None, :] * stride_wd + k + offs_k[:, None])  # [BK, BD]
        acc = tl.dot(o, w, acc)
    tl.store(out_ptr + rows * H * DV + h * DV + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# Per arch: tokens a program of the query kernel (16: 2.2x faster than 64 at 33 and at 129 rows), and the output
# kernel's (max rows, BLOCK_D, BLOCK_K, stages), the first row whose max covers N (None: any): value columns a
# program, latent values a loop step (bench/results/glue_h200_s12_absorb_output.md). sm_120: sm_90's, untimed.
QUERY_BLOCK_N = {"sm_90": 16, "sm_120": 16}
OUTPUT_TILES = {"sm_90": ((65, 16, 512, 1), (None, 32, 512, 1)), "sm_120": ((65, 16, 512, 1), (None, 32, 512, 1))}


def _block_n(N):
    return 16 if N <= 16 else 64


def absorb_query(q_nope, q_pe, w_uk, positions, inv_freq, attention_factor, write=None):
    """See `ops.absorb.absorb_query`. q_nope [N, H, dn], q_pe [N, H, dr] (last dims contiguous); w_uk [H, dn, R]
    (last dim contiguous). dn, R/64 and dr/2 must be powers of two (128, 512, 32 for K2.6). write: an
    `ops.absorb.LatentWrite`, whose entries the same launch writes (its latent width a power of two)."""
    N, H, dn = q_nope.shape
    R, half = w_uk.shape[2], q_pe.shape[2] // 2
    if q_nope.stride(2) != 1 or q_pe.stride(2) != 1 or w_uk.stride(2) != 1 or R % 64:
        raise ValueError("absorb_query (triton): last dims must be contiguous and R a multiple of 64")
    out = torch.empty(N, H, R + 2 * half, dtype=q_nope.dtype, device=q_nope.device)
    if N:
        block_n = QUERY_BLOCK_N[arch.current(q_nope.device)]
        _absorb_query_kernel[(H, R // 64, triton.cdiv(N, block_n))](
            q_nope, q_pe, w_uk, positions, inv_freq.float().contiguous(), out, N, H, q_nope.stride(0),
            q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), w_uk.stride(0), w_uk.stride(1),
            float(attention_factor), *_write_args(write, N, q_nope), DN=dn, R=R, HALF=half, BLOCK_N=block_n,
            BLOCK_C=64, WRITE=write is not None, LATENT=1 if write is None else write.norm_weight.shape[0],
            **pdl.options(q_nope))
    return out


def _write_args(write, N, placeholder):
    """The query kernel's (ckv, norm weight, starts, cache, T, ckv row stride, cache sequence stride, eps) for a
    LatentWrite (placeholders without one)."""
    if write is None:
        return placeholder, placeholder, placeholder, placeholder, 1, 0, 0, 0.0
    latent = write.norm_weight.shape[0]
    cache, ckv = write.kv_cache, write.ckv if write.ckv.stride(1) == 1 else write.ckv.contiguous()
    if latent & (latent - 1) or cache.stride(2) != 1 or cache.stride(1) != cache.shape[2]:
        raise ValueError(f"absorb_query (triton): the latent width {latent} must be a power of two and each cache "
                         f"row contiguous [L_max, {cache.shape[2]}]")
    return (ckv, write.norm_weight, write.starts, cache, N // write.starts.shape[0], ckv.stride(0), cache.stride(0),
            float(write.eps))


def absorb_output(o_lat, w_uv):
    """See `ops.absorb.absorb_output`. o_lat [N, H, R] and w_uv [H, dv, R] with contiguous last dims; R a multiple
    of 128 and dv of 32."""
    N, H, R = o_lat.shape
    dv = w_uv.shape[1]
    if o_lat.stride(2) != 1 or w_uv.stride(2) != 1 or R % 128 or dv % 32:
        raise ValueError("absorb_output (triton): last dims must be contiguous, R a multiple of 128, dv of 32")
    out = torch.empty(N, H * dv, dtype=o_lat.dtype, device=o_lat.device)
    if N:
        tiles = OUTPUT_TILES[arch.current(o_lat.device)]
        tile_d, tile_k, stages = next(t[1:] for t in tiles if t[0] is None or N <= t[0])
        block_d, block_k = math.gcd(tile_d, dv), math.gcd(tile_k, R)  # powers of two that divide dv and R
        block_n = _block_n(N)
        _absorb_output_kernel[(H, dv // block_d, triton.cdiv(N, block_n))](
            o_lat, w_uv, out, N, H, o_lat.stride(0), o_lat.stride(1), w_uv.stride(0), w_uv.stride(1),
            R=R, DV=dv, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_K=block_k, num_stages=stages,
            **pdl.options(o_lat))
    return out
