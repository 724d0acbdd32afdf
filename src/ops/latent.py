import torch

from ops._backend import dispatch, register
from ops.attention import write_kv_torch
from ops.norm import rms_norm_torch
from ops.rope import apply_rope_torch


def write_latent(kv_cache, ckv, norm_weight, eps, positions, inv_freq, attention_factor, starts, q_latent=None,
                 q_norm_weight=None):
    """Turn the kv_a projection of T new tokens per sequence into cache entries and write them.

    Entry = [rms_norm(ckv[:, :R]) ; rope(ckv[:, R:])], written at kv_cache[b, starts[b] + t] for row b*T + t.
    kv_cache: [B, L_max, R + P]; ckv: [B*T, R + P]; norm_weight: [R]; positions: [B*T] int; inv_freq: [P/2]
    fp32; starts: [B] int. In place, no host sync. With q_latent [B*T, Q] and q_norm_weight [Q] (the other part
    of the fused q_a/kv_a projection) it also returns rms_norm(q_latent) with the same eps, in the same launch;
    otherwise None.
    """
    B, R = starts.shape[0], norm_weight.shape[0]
    if ckv.dim() != 2 or ckv.shape[1] != kv_cache.shape[-1] or ckv.shape[0] % max(B, 1) or \
            positions.shape != ckv.shape[:1] or 2 * inv_freq.shape[0] != ckv.shape[1] - R:
        raise ValueError(f"write_latent: kv_cache {tuple(kv_cache.shape)}, ckv {tuple(ckv.shape)}, norm "
                         f"{tuple(norm_weight.shape)}, positions {tuple(positions.shape)}, inv_freq "
                         f"{tuple(inv_freq.shape)}, starts {tuple(starts.shape)} do not fit")
    if (q_latent is None) != (q_norm_weight is None) or q_latent is not None and (
            q_latent.dim() != 2 or q_latent.shape != (ckv.shape[0], q_norm_weight.shape[0])):
        raise ValueError(f"write_latent: q_latent {None if q_latent is None else tuple(q_latent.shape)} and "
                         f"q_norm_weight {None if q_norm_weight is None else tuple(q_norm_weight.shape)} do not fit "
                         f"[{ckv.shape[0]}, Q] and [Q]")
    return dispatch("write_latent", kv_cache.device)(kv_cache, ckv, norm_weight, eps, positions, inv_freq,
                                                     attention_factor, starts, q_latent, q_norm_weight)


def write_latent_torch(kv_cache, ckv, norm_weight, eps, positions, inv_freq, attention_factor, starts, q_latent=None,
                       q_norm_weight=None):
    R = norm_weight.shape[0]
    latent = rms_norm_torch(ckv[:, :R], norm_weight, eps)
    k_pe = apply_rope_torch(ckv[:, None, R:], positions, inv_freq, attention_factor)[:, 0]
    entries = torch.cat([latent, k_pe], -1)
    write_kv_torch(kv_cache, entries.view(starts.shape[0], -1, entries.shape[-1]), starts)
    return None if q_latent is None else rms_norm_torch(q_latent, q_norm_weight, eps)


register("write_latent", write_latent_torch, "triton_kernels.glue:write_latent")
