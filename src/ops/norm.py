import torch

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


register("rms_norm", rms_norm_torch, "triton_kernels.glue:rms_norm")
register("add_rms_norm", add_rms_norm_torch, "triton_kernels.glue:add_rms_norm")
