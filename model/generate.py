"""Plain greedy autoregressive generation with the latent cache (the reference the speculative engine must match),
and the check every generator runs on its prompts."""

import operator

import torch

from model.tokenizer import token_id


def token_prompts(prompts, vocab_size, what="prompt"):
    """`prompts` as a list of lists of Python ints, each id in 0..vocab_size-1.

    Takes a list of token-id sequences (lists, tuples, 1-D integer tensors or arrays) or a 2-D integer tensor
    [B, T]. TypeError for anything else (a float or bool id, a float tensor, a flat list of ids, a string);
    ValueError for no prompts, an empty prompt or an id outside the vocabulary.
    """
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise TypeError(f"{what}s: a tensor of prompts must be 2-D [batch, tokens], got {prompts.dim()}-D "
                            "(one prompt: pass [ids])")
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"{what}s must be a list of token-id lists, got {type(prompts).__name__}")
    out = [_one_prompt(p, b, vocab_size, what) for b, p in enumerate(prompts)]
    if not out:
        raise ValueError(f"no {what} given")
    return out


def _one_prompt(p, b, vocab_size, what):
    if isinstance(p, torch.Tensor):
        if p.dim() != 1 or p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
            raise TypeError(f"{what} {b}: a tensor prompt must be 1-D of integers, got {p.dim()}-D {p.dtype}")
        p = p.tolist()
    elif isinstance(p, (str, bytes, dict)) or not hasattr(p, "__iter__"):
        raise TypeError(f"{what} {b} must be a sequence of token ids, got {type(p).__name__} "
                        "(prompts are a list of lists: [[ids...]])")
    try:
        ids = [token_id(t) for t in p]
    except TypeError as err:
        raise TypeError(f"{what} {b}: {err}") from None
    if not ids:
        raise ValueError(f"{what} {b} has 0 tokens (a prompt needs at least one)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} {b} has token ids outside the vocabulary of {vocab_size}: {bad[:5]}")
    return ids


def count(value, what, minimum=0):
    """`value` as an int >= minimum: TypeError for a float or a bool, ValueError below the minimum."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def greedy_generate(model, prompts, max_new_tokens, stop_ids=(), max_len=None):
    """Greedy-decode up to `max_new_tokens` tokens after each prompt; returns the new tokens per prompt.

    Each prompt is prefilled alone into cache row b; then all unfinished sequences advance one token per step
    in one batched forward, each at its own position. A sequence stops after emitting a token in `stop_ids`
    (kept in its output), after max_new_tokens, or when its max_len cache entries are used (max_len defaults to
    the longest prompt + max_new_tokens, and never passes the model's max_position_embeddings). Prompts are
    checked by `token_prompts`; one longer than max_len raises ValueError.
    """
    prompts = token_prompts(prompts, model.cfg.vocab_size)
    max_new_tokens = count(max_new_tokens, "greedy_generate: max_new_tokens")
    context = model.cfg.max_position_embeddings
    max_len = min(context, max(len(p) for p in prompts) + max_new_tokens if max_len is None else
                  count(max_len, "greedy_generate: max_len", 1))
    stop = {token_id(t) for t in stop_ids}
    for b, p in enumerate(prompts):
        if len(p) > max_len:
            raise ValueError(f"greedy_generate: prompt {b} has {len(p)} tokens; the cache holds 1..{max_len}")
    out = [[] for _ in prompts]
    if max_new_tokens == 0:
        return out
    cache = model.new_cache(len(prompts), max_len + 1)  # + 1: finished rows absorb the batched step's write
    device = model.device
    for b, p in enumerate(prompts):
        tokens = torch.tensor([p], dtype=torch.long, device=device)
        logits = model(tokens, torch.arange(len(p), device=device)[None], cache.row(b),
                       logit_rows=torch.tensor([[len(p) - 1]], device=device)).logits
        cache.advance([len(p) if i == b else 0 for i in range(len(prompts))])
        out[b].append(int(logits[0, -1].argmax()))
    live = [_running(out[b], stop, max_new_tokens, cache.host_lens[b], max_len) for b in range(len(prompts))]
    while any(live):
        last = torch.tensor([[seq[-1]] for seq in out], dtype=torch.long, device=device)
        # a finished row still runs (its write lands in the spare entry) at a position inside the context
        positions = torch.tensor([[min(n, max_len - 1)] for n in cache.host_lens], dtype=torch.long, device=device)
        logits = model(last, positions, cache).logits[:, -1]
        cache.advance([int(x) for x in live])
        for b, token in enumerate(logits.argmax(-1).tolist()):
            if live[b]:
                out[b].append(token)
                live[b] = _running(out[b], stop, max_new_tokens, cache.host_lens[b], max_len)
    return out


def _running(seq, stop, max_new_tokens, used, max_len):
    return len(seq) < max_new_tokens and seq[-1] not in stop and used < max_len
