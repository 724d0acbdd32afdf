"""Training a small K2.6-shaped target from scratch (the embedded default model's target).

`KimiModel` is an inference module (weights are buffers, routed experts packed INT4, the forward writes a
latent cache), so training runs on `TrainableTarget`: the same architecture with float parameters under the
checkpoint's names, whose forward is built from the ops' torch references (differentiable) and computes MLA in
its expanded form, which equals the absorbed form the inference model runs. Routed experts are trained through
the exact INT4 group-32 quantiser the checkpoint writer uses (straight-through gradients), so the exported
checkpoint holds the weights the training forward used. `export` writes the K2.6 on-disk format through
`model.checkpoint_writer`; a test checks that the loaded checkpoint's logits equal this forward's.

Routing is DeepSeek-V3's auxiliary-loss-free balancing: after each step every MoE layer's
`e_score_correction_bias` moves by `BIAS_RATE` towards experts that received fewer tokens than the mean.
"""

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.checkpoint import GROUP
from model.checkpoint_writer import write_checkpoint
from ops.mlp import mlp_torch
from ops.moe import route_torch
from ops.norm import rms_norm_torch
from ops.rope import apply_rope_torch, yarn_inv_freq

BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed for auxiliary-loss-free load balancing


def fake_int4(w):
    """w quantised and dequantised as `model.checkpoint.quantize_int4` does (symmetric INT4, groups of 32 along
    the last dim, bf16 scales), with straight-through gradients. w: [..., N, K] float."""
    groups = w.detach().float().unflatten(-1, (-1, GROUP))
    absmax = groups.abs().amax(-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 7, torch.ones_like(absmax)).to(torch.bfloat16).float()
    deq = (torch.round(groups / scale).clamp(-8, 7) * scale).flatten(-2)
    return w + (deq.to(w.dtype) - w).detach()


class Weight(nn.Module):
    """A leaf holding one trainable `weight`, like model.model.Tensors holds a buffer."""

    def __init__(self, *shape):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))


def _no_autocast(device):
    return torch.autocast(device.type, enabled=False)


class TrainAttention(nn.Module):
    """MLA, expanded: per-head keys [W_UK c ; rope(k_pe)] and values W_UV c, one causal attention."""

    def __init__(self, cfg):
        super().__init__()
        D, H, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
        if not cfg.q_lora_rank:
            raise ValueError("TrainableTarget: the default model's target uses a q LoRA (q_lora_rank > 0)")
        self.cfg = cfg
        self.q_a_proj = Weight(cfg.q_lora_rank, D)
        self.q_a_layernorm = Weight(cfg.q_lora_rank)
        self.q_b_proj = Weight(H * cfg.qk_head_dim, cfg.q_lora_rank)
        self.kv_a_proj_with_mqa = Weight(cfg.cache_entry_dim, D)
        self.kv_a_layernorm = Weight(R)
        self.kv_b_proj = Weight(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), R)
        self.o_proj = Weight(D, H * cfg.v_head_dim)
        inv_freq, self.rope_factor = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, x, positions):
        """x: [B, T, heads, 64] -> the interleaved-pair RoPE of the checkpoint (as the latent cache stores k_pe)."""
        B, T, H, P = x.shape
        return apply_rope_torch(x.reshape(B * T, H, P), positions, self.inv_freq, self.rope_factor).view(B, T, H, P)

    def forward(self, x, positions):
        cfg = self.cfg
        B, T, _ = x.shape
        H, dn, dr, dv, R = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                            cfg.kv_lora_rank)
        q = F.linear(rms_norm_torch(F.linear(x, self.q_a_proj.weight), self.q_a_layernorm.weight,
                                    cfg.latent_norm_eps), self.q_b_proj.weight).view(B, T, H, dn + dr)
        ckv = F.linear(x, self.kv_a_proj_with_mqa.weight)
        latent = rms_norm_torch(ckv[..., :R], self.kv_a_layernorm.weight, cfg.latent_norm_eps)
        k_pe = self.rope(ckv[..., None, R:], positions).expand(B, T, H, dr)
        kv = F.linear(latent, self.kv_b_proj.weight).view(B, T, H, dn + dv)
        q = torch.cat([q[..., :dn], self.rope(q[..., dn:], positions)], -1)
        k = torch.cat([kv[..., :dn], k_pe], -1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., dn:].transpose(1, 2),
                                           is_causal=True, scale=cfg.softmax_scale)
        return F.linear(o.transpose(1, 2).reshape(B, T, H * dv), self.o_proj.weight)


class TrainDenseMLP(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_up = Weight(2 * intermediate, hidden)  # gate rows then up rows, as the model stacks them
        self.down_proj = Weight(hidden, intermediate)

    def forward(self, x):
        return mlp_torch(x, self.gate_up.weight, self.down_proj.weight)


class TrainMoE(nn.Module):
    """noaux_tc routing (`route_torch`) over INT4-quantised routed experts, plus the shared expert.

    Every expert runs on every token and the router's top-k picks their outputs: for a few experts this costs
    less than sorting tokens by expert, and it never reads the device back."""

    def __init__(self, cfg):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.gate = Weight(E, D)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.experts_gate_up = nn.Parameter(torch.zeros(E, 2 * I, D))
        self.experts_down = nn.Parameter(torch.zeros(E, D, I))
        self.shared_experts = TrainDenseMLP(D, I * cfg.n_shared_experts)
        self.register_buffer("load", torch.zeros(E), persistent=False)  # tokens routed per expert since last step

    def forward(self, x):
        cfg, (B, T, D) = self.cfg, x.shape
        flat = x.reshape(B * T, D)
        with _no_autocast(x.device):  # the router runs in fp32, as the op defines it
            weights, ids = route_torch(flat, self.gate.weight, self.e_score_correction_bias, cfg.num_experts_per_tok,
                                       cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob)
        gate, up = torch.einsum("md,efd->mef", flat, fake_int4(self.experts_gate_up)).chunk(2, dim=-1)
        out = torch.einsum("mei,edi->med", F.silu(gate) * up, fake_int4(self.experts_down))  # [M, E, D]
        picked = out.gather(1, ids.long()[..., None].expand(-1, -1, D))  # [M, k, D]
        routed = (picked * weights[..., None].to(picked.dtype)).sum(1)
        self.load += torch.bincount(ids.flatten().long(), minlength=cfg.n_routed_experts).float()
        return (routed + self.shared_experts(flat)).view(B, T, D)

    @torch.no_grad()
    def balance_(self):
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded ones'."""
        self.e_score_correction_bias += BIAS_RATE * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


class TrainLayer(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = Weight(cfg.hidden_size)
        self.post_attention_layernorm = Weight(cfg.hidden_size)
        self.self_attn = TrainAttention(cfg)
        self.mlp = TrainMoE(cfg) if cfg.is_moe_layer(layer) else TrainDenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, positions):
        h = h + self.self_attn(rms_norm_torch(h, self.input_layernorm.weight, self.eps), positions)
        return h + self.mlp(rms_norm_torch(h, self.post_attention_layernorm.weight, self.eps))


class TrainableTarget(nn.Module):
    """A KimiModel's architecture with trainable float parameters; `forward(tokens)` gives causal logits."""

    def __init__(self, cfg):
        super().__init__()
        if cfg.quantization is None or not cfg.has_moe:
            raise ValueError("TrainableTarget: the config must have MoE layers with INT4 routed experts")
        self.cfg = cfg
        self.embed_tokens = Weight(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TrainLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Weight(cfg.hidden_size)
        self.lm_head = Weight(cfg.vocab_size, cfg.hidden_size)

    def forward(self, tokens):
        """tokens: [B, T] int64 starting at position 0 -> logits [B, T, vocab]."""
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device).repeat(B)
        h = F.embedding(tokens, self.embed_tokens.weight)
        for layer in self.layers:
            h = layer(h, positions)
        return F.linear(rms_norm_torch(h, self.norm.weight, self.cfg.rms_norm_eps), self.lm_head.weight)

    def moe_layers(self):
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, TrainMoE)]

    @torch.no_grad()
    def init_weights_(self, seed, std=0.02):
        """GPT-2 style: normal(0, std) matrices, the projections into the residual stream scaled by
        1/sqrt(2 * layers), norms 1, routing biases 0."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.ones(p.shape))
                continue
            scale = residual_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts_down")) else std
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
        for moe in self.moe_layers():
            moe.e_score_correction_bias.zero_()
        return self

    def named_tensors(self):
        """{checkpoint-style name: parameter or buffer}; dense MLPs and shared experts as `...gate_up.weight`,
        routed experts HF-stacked (`...mlp.experts.gate_up_proj` [E, 2I, D], `...down_proj` [E, D, I])."""
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight,
               "lm_head.weight": self.lm_head.weight}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
            for name, leaf in layer.self_attn.named_children():
                out[p + f"self_attn.{name}.weight"] = leaf.weight
            mlp, p = layer.mlp, p + "mlp."
            if isinstance(mlp, TrainMoE):
                out[p + "gate.weight"] = mlp.gate.weight
                out[p + "gate.e_score_correction_bias"] = mlp.e_score_correction_bias
                out[p + "experts.gate_up_proj"] = mlp.experts_gate_up
                out[p + "experts.down_proj"] = mlp.experts_down
                mlp, p = mlp.shared_experts, p + "shared_experts."
            out[p + "gate_up.weight"] = mlp.gate_up.weight
            out[p + "down_proj.weight"] = mlp.down_proj.weight
        return out

    def checkpoint_tensors(self):
        """fp32 CPU copies under the names `model.checkpoint_writer.write_checkpoint` takes."""
        out = {}
        for name, t in self.named_tensors().items():
            if name.endswith(".gate_up.weight"):
                stem = name[: -len("gate_up.weight")]
                out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = t.chunk(2, dim=0)
            else:
                out[name] = t
        return {name: t.detach().float().cpu() for name, t in out.items()}

    @torch.no_grad()
    def load_checkpoint_tensors_(self, tensors):
        """Set every weight from tensors named as `checkpoint_tensors` gives them."""
        for name, t in self.named_tensors().items():
            if name.endswith(".gate_up.weight"):
                stem = name[: -len("gate_up.weight")]
                value = torch.cat([tensors[stem + "gate_proj.weight"], tensors[stem + "up_proj.weight"]])
            else:
                value = tensors[name]
            t.copy_(value)
        return self

    def export(self, path):
        """Write the K2.6-format checkpoint (single file) to directory `path`; afterwards this model holds
        exactly the stored values (non-expert weights rounded to bf16; experts were already trained through
        their quantiser). Returns the bytes written."""
        effective = write_checkpoint(path, self.cfg, self.checkpoint_tensors(), single_file=True)
        self.load_checkpoint_tensors_(effective)
        return sum(f.stat().st_size for f in path.iterdir())


# --- the training loop ----------------------------------------------------------------------------------------

def random_windows(stream, batch, length, seed):
    """`batch` windows of `length` + 1 tokens at offsets drawn uniformly (on the CPU, from `seed`) from a 1-D
    token stream: [batch, length + 1] on the stream's device."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=gen).to(stream.device)
    return stream[starts[:, None] + torch.arange(length + 1, device=stream.device)]


def lr_at(progress, peak, warmup):
    """Linear warm-up over the first `warmup` of training, then cosine decay to a tenth of the peak."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_target(model, stream, steps, minutes=None, batch=64, seq_len=512, lr=1.5e-3, warmup=0.03, weight_decay=0.1,
                 seed=0, log=print, log_every=100):
    """AdamW on random windows of `stream` (1-D int64 token ids on the model's device) for `steps` steps or
    `minutes` of wall time, whichever ends first (the schedule follows whichever is further along). bf16
    autocast on a GPU, fp32 on a CPU. Returns the (step, loss) logged: the first, every log_every-th, the last."""
    device = stream.device
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    flat = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": flat, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    budget = minutes * 60 if minutes else math.inf
    history, start, step = [], time.perf_counter(), 0

    def record(loss):
        history.append((step, loss.item()))
        rate = step * batch * seq_len / (time.perf_counter() - start)
        log(f"target step {step}: loss {history[-1][1]:.4f} ({history[-1][1] / math.log(2):.3f} bits/byte), "
            f"lr {opt.param_groups[0]['lr']:.2e}, {rate / 1e3:.0f}k bytes/s, {time.perf_counter() - start:.0f} s")

    while (progress := max(step / steps, (time.perf_counter() - start) / budget)) < 1:
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, lr, warmup)
        window = random_windows(stream, batch, seq_len, seed * 1_000_003 + step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for moe in model.moe_layers():
            moe.balance_()
        step += 1
        if step % log_every == 0 or step == 1:
            record(loss)
    if step and history[-1][0] != step:
        record(loss)
    return history
