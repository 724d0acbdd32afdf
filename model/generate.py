"""Plain greedy autoregressive generation with the latent cache (the reference the speculative engine must match)."""

import torch


def greedy_generate(model, prompts, max_new_tokens, stop_ids=(), max_len=None):
    """Greedy-decode up to `max_new_tokens` tokens after each prompt; returns the new tokens per prompt.

    Each prompt is prefilled alone into cache row b; then all unfinished sequences advance one token per step
    in one batched forward, each at its own position. A sequence stops after emitting a token in `stop_ids`
    (kept in its output), after max_new_tokens, or when its max_len cache entries are used (max_len defaults to
    the longest prompt + max_new_tokens). An empty prompt or one longer than max_len raises ValueError.
    """
    if not prompts or max_new_tokens < 0:
        raise ValueError(f"greedy_generate: need at least one prompt and max_new_tokens >= 0, got "
                         f"{len(prompts)} prompts, max_new_tokens {max_new_tokens}")
    max_len = max_len or max(len(p) for p in prompts) + max_new_tokens
    for b, p in enumerate(prompts):
        if not 0 < len(p) <= max_len:
            raise ValueError(f"greedy_generate: prompt {b} has {len(p)} tokens; the cache holds 1..{max_len}")
    out = [[] for _ in prompts]
    if max_new_tokens == 0:
        return out
    cache = model.new_cache(len(prompts), max_len + 1)  # + 1: finished rows absorb the batched step's write
    device, stop = model.device, set(stop_ids)
    for b, p in enumerate(prompts):
        tokens = torch.tensor([p], dtype=torch.long, device=device)
        logits = model(tokens, torch.arange(len(p), device=device)[None], cache.row(b),
                       logit_rows=torch.tensor([[len(p) - 1]], device=device)).logits
        cache.advance([len(p) if i == b else 0 for i in range(len(prompts))])
        out[b].append(int(logits[0, -1].argmax()))
    live = [_running(out[b], stop, max_new_tokens, cache.host_lens[b], max_len) for b in range(len(prompts))]
    while any(live):
        last = torch.tensor([[seq[-1]] for seq in out], dtype=torch.long, device=device)
        positions = torch.tensor([[n] for n in cache.host_lens], dtype=torch.long, device=device)
        logits = model(last, positions, cache).logits[:, -1]
        cache.advance([int(x) for x in live])
        for b, token in enumerate(logits.argmax(-1).tolist()):
            if live[b]:
                out[b].append(token)
                live[b] = _running(out[b], stop, max_new_tokens, cache.host_lens[b], max_len)
    return out


def _running(seq, stop, max_new_tokens, used, max_len):
    return len(seq) < max_new_tokens and seq[-1] not in stop and used < max_len
