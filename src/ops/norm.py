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


def add_rms_norm(x, residual, weight, eps):
    """The residual add fused with the next norm: `h = x + residual` (rounded to x's dtype), `rms_norm(h)`.

    x, residual: [M, D] of one dtype; weight: [D]. Returns (h [M, D], normed [M, D]).
    """
    if x.shape != residual.shape or x.dtype != residual.dtype or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype}, weight {tuple(weight.shape)} do not fit")
    return dispatch("add_rms_norm", x.device)(x, residual, weight, eps)


def add_rms_norm_torch(x, residual, weight, eps):
    h = x + residual
    return h, rms_norm_torch(h, weight, eps)


register("rms_norm", rms_norm_torch, "triton_kernels.glue:rms_norm")
register("add_rms_norm", add_rms_norm_torch, "triton_kernels.glue:add_rms_norm")
