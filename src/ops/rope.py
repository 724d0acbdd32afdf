import math

import torch

from ops._backend import dispatch, register
from ops.norm import rms_norm_torch


def yarn_inv_freq(rope_dim, theta, scaling=None):
    """Inverse frequencies [rope_dim/2] fp32 and the cos/sin factor, for plain or YaRN RoPE.

    YaRN blends interpolated (theta^(-2i/d) / factor) and original frequencies with a linear ramp between
    floor(corr(beta_fast)) and ceil(corr(beta_slow)), corr(r) = d*ln(L0/(2*pi*r)) / (2*ln(theta)).
    """
    base = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    if not scaling or scaling.get("type", scaling.get("rope_type")) in (None, "default"):
        return 1.0 / base, 1.0
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def corr(rotations):
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original frequency; operation order as HF's, so the result is bit-equal
    inv_freq = 1.0 / (factor * base) * (1 - keep) + 1.0 / base * keep
    return inv_freq, yarn_attention_factor(scaling)


def yarn_mscale(factor, mscale):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling):
    """The factor YaRN applies to cos/sin (1 for DeepSeek-V3/K2.6, where mscale == mscale_all_dim)."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor, 1.0)


def apply_rope(x, positions, inv_freq, attention_factor=1.0):
    """Rotate interleaved pairs: (x[2i], x[2i+1]) turns by angle position * inv_freq[i].

    x: [N, H, R] (R even); positions: [N] int; inv_freq: [R/2] fp32. Returns [N, H, R] in x's dtype, pairs
    kept interleaved (queries and keys go through the same op, so dot products match the checkpoint's).
    """
    if x.dim() != 3 or positions.shape != x.shape[:1] or inv_freq.shape[0] * 2 != x.shape[-1]:
        raise ValueError(
            f"apply_rope: want x [N, H, R], positions [N], inv_freq [R/2]; got {tuple(x.shape)}, "
            f"{tuple(positions.shape)}, {tuple(inv_freq.shape)}"
        )
    return dispatch("rope", x.device)(x, positions, inv_freq, attention_factor)


def apply_rope_torch(x, positions, inv_freq, attention_factor=1.0):
    angle = positions.float()[:, None] * inv_freq.float()[None, :]  # [N, R/2]
    cos = (angle.cos() * attention_factor)[:, None, :]
    sin = (angle.sin() * attention_factor)[:, None, :]
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


def head_norm_rope(x, norm_weight, eps, positions, inv_freq, attention_factor=1.0):
    """Qwen3's per-head query/key norm, then rotate-half RoPE (x[i], x[i + hd/2] turn by position * inv_freq[i]).

    x: [N, H, hd] (last dim contiguous); norm_weight: [hd]; positions: [N] int; inv_freq: [hd/2] fp32. Returns a
    contiguous [N, H, hd] in x's dtype: rope(rms_norm(x)), the norm's output rounded to x's dtype first.
    """
    if x.dim() != 3 or norm_weight.shape != x.shape[-1:] or positions.shape != x.shape[:1] or \
            inv_freq.shape[0] * 2 != x.shape[-1]:
        raise ValueError(
            f"head_norm_rope: want x [N, H, hd], norm_weight [hd], positions [N], inv_freq [hd/2]; got "
            f"{tuple(x.shape)}, {tuple(norm_weight.shape)}, {tuple(positions.shape)}, {tuple(inv_freq.shape)}"
        )
    return dispatch("head_norm_rope", x.device)(x, norm_weight, eps, positions, inv_freq, attention_factor)


def head_norm_rope_torch(x, norm_weight, eps, positions, inv_freq, attention_factor=1.0):
    N, H, hd = x.shape
    normed = rms_norm_torch(x, norm_weight, eps)
    pairs = normed.view(N, H, 2, hd // 2).transpose(-1, -2).reshape(N, H, hd)  # rotate-half as interleaved pairs
    out = apply_rope_torch(pairs, positions, inv_freq, attention_factor)
    return out.view(N, H, hd // 2, 2).transpose(-1, -2).reshape(N, H, hd)


register("rope", apply_rope_torch, "triton_kernels.glue:apply_rope")
register("head_norm_rope", head_norm_rope_torch, "triton_kernels.glue:head_norm_rope")
