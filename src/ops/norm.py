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


register("rms_norm", rms_norm_torch)
