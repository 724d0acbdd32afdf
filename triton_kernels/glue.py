"""Row-wise kernels of the layer glue, one launch each: RMSNorm (alone, fused with the residual add, or in the next
projection's gemv: `norm_linear`), interleaved RoPE, SwiGLU's silu(gate) * up, and the latent cache entries' norm +
rope + store (`write_latent_rows`, run inside `absorb.absorb_query`'s launch).

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
    rstd = linear.inv_rms(x, D, eps)
    tl.store(out_ptr + row * stride_out + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)


def _norm_warps(block):
    return 8 if block >= 4096 else 4


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
                                           num_warps=_norm_warps(block), **pdl.options(x))
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, e_ptr, w_ptr, h_ptr, out_ptr, D, eps, BLOCK_D: tl.constexpr,
                         EXTRA: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = row * D + tl.arange(0, BLOCK_D)
    ok = tl.arange(0, BLOCK_D) < D
    ty = h_ptr.dtype.element_ty
    h = linear.residual_sum(x_ptr + offs, r_ptr + offs, e_ptr + offs, ok, ty, True, EXTRA)
    tl.store(h_ptr + offs, h, mask=ok)
    h = h.to(tl.float32)
    w = tl.load(w_ptr + tl.arange(0, BLOCK_D), mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (h * linear.inv_rms(h, D, eps) * w).to(ty), mask=ok)


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
                                                 EXTRA=extra is not x, num_warps=_norm_warps(block),
                                                 **pdl.options(residual))
    return h, out


# Per arch, the widest row whose norm the gemv computes in its prologue (every program sums the whole row alone)
# rather than the norm kernel in a launch of its own: the hidden size's too on both paths. One launch fewer saves
# 1.0-1.3 us where the gemv is short and costs 2% of the lm_head's (bench/results/norm_linear_h100.md).
NORM_IN_GEMV_MAX_D = {"sm_90": linear.NORM_MAX_K, "sm_120": linear.NORM_MAX_K}


def norm_linear(x, norm_weight, eps, weight, residual=None, extra=None):
    """See `ops.norm.norm_linear`. x (, residual, extra): [M, D]; norm_weight: [D]; weight: [N, D]. One row on the
    skinny GEMM's gemv up to NORM_IN_GEMV_MAX_D: the norm in the gemv's prologue (`linear_kernel(norm=...)`: one
    launch); else the norm kernel, then `linear.linear`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = linear.kernel_config(x if residual is None else residual, weight)
    max_d = NORM_IN_GEMV_MAX_D[arch.current(x.device)]
    if x.shape[0] == 1 and cfg is not None and cfg.kind == "gemv" and x.shape[1] <= max_d:
        h = x if residual is None else torch.empty_like(residual)
        args = [t if t is None else t.contiguous() for t in (residual, extra)]
        y = linear.linear_kernel(x, weight, cfg, norm=linear.Norm(norm_weight, eps, *args, h=h))
        return h, y
    if residual is None:
        return x, linear.linear(rms_norm(x, norm_weight, eps), weight)
    h, normed = add_rms_norm(x, residual, norm_weight, eps, extra)
    return h, linear.linear(normed, weight)


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
def write_latent_rows(ckv_ptr, w_ptr, pos_ptr, freq_ptr, starts_ptr, kv_ptr, rows, ok, T, stride_ckv, stride_kb, eps,
                      factor, R: tl.constexpr, HALF: tl.constexpr):
    """Cache entries [rms_norm(c) ; rope(k_pe)] of the kv_a projection's rows `rows` [BN] (where ok): row b*T + t
    goes to kv_ptr's sequence b at starts[b] + t. Rounded to ckv's dtype first (as the references' outputs), then
    stored in the cache's."""
    b = rows // T
    src = ckv_ptr + rows.to(tl.int64)[:, None] * stride_ckv  # [BN, 1]
    slot = tl.load(starts_ptr + b, mask=ok, other=0).to(tl.int64) + rows % T
    dst = kv_ptr + b.to(tl.int64)[:, None] * stride_kb + slot[:, None] * (R + 2 * HALF)
    ty = kv_ptr.dtype.element_ty
    src_ty = ckv_ptr.dtype.element_ty
    offs = tl.arange(0, R)[None, :]
    c = tl.load(src + offs, mask=ok[:, None], other=0.0).to(tl.float32)  # [BN, R]
    w = tl.load(w_ptr + offs).to(tl.float32)
    latent = c * linear.inv_rms(c, R, eps, 1)[:, None] * w
    tl.store(dst + offs, latent.to(src_ty).to(ty), mask=ok[:, None])
    offs_i = tl.arange(0, HALF)[None, :]
    angle = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.float32)[:, None] * tl.load(freq_ptr + offs_i)
    rope_pairs(src + R + 2 * offs_i, dst + R + 2 * offs_i, angle, factor, ok[:, None], src_ty)


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
