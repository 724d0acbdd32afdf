"""MLA's absorbed projections around the latent attention: the query into latent space (fused with the query's
RoPE and the [latent ; rope] layout the attention reads) and the latent context back to per-head values."""

import torch

from ops._backend import dispatch, register
from ops.rope import apply_rope_torch


def absorb_query(q_nope, q_pe, w_uk, positions, inv_freq, attention_factor):
    """q = [q_nope @ W_UK ; rope(q_pe)] per head, the query the latent attention reads.

    q_nope: [N, H, dn]; q_pe: [N, H, dr] (both may be strided views); w_uk: [H, dn, R]; positions: [N] int;
    inv_freq: [dr/2] fp32. Returns q [N, H, R + dr] in q_nope's dtype.
    """
    N, H, dn = q_nope.shape
    if q_pe.shape[:2] != (N, H) or w_uk.shape[:2] != (H, dn) or positions.shape != (N,):
        raise ValueError(f"absorb_query: q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, w_uk "
                         f"{tuple(w_uk.shape)}, positions {tuple(positions.shape)} do not fit")
    return dispatch("absorb_query", q_nope.device, q_nope.dtype)(q_nope, q_pe, w_uk, positions, inv_freq, attention_factor)


def absorb_query_torch(q_nope, q_pe, w_uk, positions, inv_freq, attention_factor):
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
