import torch

from ops._backend import dispatch, register
from ops._checks import check_dims, check_dtype

LATENT_DIM = 512  # kv_lora_rank: the value part of a cache entry


def mla_attention(q, kv_cache, cache_lens, tree_mask, scale, value_dim=LATENT_DIM):
    """Absorbed MLA: multi-query attention of T new tokens x H heads over one sequence's latent cache.

    q: [B, T, H, 576] = [q_lat (512) ; q_pe (64)] per token and head (value_dim=512 of the 576 for K2.6).
    kv_cache: [B, L_max, 576] this layer's cache, [c (512) ; k_pe (64)] per entry; sequence b is row b.
    cache_lens: [B] int32, valid entries of sequence b *including* the T new tokens, which sit at
        positions cache_lens[b] - T .. cache_lens[b] - 1 (new token t at cache_lens[b] - T + t).
    tree_mask: [B, T, ceil(T/32)] int32 or None. Bit j%32 of word j//32 of row t says whether token t sees new
        token j. None means causal among the new tokens (prefill). Every earlier entry is always visible.
    scale: softmax scale. Returns [B, T, H, value_dim] in q's dtype: sum_j softmax_j(q . k_j * scale) c_j,
    c_j the first value_dim values of entry j.
    """
    check_dims("q", q, 4)
    check_dims("kv_cache", kv_cache, 3)
    if q.shape[-1] != kv_cache.shape[-1] or kv_cache.shape[-1] <= value_dim:
        raise ValueError(f"mla_attention: q {tuple(q.shape)} and kv_cache {tuple(kv_cache.shape)} entry dims differ")
    if kv_cache.shape[0] < q.shape[0] or cache_lens.shape != (q.shape[0],):
        raise ValueError(
            f"mla_attention: batch of q {q.shape[0]}, kv_cache {kv_cache.shape[0]}, cache_lens "
            f"{tuple(cache_lens.shape)} do not fit"
        )
    check_dtype("cache_lens", cache_lens, torch.int32)
    if tree_mask is not None:
        words = (q.shape[1] + 31) // 32
        if tree_mask.shape != (q.shape[0], q.shape[1], words):
            raise ValueError(f"tree_mask: expected {(q.shape[0], q.shape[1], words)}, got {tuple(tree_mask.shape)}")
        check_dtype("tree_mask", tree_mask, torch.int32)
    return dispatch("attention", q.device, q.dtype)(q, kv_cache, cache_lens, tree_mask, scale, value_dim)


def tree_mask_dense(tree_mask, T):
    """Unpack [B, T, W] int32 bit words into a [B, T, T] bool matrix (reference and tests)."""
    j = torch.arange(T, device=tree_mask.device)
    words = tree_mask.long()[..., j // 32]  # [B, T, T]
    return ((words >> (j % 32)) & 1).bool()


def pack_tree_mask(dense):
    """Pack a [B, T, T] bool visibility matrix into [B, T, ceil(T/32)] int32 words."""
    B, T, _ = dense.shape
    W = (T + 31) // 32
    padded = torch.zeros(B, T, W * 32, dtype=torch.int64, device=dense.device)
    padded[..., :T] = dense.long()
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=dense.device), torch.arange(32, device=dense.device))
    words = (padded.view(B, T, W, 32) * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def mla_attention_torch(q, kv_cache, cache_lens, tree_mask, scale, value_dim=LATENT_DIM):
    B, T, H, _ = q.shape
    out = torch.empty(B, T, H, value_dim, dtype=q.dtype, device=q.device)
    lens = cache_lens.tolist()
    if tree_mask is None:
        new_visible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril().expand(B, T, T)
    else:
        new_visible = tree_mask_dense(tree_mask, T)
    for b in range(B):
        length = lens[b]
        if length < T:
            raise ValueError(f"mla_attention: cache_lens[{b}] = {length} is shorter than the {T} new tokens")
        keys = kv_cache[b, :length].float()  # [L, 576]
        scores = torch.einsum("thd,ld->htl", q[b].float(), keys) * scale  # [H, T, L]
        visible = torch.ones(T, length, dtype=torch.bool, device=q.device)
        visible[:, length - T :] = new_visible[b]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = scores.softmax(-1)
        out[b] = torch.einsum("htl,ld->thd", probs, keys[:, :value_dim]).to(q.dtype)
    return out


def write_kv(kv_cache, entries, starts):
    """Write T new cache entries per sequence: kv_cache[b, starts[b] + t] = entries[b, t].

    kv_cache: [B, L_max, 576]; entries: [B, T, 576]; starts: [B] int32 or int64. In place, no host sync.
    """
    if entries.dim() != 3 or entries.shape[-1] != kv_cache.shape[-1] or starts.shape != entries.shape[:1]:
        raise ValueError(
            f"write_kv: kv_cache {tuple(kv_cache.shape)}, entries {tuple(entries.shape)}, starts "
            f"{tuple(starts.shape)} do not fit [B, L, D], [B, T, D], [B]"
        )
    return dispatch("write_kv", kv_cache.device)(kv_cache, entries, starts)


def write_kv_torch(kv_cache, entries, starts):
    B, T, _ = entries.shape
    rows = torch.arange(B, device=entries.device)[:, None].expand(B, T)
    cols = starts.long()[:, None] + torch.arange(T, device=entries.device)[None, :]
    kv_cache[rows, cols] = entries.to(kv_cache.dtype)


register("attention", mla_attention_torch, "triton_kernels.mla_attention:mla_attention",
         triton_dtypes=(torch.float16, torch.bfloat16))
register("write_kv", write_kv_torch, "triton_kernels.mla_attention:write_kv")
