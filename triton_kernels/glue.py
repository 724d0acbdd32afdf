"""Row-wise kernels of the layer glue, one launch each: RMSNorm (alone or fused with the residual add), interleaved
RoPE, the latent cache write (norm + rope + store) and SwiGLU's silu(gate) * up.

The torch references (`ops.norm.rms_norm_torch`, `ops.rope.apply_rope_torch`) launch 8-15 small kernels per
call; a K2.6 layer ran four norms and two ropes, so under a CUDA graph those launches, not the bytes, set the
time of everything but the GEMMs. Both kernels compute in fp32 like the references; tl.cos/tl.sin lower to
libdevice's __nv_cosf/__nv_sinf (full range reduction), the functions torch's CUDA cos/sin call.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triton_kernels import arch, linear, pdl


@triton.jit
def rotate(first, second, angle, factor):
    """One RoPE turn of fp32 pairs (first, second) by `angle`: factor * (f cos - s sin, s cos + f sin)."""
    cos, sin = tl.cos(angle) * factor, tl.sin(angle) * factor
    return first * cos - second * sin, second * cos + first * sin


@triton.jit
def rope_pairs(src, dst, angle, factor, mask, ty):
    """Turn the interleaved pairs whose even elements src points at (any shape) by `angle` (broadcast to it) and
    store them, cast to `ty`, at dst (`rotate`, in fp32)."""
    even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    even, odd = rotate(even, odd, angle, factor)
    tl.store(dst, even.to(ty), mask=mask)
    tl.store(dst + 1, odd.to(ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, D, eps, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_D]
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    tl.store(out_ptr + row * stride_out + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x, weight, eps):
    """RMSNorm over the last dim in fp32. x: [..., D] (last dim contiguous, rows may be strided, e.g. a column
    slice); weight: [D]. Returns a contiguous [..., D] in x's dtype."""
    D = x.shape[-1]
    rows = x.reshape(-1, D)  # a view for slices like ckv[:, :512]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(D)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), D, D, eps, BLOCK_D=block,
                                           num_warps=8 if block >= 4096 else 4, **pdl.options(x))
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, e_ptr, w_ptr, h_ptr, out_ptr, D, eps, BLOCK_D: tl.constexpr,
                         EXTRA: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    ty = h_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + offs, mask=ok, other=0.0).to(ty).to(tl.float32)  # an fp32 x rounded first
    if EXTRA:  # x + extra first, rounded as torch's add
        x = (x + tl.load(e_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
    h = (x + tl.load(r_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)).to(ty)  # rounded as torch's add
    tl.store(h_ptr + row * D + offs, h, mask=ok)
    h = h.to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / D + eps)
    tl.store(out_ptr + row * D + offs, (h * rstd * w).to(ty), mask=ok)


def add_rms_norm(x, residual, weight, eps, extra=None):
    """See `ops.norm.add_rms_norm`. x, residual (, extra): [M, D]; weight: [D]. Returns ((x (+ extra)) + residual,
    its norm)."""
    x, residual = x.contiguous(), residual.contiguous()
    extra = x if extra is None else extra.contiguous()  # x: a placeholder the kernel does not read
    h, out = torch.empty_like(residual), torch.empty_like(residual)
    D = x.shape[-1]
    if x.numel():
        block = triton.next_power_of_2(D)
        _add_rms_norm_kernel[(x.numel() // D,)](x, residual, extra, weight, h, out, D, eps, BLOCK_D=block,
                                                 EXTRA=extra is not x, num_warps=8 if block >= 4096 else 4,
                                                 **pdl.options(residual))
    return h, out


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, stride_xn, stride_xh, H, factor,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, HALF)
    angle = tl.load(pos_ptr + n).to(tl.float32) * tl.load(freq_ptr + offs_i)  # [HALF]
    src = x_ptr + n * stride_xn + offs_h[:, None] * stride_xh + 2 * offs_i[None, :]  # [BLOCK_H, HALF]
    dst = out_ptr + n * H * 2 * HALF + offs_h[:, None] * 2 * HALF + 2 * offs_i[None, :]
    rope_pairs(src, dst, angle[None, :], factor, (offs_h < H)[:, None], out_ptr.dtype.element_ty)


def apply_rope(x, positions, inv_freq, attention_factor=1.0):
    """Interleaved RoPE. x: [N, H, R] (last dim contiguous; N and H may be strided); positions: [N] int;
    inv_freq: [R/2] fp32 (a power of two). Returns a contiguous [N, H, R] in x's dtype."""
    N, H, R = x.shape
    if R // 2 & (R // 2 - 1):
        raise ValueError(f"apply_rope (triton): rope dim {R} must be twice a power of two")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if N:
        _rope_kernel[(N,)](x, positions, inv_freq.float().contiguous(), out, x.stride(0), x.stride(1), H,
                           float(attention_factor), HALF=R // 2, BLOCK_H=triton.next_power_of_2(H), **pdl.options(x))
    return out


@triton.jit
def _head_norm_rope_kernel(x_ptr, w_ptr, pos_ptr, freq_ptr, out_ptr, stride_xn, stride_xh, H, eps, factor,
                           HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_i = tl.arange(0, HALF)[None, :]
    ok = offs_h < H
    src = x_ptr + n * stride_xn + offs_h * stride_xh + offs_i  # [BLOCK_H, HALF]: first halves of the heads
    lo = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / (2 * HALF) + eps)  # [BLOCK_H]
    ty = out_ptr.dtype.element_ty
    # the norm's output rounded to x's dtype, as the reference's rms_norm returns it
    lo = (lo * rstd[:, None] * tl.load(w_ptr + offs_i).to(tl.float32)).to(ty).to(tl.float32)
    hi = (hi * rstd[:, None] * tl.load(w_ptr + HALF + offs_i).to(tl.float32)).to(ty).to(tl.float32)
    lo, hi = rotate(lo, hi, tl.load(pos_ptr + n).to(tl.float32) * tl.load(freq_ptr + offs_i), factor)  # [1, HALF] angle
    dst = out_ptr + n * H * 2 * HALF + offs_h * 2 * HALF + offs_i
    tl.store(dst, lo.to(ty), mask=ok)
    tl.store(dst + HALF, hi.to(ty), mask=ok)


def head_norm_rope(x, norm_weight, eps, positions, inv_freq, attention_factor=1.0):
    """See `ops.rope.head_norm_rope`: per-head RMSNorm + rotate-half RoPE in one launch. x: [N, H, hd] with a
    contiguous last dim; hd/2 a power of two."""
    N, H, hd = x.shape
    if hd // 2 & (hd // 2 - 1) or x.stride(2) != 1:
        raise ValueError(f"head_norm_rope (triton): head dim {hd} must be twice a power of two, last dim contiguous")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if N:
        _head_norm_rope_kernel[(N,)](x, norm_weight, positions, inv_freq.float().contiguous(), out, x.stride(0),
                                     x.stride(1), H, eps, float(attention_factor), HALF=hd // 2,
                                     BLOCK_H=triton.next_power_of_2(H), **pdl.options(x))
    return out


@triton.jit
def _write_latent_kernel(ckv_ptr, w_ptr, pos_ptr, freq_ptr, starts_ptr, kv_ptr, q_ptr, qw_ptr, qout_ptr, T, Q,
                         stride_ckv, stride_q, stride_kb, eps, factor, R: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_Q: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    n = tl.program_id(0)
    b = n // T
    src = ckv_ptr + n.to(tl.int64) * stride_ckv
    dst = kv_ptr + b.to(tl.int64) * stride_kb + (tl.load(starts_ptr + b).to(tl.int64) + n % T) * (R + 2 * HALF)
    ty = kv_ptr.dtype.element_ty
    offs = tl.arange(0, R)
    c = tl.load(src + offs).to(tl.float32)  # [R]
    w = tl.load(w_ptr + offs).to(tl.float32)
    latent = c * (1.0 / tl.sqrt(tl.sum(c * c, 0) / R + eps)) * w
    tl.store(dst + offs, latent.to(ckv_ptr.dtype.element_ty).to(ty))
    offs_i = tl.arange(0, HALF)
    angle = tl.load(pos_ptr + n).to(tl.float32) * tl.load(freq_ptr + offs_i)  # [HALF]
    # rounded to ckv's dtype first (as the reference's rope output), then stored into the cache's
    rope_pairs(src + R + 2 * offs_i, dst + R + 2 * offs_i, angle, factor, offs_i < HALF, ckv_ptr.dtype.element_ty)
    if BLOCK_Q > 0:  # the query latent's norm, [Q] -> qout row n
        offs_q = tl.arange(0, BLOCK_Q)
        q = tl.load(q_ptr + n.to(tl.int64) * stride_q + offs_q, mask=offs_q < Q, other=0.0).to(tl.float32)
        qw = tl.load(qw_ptr + offs_q, mask=offs_q < Q, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) / Q + eps)) * qw
        tl.store(qout_ptr + n.to(tl.int64) * Q + offs_q, q.to(qout_ptr.dtype.element_ty), mask=offs_q < Q)


def write_latent(kv_cache, ckv, norm_weight, eps, positions, inv_freq, attention_factor, starts, q_latent=None,
                 q_norm_weight=None):
    """See `ops.latent.write_latent`: norm + rope + cache write of [B*T, R + P] rows, and the optional query
    latent's norm, in one launch. R and P/2 must be powers of two (512 and 32 for K2.6)."""
    R, half = norm_weight.shape[0], inv_freq.shape[0]
    if R & (R - 1) or half & (half - 1):
        raise ValueError(f"write_latent (triton): latent {R} and rope pairs {half} must be powers of two")
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != kv_cache.shape[2]:
        raise ValueError("write_latent (triton): each cache row must be contiguous [L_max, R + P]")
    if ckv.stride(1) != 1:
        ckv = ckv.contiguous()
    q_out = None
    q, qw, Q = ckv, norm_weight, 0  # placeholders when there is no query latent (BLOCK_Q = 0 skips them)
    if q_latent is not None:
        q = q_latent if q_latent.stride(1) == 1 else q_latent.contiguous()
        qw, Q = q_norm_weight, q_latent.shape[1]
        q_out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
    block_q = triton.next_power_of_2(Q) if Q else 0
    if ckv.shape[0]:
        _write_latent_kernel[(ckv.shape[0],)](ckv, norm_weight, positions, inv_freq.float().contiguous(), starts,
                                              kv_cache, q, qw, q_out if q_out is not None else ckv,
                                              ckv.shape[0] // starts.shape[0], Q, ckv.stride(0), q.stride(0),
                                              kv_cache.stride(0), eps, float(attention_factor), R=R, HALF=half,
                                              BLOCK_Q=block_q, num_warps=8 if block_q >= 1024 else 4,
                                              **pdl.options(ckv))
    return q_out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    gate = tl.load(gu_ptr + row * 2 * I + offs, mask=ok, other=0.0)
    up = tl.load(gu_ptr + row * 2 * I + I + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * I + offs, linear.silu_mul(gate, up), mask=ok)


def mlp(x, gate_up_weight, down_weight):
    """See `ops.mlp.mlp`: the two projections as ops.linear's Triton backend runs them (`linear.linear`: the skinny
    GEMM where adopted, cuBLAS elsewhere). Where the down projection runs the skinny GEMM and its tiles leave room
    (`linear.glu_fits`), silu(gate) * up is formed as it loads its input (`linear_kernel(glu=True)`); else in a
    launch of its own."""
    gate_up = linear.linear(x, gate_up_weight)  # [M, 2I]
    M, I = gate_up.shape[0], gate_up.shape[1] // 2
    cfg = linear.kernel_config(gate_up, down_weight)
    if cfg is not None and linear.glu_fits(cfg, M, arch.current(x.device)):
        return linear.linear_kernel(gate_up, down_weight, cfg, glu=True)
    act = torch.empty(M, I, dtype=gate_up.dtype, device=x.device)
    if M:
        _silu_mul_kernel[(M, triton.cdiv(I, 1024))](gate_up, act, I, BLOCK=1024, **pdl.options(x))
    return F.linear(act, down_weight)
