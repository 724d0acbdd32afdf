"""MLA's absorbed projections around the latent attention: the query into latent space (fused with the query's
RoPE, the [latent ; rope] layout the attention reads and the new tokens' cache entries) and the latent context back
to per-head values."""

from typing import NamedTuple

import torch

from ops._backend import dispatch, register
from ops.attention import write_kv_torch
from ops.norm import rms_norm_torch
from ops.rope import apply_rope_torch


class LatentWrite(NamedTuple):
    """The new tokens' cache entries that `absorb_query` writes in the same pass, with the query's positions and
    RoPE: entry = [rms_norm(ckv[:, :R]) ; rope(ckv[:, R:])], row b*T + t written at kv_cache[b, starts[b] + t].
    kv_cache: [B, L_max, R + P]; ckv: [B*T, R + P] (the kv_a projection, rows may be strided); norm_weight: [R];
    starts: [B] int. In place, no host sync."""

    kv_cache: torch.Tensor
    ckv: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    starts: torch.Tensor


def absorb_query(q_nope, q_pe, w_uk, positions, inv_freq, attention_factor, write=None):
    """q = [q_nope @ W_UK ; rope(q_pe)] per head, the query the latent attention reads; with `write` (a
    `LatentWrite`) also the new tokens' cache entries, roped like the query.

    q_nope: [N, H, dn]; q_pe: [N, H, dr] (both may be strided views); w_uk: [H, dn, R]; positions: [N] int;
    inv_freq: [dr/2] fp32. Returns q [N, H, R + dr] in q_nope's dtype.
    """
    N, H, dn = q_nope.shape
    if q_pe.shape[:2] != (N, H) or w_uk.shape[:2] != (H, dn) or positions.shape != (N,):
        raise ValueError(f"absorb_query: q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, w_uk "
                         f"{tuple(w_uk.shape)}, positions {tuple(positions.shape)} do not fit")
    if write is not None:
        _check_write(write, N, q_pe.shape[2])
    return dispatch("absorb_query", q_nope.device, q_nope.dtype)(q_nope, q_pe, w_uk, positions, inv_freq,
                                                                  attention_factor, write)


def _check_write(write, N, rope_dim):
    cache, ckv, R, B = write.kv_cache, write.ckv, write.norm_weight.shape[0], write.starts.shape[0]
    if (cache.dim() != 3 or ckv.dim() != 2 or ckv.shape != (N, cache.shape[2]) or ckv.shape[1] - R != rope_dim
            or write.norm_weight.dim() != 1 or write.starts.dim() != 1 or B == 0 or N % B):
        raise ValueError(f"absorb_query: write's kv_cache {tuple(cache.shape)}, ckv {tuple(ckv.shape)}, norm "
                         f"{tuple(write.norm_weight.shape)} and starts {tuple(write.starts.shape)} do not fit {N} "
                         f"tokens and a rope of {rope_dim}")


def absorb_query_torch(q_nope, q_pe, w_uk, positions, inv_freq, attention_factor, write=None):
    if write is not None:
        R = write.norm_weight.shape[0]
        ckv = write.ckv
        latent = rms_norm_torch(ckv[:, :R], write.norm_weight, write.eps)
        k_pe = apply_rope_torch(ckv[:, None, R:], positions, inv_freq, attention_factor)[:, 0]
        entries = torch.cat([latent, k_pe], -1)
        write_kv_torch(write.kv_cache, entries.view(write.starts.shape[0], -1, entries.shape[-1]), write.starts)
    q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
    return torch.cat([q_lat, apply_rope_torch(q_pe, positions, inv_freq, attention_factor)], -1)


def absorb_output(o_lat, w_uv):
    """Per-head values from the latent context: o[n, h*dv + d] = sum_c o_lat[n, h, c] W_UV[h, d, c].

    o_lat: [N, H, R]; w_uv: [H, dv, R] (may be a strided view). Returns [N, H*dv] in o_lat's dtype.
    """
    if o_lat.dim() != 3 or w_uv.dim() != 3 or o_lat.shape[1] != w_uv.shape[0] or o_lat.shape[2] != w_uv.shape[2]:
        raise ValueError(f"absorb_output: o_lat {tuple(o_lat.shape)} and w_uv {tuple(w_uv.shape)} do not fit")
    return dispatch("absorb_output", o_lat.device, o_lat.dtype)(o_lat, w_uv)


def absorb_output_torch(o_lat, w_uv):
    return torch.einsum("nhc,hdc->nhd", o_lat, w_uv).reshape(o_lat.shape[0], -1)


register("absorb_query", absorb_query_torch, "triton_kernels.absorb:absorb_query",
         triton_dtypes=(torch.float16, torch.bfloat16))
register("absorb_output", absorb_output_torch, "triton_kernels.absorb:absorb_output",
         triton_dtypes=(torch.float16, torch.bfloat16))
