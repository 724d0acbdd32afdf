"""Kimi K2.6 / DeepSeek-V3 text model built only from `ops.*` (and the embedding lookup).

Module and buffer names mirror the checkpoint's (after its `model.` / `language_model.model.` prefix), except
two stacked forms the loader fills: `mlp.gate_up.weight` (gate rows then up rows of a dense MLP or shared
expert) and `mlp.experts.{gate_up,down}_{packed,scale}` (all routed experts, compressed-tensors INT4).
Every tensor holds this rank's shard (see `Parallel`).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import ops
from model.cache import LatentCache
from model.parallel import Parallel


class Tensors(nn.Module):
    """A leaf holding named buffers (`weight`, `e_score_correction_bias`, ...)."""

    def __init__(self, **tensors):
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)

    @classmethod
    def empty(cls, shape, dtype, device):
        """A leaf holding one uninitialised `weight` of `shape` (the loader or `init_random_` fills it)."""
        return cls(weight=torch.empty(shape, dtype=dtype, device=device))


class Attention(nn.Module):
    """MLA with the absorbed decode/verify form: q_lat = W_UK^T q_nope attends the 576-wide latent cache."""

    def __init__(self, cfg, par, dtype, device):
        super().__init__()
        self.cfg = cfg
        _, self.heads = par.shard(cfg.num_attention_heads, "attention heads")
        D, H, R = cfg.hidden_size, self.heads, cfg.kv_lora_rank
        # The down-projections that read x ([q_a ;] kv_a) are views of one buffer, so one GEMM reads both;
        # state_dict and the loader see the two views (the joint buffer is not persistent).
        down = torch.empty((cfg.q_lora_rank or 0) + cfg.cache_entry_dim, D, dtype=dtype, device=device)
        self.register_buffer("down_proj_weight", down, persistent=False)
        if cfg.q_lora_rank:
            self.q_a_proj = Tensors(weight=None)
            self.q_a_layernorm = Tensors.empty((cfg.q_lora_rank,), dtype, device)
            self.q_b_proj = Tensors.empty((H * cfg.qk_head_dim, cfg.q_lora_rank), dtype, device)
        else:
            self.q_proj = Tensors.empty((H * cfg.qk_head_dim, D), dtype, device)
        self.kv_a_proj_with_mqa = Tensors(weight=None)
        self._bind_down_views()
        self.kv_a_layernorm = Tensors.empty((R,), dtype, device)
        self.kv_b_proj = Tensors.empty((H * (cfg.qk_nope_head_dim + cfg.v_head_dim), R), dtype, device)
        self.o_proj = Tensors.empty((D, H * cfg.v_head_dim), dtype, device)
        inv_freq, self.rope_factor = ops.yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def _bind_down_views(self):
        q_lora = self.cfg.q_lora_rank or 0
        if q_lora:
            self.q_a_proj.weight = self.down_proj_weight[:q_lora]
        self.kv_a_proj_with_mqa.weight = self.down_proj_weight[q_lora:]

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # moves/casts the views and the joint buffer apart: re-join them
        self._bind_down_views()
        return self

    def project(self, down, meta, kv, x=None):
        """down: the down projection's output [N, (q_lora +) 576] ([q_a ;] kv_a of the normed hidden x, which only a
        model without q_a needs) -> q_nope [N, H, 128], q_pe [N, H, 64], and the `ops.LatentWrite` of the N new
        entries into this layer's cache kv (kv_a's part), which `absorb_query` writes beside the query."""
        cfg = self.cfg
        qa, ckv = down.split([cfg.q_lora_rank or 0, cfg.cache_entry_dim], -1)
        if cfg.q_lora_rank:
            q = ops.norm_linear(qa, self.q_a_layernorm.weight, cfg.latent_norm_eps, self.q_b_proj.weight)[1]
        else:
            q = ops.linear(x, self.q_proj.weight)
        q = q.view(down.shape[0], self.heads, cfg.qk_head_dim)
        write = ops.LatentWrite(kv, ckv, self.kv_a_layernorm.weight, cfg.latent_norm_eps, meta.starts)
        return *q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1), write

    def absorption_weights(self):
        """(W_UK [H, 128, 512], W_UV [H, 128, 512]): views of kv_b_proj, which maps a latent c to k_nope and v."""
        cfg = self.cfg
        w_kv = self.kv_b_proj.weight.view(self.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w_kv[:, : cfg.qk_nope_head_dim], w_kv[:, cfg.qk_nope_head_dim :]

    def forward(self, x, meta, kv):
        """x: [N = B*T, D] normed hidden; kv: this layer's cache [B, L_max, 576]. Returns [N, D] (partial)."""
        return self.attend(ops.linear(x, self.down_proj_weight), meta, kv, x)

    def attend(self, down, meta, kv, x=None):
        """`forward` from the down projection's output (`project`)."""
        cfg, N = self.cfg, down.shape[0]
        q_nope, q_pe, write = self.project(down, meta, kv, x)
        w_uk, w_uv = self.absorption_weights()
        q = ops.absorb_query(q_nope, q_pe, w_uk, meta.positions, self.inv_freq, self.rope_factor, write)
        o_lat = ops.mla_attention(q.view(meta.B, meta.T, self.heads, cfg.cache_entry_dim), kv, meta.lens_after,
                                  meta.tree_mask, cfg.softmax_scale, cfg.kv_lora_rank)
        o = ops.absorb_output(o_lat.reshape(N, self.heads, cfg.kv_lora_rank), w_uv)
        return ops.linear(o, self.o_proj.weight)


class DenseMLP(nn.Module):
    def __init__(self, hidden, intermediate, par, dtype, device, what):
        super().__init__()
        _, local = par.shard(intermediate, what)
        self.gate_up = Tensors.empty((2 * local, hidden), dtype, device)
        self.down_proj = Tensors.empty((hidden, local), dtype, device)

    def forward(self, x):
        return ops.mlp(x, self.gate_up.weight, self.down_proj.weight)


class Experts(nn.Module):
    """All routed experts of a layer, stacked, in the checkpoint's INT4 form until `prepare` re-lays them."""

    def __init__(self, cfg, par, device):
        super().__init__()
        E, D = cfg.n_routed_experts, cfg.hidden_size
        _, local = par.shard(cfg.moe_intermediate_size, "moe_intermediate_size", multiple=32)
        int32, bf16 = dict(dtype=torch.int32, device=device), dict(dtype=torch.bfloat16, device=device)
        self.register_buffer("gate_up_packed", torch.empty(E, 2 * local, D // 8, **int32))
        self.register_buffer("gate_up_scale", torch.empty(E, 2 * local, D // 32, **bf16))
        self.register_buffer("down_packed", torch.empty(E, D, local // 8, **int32))
        self.register_buffer("down_scale", torch.empty(E, D, local // 32, **bf16))
        self.prepared = None

    def prepare(self, activation_dtype, keep_checkpoint_form=True):
        """Hand the experts to the current moe backend (once per backend switch)."""
        self.prepared = ops.prepare_moe(self.gate_up_packed, self.gate_up_scale, self.down_packed, self.down_scale,
                                        activation_dtype)
        if not keep_checkpoint_form:
            for name in ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"):
                setattr(self, name, None)


class MoE(nn.Module):
    def __init__(self, cfg, par, dtype, device):
        super().__init__()
        self.cfg = cfg
        E = cfg.n_routed_experts
        self.gate = Tensors(weight=torch.empty(E, cfg.hidden_size, dtype=dtype, device=device),
                            e_score_correction_bias=torch.empty(E, dtype=torch.float32, device=device))
        self.experts = Experts(cfg, par, device)
        self.shared_experts = DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, par,
                                       dtype, device, "shared expert intermediate")

    def norm_route(self, delta, h, norm_weight, eps):
        """The norm before this layer (`add_rms_norm` of h + delta) and the router's choice for its rows, as one
        op (`ops.norm_route`): (h, x, routing), routing (weights, ids) for `forward`."""
        cfg = self.cfg
        h, x, weights, ids = ops.norm_route(delta, h, norm_weight, eps, self.gate.weight,
                                            self.gate.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group,
                                            cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob)
        return h, x, (weights, ids)

    def forward(self, x, routing=None, summed=True):
        """The routed experts' output plus the shared expert's, or with summed=False the pair (routed, shared),
        for a caller that adds them itself (the next norm). routing: x's rows' (weights, ids) where `norm_route`
        chose them, else None (the router runs here)."""
        side = _side_stream(x.device)
        if side is None:
            routed, shared = self.routed(x, routing, not summed), self.shared_experts(x)
            return routed.add_(shared) if summed else (routed, shared)
        # The shared expert's small GEMMs leave most SMs idle; on a second stream they overlap the router and the
        # routed experts (a fork and a join inside a CUDA graph). x outlives the join, so no record_stream.
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared = self.shared_experts(x)
        routed = self.routed(x, routing, not summed)
        main.wait_stream(side)
        return routed.add_(shared) if summed else (routed, shared)

    def routed(self, x, routing=None, keep_sums=False):
        cfg = self.cfg
        if routing is None:
            routing = ops.route(x, self.gate.weight, self.gate.e_score_correction_bias, cfg.num_experts_per_tok,
                                cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob)
        weights, ids = routing
        return ops.moe(x, ids, weights, self.experts.prepared, keep_sums)


OVERLAP_SHARED_EXPERT = True  # False: the shared expert runs on the main stream (for A/B timing)
SUM_SHARED_IN_NORM = True  # False: a MoE layer adds its shared expert's output itself (for A/B timing)
_SIDE_STREAMS = {}


def cuda_index(device):
    """The index of CUDA device `device` ("cuda" alone: this thread's current device), None off the GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _side_stream(device):
    """One extra CUDA stream per device for work that overlaps the main stream; None off the GPU."""
    if device.type != "cuda" or not OVERLAP_SHARED_EXPERT:
        return None
    index = cuda_index(device)
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer, par, dtype, device):
        super().__init__()
        self.eps, self.par = cfg.rms_norm_eps, par
        self.input_layernorm = Tensors.empty((cfg.hidden_size,), dtype, device)
        self.post_attention_layernorm = Tensors.empty((cfg.hidden_size,), dtype, device)
        self.self_attn = Attention(cfg, par, dtype, device)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, par, dtype, device)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, par, dtype, device, "intermediate_size")

    def forward(self, h, delta, meta, kv):
        """The residual stream arrives as h + delta (delta: the previous layer's MLP output, or None) so that
        each residual add runs fused with the norm after it. Returns (h, delta) the same way. Unless ranks are
        joined (whose all-reduce takes one sum), a MoE layer's delta is its (routed, shared) pair, which the
        next norm sums in the same launch (`add_rms_norm`). With a q_a projection the input norm's only reader is
        the q_a/kv_a projection: both run as one op (`norm_linear`); a MoE layer's post-attention norm runs with
        its router, the norm's first reader (`MoE.norm_route`)."""
        if self.self_attn.cfg.q_lora_rank:
            h, down = norm_linear(delta, h, self.input_layernorm.weight, self.eps, self.self_attn.down_proj_weight)
            attn = self.self_attn.attend(down, meta, kv)
        else:
            if delta is None:
                x = ops.rms_norm(h, self.input_layernorm.weight, self.eps)
            else:
                h, x = add_rms_norm(delta, h, self.input_layernorm.weight, self.eps)
            attn = self.self_attn(x, meta, kv)
        attn = self.par.all_reduce(attn)
        if not isinstance(self.mlp, MoE):
            h, x = ops.add_rms_norm(attn, h, self.post_attention_layernorm.weight, self.eps)
            return h, self.par.all_reduce(self.mlp(x))
        h, x, routing = self.mlp.norm_route(attn, h, self.post_attention_layernorm.weight, self.eps)
        if not self.par.joined and SUM_SHARED_IN_NORM:
            return h, self.mlp(x, routing, summed=False)
        return h, self.par.all_reduce(self.mlp(x, routing))


def add_rms_norm(delta, h, weight, eps):
    """ops.add_rms_norm of h + delta, where delta is a tensor or a MoE's (routed, shared) pair (summed first)."""
    if isinstance(delta, tuple):
        return ops.add_rms_norm(delta[0], h, weight, eps, extra=delta[1])
    return ops.add_rms_norm(delta, h, weight, eps)


def norm_linear(delta, h, norm_weight, eps, weight):
    """ops.norm_linear of h + delta (delta: None, a tensor or a MoE's (routed, shared) pair) -> (h, projection)."""
    if delta is None:
        return ops.norm_linear(h, norm_weight, eps, weight)
    if isinstance(delta, tuple):
        return ops.norm_linear(delta[0], norm_weight, eps, weight, residual=h, extra=delta[1])
    return ops.norm_linear(delta, norm_weight, eps, weight, residual=h)


@dataclass
class StepMeta:
    """What every layer needs to place and mask the T new tokens of each of B sequences."""

    B: int
    T: int
    positions: torch.Tensor  # [B*T] int64
    starts: torch.Tensor  # [B] int32: where the new tokens go in the cache
    lens_after: torch.Tensor  # [B] int32: starts + T
    tree_mask: torch.Tensor | None  # [B, T, ceil(T/32)] int32, None = causal


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, R, vocab (this rank's slice unless ranks are joined)]
    hidden: torch.Tensor | None  # [B, T, len(hidden_layers) * D]: outputs of the requested layers


class KimiModel(nn.Module):
    def __init__(self, cfg, parallel=None, dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.cfg, self.par = cfg, parallel or Parallel()
        self.dtype, self.device = dtype, torch.device(device)
        V, D = cfg.vocab_size, cfg.hidden_size
        _, v_local = self.par.shard(V, "vocab_size")
        self.embed_tokens = Tensors.empty((V, D), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.par, dtype, device) for i in range(cfg.num_hidden_layers))
        self.norm = Tensors.empty((D,), dtype, device)
        self.lm_head = Tensors.empty((v_local, D), dtype, device)

    def moe_layers(self):
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def prepare(self, keep_checkpoint_form=True):
        """Lay the experts out for the current moe backend; call again after switching it."""
        for moe in self.moe_layers():
            moe.experts.prepare(self.dtype, keep_checkpoint_form)
        return self

    def new_cache(self, batch, max_len, dtype=None):
        return LatentCache.for_model(self.cfg, batch, max_len, dtype or self.dtype, self.device)

    @torch.no_grad()
    def forward(self, tokens, positions, cache, tree_mask=None, logit_rows=None, hidden_layers=()):
        """Run T new tokens per sequence through the model, writing their cache entries (not committing them).

        tokens, positions: [B, T] int64; cache: LatentCache whose `lens` says where the tokens go; tree_mask:
        [B, T, ceil(T/32)] int32 (None = causal); logit_rows: [B, R] int64 rows of T to score (None = all);
        hidden_layers: layer indices whose outputs to return, concatenated in that order.
        """
        B, T = tokens.shape
        if positions.shape != tokens.shape:
            raise ValueError(f"forward: positions {tuple(positions.shape)} do not match tokens {tuple(tokens.shape)}")
        if B > cache.batch:
            raise ValueError(f"forward: batch {B} exceeds the cache's {cache.batch} rows")
        bad = [i for i in hidden_layers if not 0 <= i < self.cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"forward: hidden_layers {bad} out of range 0..{self.cfg.num_hidden_layers - 1}")
        cache.check_room(T, range(B))
        starts = cache.lens[:B]
        meta = StepMeta(B, T, positions.reshape(-1), starts, starts + T, tree_mask)
        h, delta = F.embedding(tokens.reshape(-1), self.embed_tokens.weight), None
        kept = {}
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, meta, cache.kv[i])
            if i in hidden_layers:
                # h + delta, rounded as the next norm does it, in one launch (its normed output is unused)
                kept[i] = add_rms_norm(delta, h, self.norm.weight, self.cfg.rms_norm_eps)[0]
        eps = self.cfg.rms_norm_eps
        if logit_rows is None:  # the final norm's only reader is the lm_head: one op
            logits = norm_linear(delta, h, self.norm.weight, eps, self.lm_head.weight)[1].view(B, T, -1)
        else:
            h = add_rms_norm(delta, h, self.norm.weight, eps)[1].view(B, T, -1)
            h = h.gather(1, logit_rows[..., None].expand(-1, -1, h.shape[-1]))
            logits = ops.linear(h, self.lm_head.weight)
        logits = self.par.all_gather_last(logits)
        hidden = torch.cat([kept[i] for i in hidden_layers], -1).view(B, T, -1) if hidden_layers else None
        return ForwardOutput(logits, hidden)

    def init_random_(self, seed=0, std=0.02):
        """Fill every weight with seeded random values (benchmarks and tests without a checkpoint)."""
        return fill_random_(self, seed, std)


@torch.no_grad()
def fill_random_(module, seed=0, std=0.02):
    """Fill the persistent buffers of `module` (a model or a drafter) with seeded random values: INT4 words,
    small positive scales, norms near 1, a small router bias, other weights N(0, std^2)."""
    gen = torch.Generator(device=module.device).manual_seed(seed)
    like = dict(generator=gen, device=module.device)
    for name, buf in module.state_dict(keep_vars=True).items():  # persistent buffers (not joint views)
        if buf is None:
            continue
        if name.endswith("_packed"):
            src = torch.randint(-2**31, 2**31, buf.shape, dtype=torch.int64, **like).to(torch.int32)
        elif name.endswith("_scale"):
            src = torch.rand(buf.shape, **like) * 0.004 + 0.001
        elif "norm" in name:
            src = 1.0 + 0.1 * torch.randn(buf.shape, **like)
        elif name.endswith("e_score_correction_bias"):
            src = 0.1 * torch.randn(buf.shape, **like)
        else:
            src = std * torch.randn(buf.shape, **like)
        buf.copy_(src)
    return module
