import torch
import torch.nn.functional as F

from ops._backend import dispatch, register


def rms_norm(x, weight, eps):
    """RMSNorm over the last dim: `x / sqrt(mean(x^2) + eps) * weight`, computed in fp32.

    x: [..., D] float; weight: [D]. Returns [..., D] in x's dtype.
    """
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x has last dim {x.shape[-1]} but weight has {weight.shape[0]}")
    return dispatch("rms_norm", x.device)(x, weight, eps)


def rms_norm_torch(x, weight, eps):
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)


def add_rms_norm(x, residual, weight, eps, extra=None):
    """The residual add fused with the next norm: `h = x + residual` (rounded to x's dtype), `rms_norm(h)`.
    With `extra` (a second partial output, e.g. a MoE's shared expert beside its routed experts):
    `h = (x + extra) + residual`, each add rounded as two separate adds would be.

    residual, extra: [..., D] of one dtype; x: the same shape, of that dtype or fp32 (rounded to it first, as a
    cast would); weight: [D]. Returns (h, normed), both of residual's shape and dtype.
    """
    if (x.shape != residual.shape or x.dtype not in (residual.dtype, torch.float32) or x.shape[-1] != weight.shape[0]
            or extra is not None and (extra.shape != x.shape or extra.dtype != residual.dtype)):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype}, weight {tuple(weight.shape)}"
                         + ("" if extra is None else f", extra {tuple(extra.shape)} {extra.dtype}") + " do not fit")
    return dispatch("add_rms_norm", x.device)(x, residual, weight, eps, extra)


def add_rms_norm_torch(x, residual, weight, eps, extra=None):
    x = x.to(residual.dtype)
    h = (x if extra is None else x + extra) + residual
    return h, rms_norm_torch(h, weight, eps)


def norm_linear(x, norm_weight, eps, weight, residual=None, extra=None):
    """A norm and the projection that is its only reader: `h = x`, or with a residual `add_rms_norm`'s h; then
    `y = linear(rms_norm(h), weight)`. The Triton backend runs one row in one launch (the norm in the skinny GEMM's
    prologue, where `linear` runs its gemv): its y may differ from the two ops' in the last bit, as the rstd's sum
    runs in another order.

    x: [M, D] (rows may be strided); residual, extra: as `add_rms_norm`'s (x then of residual's dtype or fp32);
    norm_weight: [D]; weight: [N, D]. Returns (h [M, D], y [M, N]), y in weight's dtype (residual's, or x's without
    one).
    """
    ty = x.dtype if residual is None else residual.dtype
    if (x.dim() != 2 or norm_weight.shape != (x.shape[1],) or weight.dim() != 2 or weight.shape[1] != x.shape[1]
            or weight.dtype != ty or residual is not None and (residual.shape != x.shape
                                                                or x.dtype not in (ty, torch.float32))
            or extra is not None and (residual is None or extra.shape != x.shape or extra.dtype != ty)):
        raise ValueError(f"norm_linear: x {tuple(x.shape)} {x.dtype}, norm_weight {tuple(norm_weight.shape)}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}"
                         + ("" if residual is None else f", residual {tuple(residual.shape)} {residual.dtype}")
                         + ("" if extra is None else f", extra {tuple(extra.shape)} {extra.dtype}")
                         + " do not fit [M, D], [D], [N, D] of one dtype (extra only beside a residual)")
    return dispatch("norm_linear", x.device, weight.dtype)(x, norm_weight, eps, weight, residual, extra)


def norm_linear_torch(x, norm_weight, eps, weight, residual=None, extra=None):
    if residual is None:
        return x, F.linear(rms_norm_torch(x, norm_weight, eps), weight)
    h, normed = add_rms_norm_torch(x, residual, norm_weight, eps, extra)
    return h, F.linear(normed, weight)


register("rms_norm", rms_norm_torch, "triton_kernels.glue:rms_norm")
register("add_rms_norm", add_rms_norm_torch, "triton_kernels.glue:add_rms_norm")
register("norm_linear", norm_linear_torch, "triton_kernels.glue:norm_linear",
         triton_dtypes=(torch.float16, torch.bfloat16))
