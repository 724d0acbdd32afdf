from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ops._backend import current, dispatch, register
from ops._checks import check_dims, check_dtype
from ops.norm import add_rms_norm_torch

GROUP = 32  # INT4 quantisation group along the input dim
PACK = 8  # nibbles per int32 word


def _check_grouping(op, E, n_group, topk_group, top_k):
    """The router's expert grouping: E experts in n_group groups, topk_group of them kept, top_k experts chosen."""
    if E % n_group or not 0 < topk_group <= n_group or not 0 < top_k <= E:
        raise ValueError(f"{op}: bad grouping E={E}, n_group={n_group}, topk_group={topk_group}, top_k={top_k}")


def route(x, gate_weight, bias, top_k, n_group, topk_group, scaling_factor, norm_topk_prob=True):
    """DeepSeek-V3 noaux_tc router in fp32.

    s = sigmoid(x @ gate_weight^T); experts chosen by top-k of s + bias, limited to the topk_group groups
    (of n_group) with the best sum of their top-2 biased scores; weights are the unbiased s of the chosen,
    normalised to sum 1 when norm_topk_prob, times scaling_factor.
    x: [M, D]; gate_weight: [E, D]; bias: [E] fp32. Returns (weights [M, k] fp32, ids [M, k] int32).
    """
    E = gate_weight.shape[0]
    if x.shape[-1] != gate_weight.shape[1] or bias.shape != (E,):
        raise ValueError(f"route: x {tuple(x.shape)}, gate {tuple(gate_weight.shape)}, bias {tuple(bias.shape)}")
    _check_grouping("route", E, n_group, topk_group, top_k)
    impl = dispatch("router", x.device, x.dtype)
    return impl(x, gate_weight, bias, top_k, n_group, topk_group, scaling_factor, norm_topk_prob)


def norm_route(x, residual, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, scaling_factor,
               norm_topk_prob=True):
    """`add_rms_norm(x, residual, norm_weight, eps)`, then `route` of its normed rows: the post-attention norm and
    the router that is the first to read it. Where its arch's table says so (sm_120), the Triton backend runs one
    row in one launch fewer (the norm in the prologue of the logits' gemv, which also stores h and the normed row):
    its normed row and logits may then differ from the two ops' in a last bit, as the rstd's sum runs in another
    order.

    x, residual, norm_weight: as `add_rms_norm`'s; gate_weight, bias and the rest as `route`'s. Returns (h [M, D],
    normed [M, D], weights [M, k] fp32, ids [M, k] int32).
    """
    E = gate_weight.shape[0]
    if (x.dim() != 2 or x.shape != residual.shape or x.dtype not in (residual.dtype, torch.float32)
            or norm_weight.shape != (x.shape[1],) or gate_weight.shape[1:] != x.shape[1:] or bias.shape != (E,)):
        raise ValueError(f"norm_route: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype}, norm_weight {tuple(norm_weight.shape)}, gate {tuple(gate_weight.shape)}, "
                         f"bias {tuple(bias.shape)} do not fit [M, D], [D], [E, D], [E]")
    _check_grouping("norm_route", E, n_group, topk_group, top_k)
    impl = dispatch("norm_route", x.device, residual.dtype)
    return impl(x, residual, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, scaling_factor,
                norm_topk_prob)


def norm_route_torch(x, residual, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, scaling_factor,
                     norm_topk_prob=True):
    h, normed = add_rms_norm_torch(x, residual, norm_weight, eps)
    return h, normed, *route_torch(normed, gate_weight, bias, top_k, n_group, topk_group, scaling_factor,
                                   norm_topk_prob)


def route_torch(x, gate_weight, bias, top_k, n_group, topk_group, scaling_factor, norm_topk_prob=True):
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()  # [M, E]
    choice = scores + bias.float()
    M, E = choice.shape
    if n_group > 1:
        group_score = choice.view(M, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [M, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids.to(torch.int32)


@dataclass
class PackedExperts:
    """Routed experts in the checkpoint's compressed-tensors form (the torch backend's layout).

    gate_up_packed: [E, 2I, D/8] int32 (gate rows then up rows); gate_up_scale: [E, 2I, D/32];
    down_packed: [E, D, I/8] int32; down_scale: [E, D, I/32]. Nibble i of a row is word i//8, bits 4*(i%8),
    holding q + 8 for q in [-8, 7]; w = q * scale[:, i // 32].
    """

    gate_up_packed: torch.Tensor
    gate_up_scale: torch.Tensor
    down_packed: torch.Tensor
    down_scale: torch.Tensor
    backend: str = "torch"

    @property
    def num_experts(self):
        return self.gate_up_packed.shape[0]

    @property
    def hidden(self):
        return self.down_packed.shape[1]

    @property
    def intermediate(self):
        return self.gate_up_packed.shape[1] // 2


def check_packed_experts(gate_up_packed, gate_up_scale, down_packed, down_scale):
    """Validate the shapes and dtypes of stacked compressed-tensors experts; returns (E, D, I)."""
    for name, t in (("gate_up_packed", gate_up_packed), ("down_packed", down_packed)):
        check_dims(name, t, 3)
        check_dtype(name, t, torch.int32)
    E, two_i, d_words = gate_up_packed.shape
    D, I = d_words * PACK, two_i // 2
    want = {
        "gate_up_scale": (gate_up_scale, (E, 2 * I, D // GROUP)),
        "down_packed": (down_packed, (E, D, I // PACK)),
        "down_scale": (down_scale, (E, D, I // GROUP)),
    }
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if D % GROUP or I % GROUP or two_i % 2:
        raise ValueError(f"experts: hidden {D} and intermediate {I} must be multiples of {GROUP}")
    return E, D, I


def prepare_moe(gate_up_packed, gate_up_scale, down_packed, down_scale, activation_dtype=None):
    """Lay the routed experts out for the current `moe` backend, once, at load.

    Inputs as in `PackedExperts` (compressed-tensors INT4, group 32); activation_dtype: the dtype `moe` will
    get (it decides the default backend). Returns a backend-owned object that `moe` takes; a Triton backend
    may repack into its own tiled layout.
    """
    check_packed_experts(gate_up_packed, gate_up_scale, down_packed, down_scale)
    impl = dispatch("prepare_moe", gate_up_packed.device, activation_dtype)
    return impl(gate_up_packed, gate_up_scale, down_packed, down_scale)


def prepare_moe_torch(gate_up_packed, gate_up_scale, down_packed, down_scale):
    return PackedExperts(gate_up_packed, gate_up_scale, down_packed, down_scale)


def unpack_int4(packed, scale):
    """Dequantise compressed-tensors INT4: packed [..., N, K/8] int32, scale [..., N, K/32] -> [..., N, K] fp32."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., N, K/8, 8]
    q = nibbles.flatten(-2).float() - 8.0
    return q * scale.float().repeat_interleave(GROUP, dim=-1)


def pack_int4(q):
    """Pack int values in [-8, 7] of shape [..., N, K] into compressed-tensors int32 words [..., N, K/8]."""
    if q.min() < -8 or q.max() > 7:
        raise ValueError("pack_int4: values must lie in [-8, 7]")
    u = (q.to(torch.int64) + 8).unflatten(-1, (-1, PACK))
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (u << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def moe(x, topk_ids, topk_weights, experts, keep_sums=False):
    """Routed-expert mixture: out[m] = sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m]).

    expert_e(x) = (silu(x W_gate,e^T) * (x W_up,e^T)) W_down,e^T with INT4 group-32 weights.
    x: [M, D]; topk_ids: [M, k] int32; topk_weights: [M, k] fp32; experts: from `prepare_moe` for the current
    backend. Returns [M, D] in x's dtype; with keep_sums, where the backend summed in fp32 (the reference, the
    Triton routing-pass path), those fp32 sums instead, for a caller that rounds them itself (no cast launch).
    The shared expert is not included (see `mlp`).
    """
    check_dims("x", x, 2)
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)} do not fit")
    backend = current("moe", x.device, x.dtype)
    if experts.backend != backend:
        raise ValueError(f"moe: experts were prepared for {experts.backend!r} but the moe backend is "
                         f"{backend!r}; call prepare_moe again after switching")
    if x.shape[1] != experts.hidden:
        raise ValueError(f"moe: x hidden {x.shape[1]} but experts hidden {experts.hidden}")
    return dispatch("moe", x.device, x.dtype)(x, topk_ids, topk_weights, experts, keep_sums)


def moe_torch(x, topk_ids, topk_weights, experts, keep_sums=False):
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.long().flatten()
    order = flat_ids.argsort()
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        rows = pairs // topk_ids.shape[1]
        w_gate_up = unpack_int4(experts.gate_up_packed[e], experts.gate_up_scale[e])  # [2I, D]
        w_down = unpack_int4(experts.down_packed[e], experts.down_scale[e])  # [D, I]
        gate, up = (x[rows].float() @ w_gate_up.T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w_down.T
        out.index_add_(0, rows, y * topk_weights.flatten()[pairs, None].float())
    return out if keep_sums else out.to(x.dtype)


register("router", route_torch, "triton_kernels.router:route", triton_dtypes=(torch.float16, torch.bfloat16))
register("norm_route", norm_route_torch, "triton_kernels.router:norm_route",
         triton_dtypes=(torch.float16, torch.bfloat16))
register("moe", moe_torch, "triton_kernels.moe_w4a16:moe", triton_dtypes=(torch.float16, torch.bfloat16))
register("prepare_moe", prepare_moe_torch, "triton_kernels.moe_layout:prepare_moe", follows="moe")
