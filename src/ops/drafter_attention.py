import torch

from ops._backend import dispatch, register


def drafter_attention(q, k_cache, v_cache, lens, max_len, scale):
    """Non-causal GQA attention of a block of queries over each sequence's first lens[b] cache entries.

    q: [B, S, H, hd]; k_cache, v_cache: [B, L_max, KVH, hd] (H a multiple of KVH; query head h reads kv head
    h // (H/KVH)); lens: [B] int32 entries visible to every query of row b (context then the block itself);
    max_len: host int >= max(lens) bounding the work without a device sync; scale: softmax scale.
    Returns [B, S, H, hd] in q's dtype.
    """
    B, S, H, hd = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] < B or k_cache.shape[-1] != hd or H % k_cache.shape[2]:
        raise ValueError(f"drafter_attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                         f"{tuple(v_cache.shape)} do not fit")
    if lens.shape != (B,) or lens.dtype != torch.int32 or not 0 < max_len <= k_cache.shape[1]:
        raise ValueError(f"drafter_attention: lens {tuple(lens.shape)} {lens.dtype} / max_len {max_len} do not fit")
    return dispatch("drafter_attention", q.device)(q, k_cache, v_cache, lens, max_len, scale)


def drafter_attention_torch(q, k_cache, v_cache, lens, max_len, scale):
    """Each key/value head's query heads and block rows fold into one [G*S, hd] matrix, so the context is read
    by two batched GEMMs that keep every SM streaming it (a flash-attention forward parallelises over heads and
    64-query tiles only: a few programs for one TP8 rank's block). On CUDA, half inputs go into the GEMMs as
    they are, with fp32 accumulation, scores and softmax, and the probabilities are rounded to the input dtype
    for the second GEMM, as flash attention does; elsewhere all of it is fp32. Temporaries: the [G*S, M] scores
    and probabilities per key/value head."""
    B, S, H, hd = q.shape
    kvh = k_cache.shape[2]
    group = H // kvh
    half = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    dtype = q.dtype if half else torch.float32
    k = k_cache[:B, :max_len].transpose(1, 2).to(dtype).reshape(B * kvh, max_len, hd)
    v = v_cache[:B, :max_len].transpose(1, 2).to(dtype).reshape(B * kvh, max_len, hd)
    rows = q.view(B, S, kvh, group, hd).permute(0, 2, 3, 1, 4).reshape(B * kvh, group * S, hd).to(dtype)
    scores = bmm_fp32(rows, k.transpose(1, 2)).view(B, kvh, group * S, max_len)
    visible = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, M]
    scores = torch.where(visible[:, None, None, :], scores * scale, float("-inf"))
    probs = scores.softmax(-1).to(dtype).view(B * kvh, group * S, max_len)
    out = bmm_fp32(probs, v).view(B, kvh, group, S, hd)
    return out.permute(0, 3, 1, 2, 4).reshape(B, S, H, hd).to(q.dtype)


def bmm_fp32(a, b):
    """a @ b batched, in fp32 (half inputs on CUDA: fp32 accumulation and output without upcasting them)."""
    return torch.bmm(a, b) if a.dtype == torch.float32 else torch.bmm(a, b, out_dtype=torch.float32)


register("drafter_attention", drafter_attention_torch)
