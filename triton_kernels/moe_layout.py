"""The routed experts' weights as the W4A16 kernels read them: INT4 words repacked into 256-wide slabs, in the slab
layout or K-major (README.md, MoE: the slab order and the magic-number dequantisation)."""

from dataclasses import dataclass

import torch
import triton

from triton_kernels.moe_configs import kmajor_for

GROUP, PACK = 32, 8  # K values a scale covers; nibbles a word holds
SLAB = 256  # K values per repacked slab: 32 words x 8 nibbles per column, 8 quantisation groups
SLAB_WORDS = SLAB // PACK
# Slab word w (of 32), nibble p (bits 4p) holds k = 256 * slab + SLAB_K[w][p]: group 2 (p % 4) + w // 16,
# row 2 (w % 16) + p // 4 within the group, so one mask yields a group's two adjacent rows in one register.
SLAB_K = [[(2 * (p % 4) + w // 16) * 32 + 2 * (w % 16) + p // 4 for p in range(8)] for w in range(32)]
# Magic-number dequantisation per activation dtype: MAGIC is the bit pattern of MAGIC_VALUE (bf16 128.0, fp16
# 1024.0) whose mantissa takes a nibble; WIDE when the mantissa also fits a nibble 4 bits up (fp16's 10 bits).
UNPACK = {torch.bfloat16: dict(MAGIC=0x4300, MAGIC_VALUE=128.0, WIDE=False),
          torch.float16: dict(MAGIC=0x6400, MAGIC_VALUE=1024.0, WIDE=True)}


@dataclass
class TritonExperts:
    """Routed experts repacked for the Triton kernels (KD and KI: D and I rounded up to 256; padding nibbles hold
    q = 0, padding scales 0).

    Slab layout: gate_up [E, KD/8, 2I] int32 (gate columns, then up), down [E, KI/8, D]. K-major (`kmajor`): a
    column's slab words contiguous, gate_up [E, 2I, KD/8], down [E, D, KI/8], as the swapped tiles' shared-memory
    copy orders them (16-byte cp.async). Scales in the slab layout either way: gate_up_scale [E, KD/32, 2I],
    down_scale [E, KI/32, D] (a group's scales contiguous along N).
    """

    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor
    hidden: int
    intermediate: int
    kmajor: bool = False
    backend: str = "triton"

    @property
    def num_experts(self):
        return self.gate_up.shape[0]

    @property
    def gate_up_slabs(self):
        return triton.cdiv(self.hidden, SLAB)

    @property
    def down_slabs(self):
        return triton.cdiv(self.intermediate, SLAB)


def _nibbles(packed):
    """compressed-tensors words [..., K/8] int32 -> nibbles [..., K] int32 (u = q + 8)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def _to_words(u):
    """Nibbles [..., 8] (u in [0, 16)) -> int32 words [...] with nibble p at bits 4p."""
    shifts = torch.arange(0, 32, 4, device=u.device, dtype=torch.int64)
    words = (u.to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def repack_int4(packed, scale):
    """compressed-tensors [E, N, K/8] int32 + [E, N, K/32] -> slab words [E, KP/8, N] int32 + scales [E, KP/32, N].

    KP = K rounded up to 256. Word w of slab t, column n, nibble p holds k = 256 t + SLAB_K[w][p]; padding
    nibbles hold u = 8 (q = 0) and padding scales are 0.
    """
    E, N, K = packed.shape[0], packed.shape[1], packed.shape[2] * PACK
    KP = triton.cdiv(K, SLAB) * SLAB
    index = torch.tensor(SLAB_K, device=packed.device).flatten()  # [256]: slab position -> k within the slab
    words = torch.empty((E, KP // PACK, N), dtype=torch.int32, device=packed.device)
    for e in range(E):  # one expert at a time keeps the int64 temporaries small
        u = torch.nn.functional.pad(_nibbles(packed[e]), (0, KP - K), value=8).view(N, KP // SLAB, SLAB)
        u = u[:, :, index].view(N, KP // SLAB, SLAB_WORDS, PACK)  # [N, slab, w, p]
        words[e] = _to_words(u).permute(1, 2, 0).reshape(KP // PACK, N)
    scales = torch.nn.functional.pad(scale, (0, KP // GROUP - K // GROUP)).transpose(1, 2).contiguous()
    return words, scales


def unpack_int4(words, scales, K):
    """Exact inverse of `repack_int4`: -> compressed-tensors [E, N, K/8] int32 and [E, N, K/32]."""
    E, KP8, N = words.shape
    index = torch.tensor(SLAB_K, device=words.device).flatten()
    packed = torch.empty((E, N, K // PACK), dtype=torch.int32, device=words.device)
    for e in range(E):
        u = _nibbles(words[e].view(KP8 // SLAB_WORDS, SLAB_WORDS, N).permute(2, 0, 1))  # [N, slab, 256] slab order
        k_order = torch.empty_like(u)
        k_order[:, :, index] = u
        packed[e] = _to_words(k_order.reshape(N, KP8 * PACK)[:, :K].reshape(N, K // PACK, PACK))
    return packed, scales.transpose(1, 2)[:, :, : K // GROUP].contiguous()


def prepare_moe(gate_up_packed, gate_up_scale, down_packed, down_scale, kmajor=None):
    """Repack compressed-tensors experts (see ops.prepare_moe) into `TritonExperts`, K-major or in the slab layout
    (default: the layout moe_configs.kmajor_for gives)."""
    D, I = down_packed.shape[1], gate_up_packed.shape[1] // 2
    kmajor = kmajor_for(gate_up_packed.device, I) if kmajor is None else kmajor
    gate_up, gate_up_s = repack_int4(gate_up_packed, gate_up_scale)
    down, down_s = repack_int4(down_packed, down_scale)
    if kmajor:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    return TritonExperts(gate_up, gate_up_s, down, down_s, hidden=D, intermediate=I, kmajor=kmajor)


def unprepare_moe(experts):
    """The compressed-tensors tensors `prepare_moe` was given: (gate_up_packed, gate_up_scale, down_packed,
    down_scale)."""
    gate_up, down = experts.gate_up, experts.down
    if experts.kmajor:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    return (*unpack_int4(gate_up, experts.gate_up_scale, experts.hidden),
            *unpack_int4(down, experts.down_scale, experts.intermediate))
