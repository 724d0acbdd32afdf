"""Tokenizers: Kimi's tiktoken BPE (`tiktoken.model` + 256 reserved specials) and a byte fallback for tiny models.

Both share the special-token handling and the Kimi chat format:
`<|im_system|>system<|im_middle|>...<|im_end|><|im_user|>user<|im_middle|>...<|im_end|>` then, for generation,
`<|im_assistant|>assistant<|im_middle|>`; generation stops at `<|im_end|>` (or `[EOS]`).
"""

import base64
import operator
import os
import re
from pathlib import Path

import tiktoken

from model.config import describe, read_json, regular_file

# Kimi's pre-tokenizer (tokenization_kimi.py of the K2 / K2.5 / K2.6 repositories): Han runs split off first,
# letters without Han, numbers in runs of at most three, punctuation, newlines, whitespace.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_RESERVED = 256
# Offsets from the first special id (163584 in K2.6) of the specials Kimi names; the rest are reserved.
KIMI_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>",
    20: "<|media_end|>", 21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
ROLE_TOKENS = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}
# tiktoken fails on very long inputs: encode at most this many characters at a time, cutting only where a
# run of whitespace / non-whitespace is longer than MAX_RUN (a pre-token boundary anyway for real text).
MAX_CHUNK = 400_000
MAX_RUN = 25_000


class Tokenizer:
    """Special tokens, encode/decode around them, and the chat template; subclasses encode plain text."""

    def __init__(self, specials):
        self.specials = dict(specials)  # name -> id
        self.special_names = {i: name for name, i in self.specials.items()}
        self._special_re = re.compile("|".join(re.escape(n) for n in sorted(self.specials, key=len, reverse=True)))

    def special_id(self, name):
        if name not in self.specials:
            raise ValueError(f"tokenizer: no special token {name!r}")
        return self.specials[name]

    @property
    def bos_id(self):
        return self.special_id("[BOS]")

    @property
    def eos_id(self):
        return self.special_id("[EOS]")

    @property
    def im_end_id(self):
        return self.special_id("<|im_end|>")

    @property
    def pad_id(self):
        return self.special_id("[PAD]")

    @property
    def stop_ids(self):
        return (self.im_end_id, self.eos_id)

    def encode(self, text, allow_special=False):
        """Token ids of `text`, all of it plain text by default; with allow_special=True the names of special
        tokens in it (`<|im_end|>`) become their ids: only for trusted text, never for a user's."""
        if not isinstance(text, str):
            raise TypeError(f"tokenizer: encode takes a str, got {type(text).__name__}")
        if not allow_special:
            return self.encode_ordinary(text)
        ids, start = [], 0
        for m in self._special_re.finditer(text):
            ids += self.encode_ordinary(text[start : m.start()]) + [self.specials[m[0]]]
            start = m.end()
        return ids + self.encode_ordinary(text[start:])

    def decode(self, ids, skip_special=False):
        """Text of `ids` (integers: a float id is a TypeError, not truncated); bytes that are not UTF-8 show
        as U+FFFD."""
        parts = []
        for i in ids:
            i = token_id(i)
            if i in self.special_names:
                if not skip_special:
                    parts.append(self.special_names[i].encode())
            else:
                parts.append(self.token_bytes(i))
        return b"".join(parts).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        """Token ids of a conversation in Kimi's chat format; contents are encoded as plain text, so a special
        token's name inside a message stays text. messages: [{"role": system|user|assistant, "content": str,
        optional "name": shown instead of the role}]."""
        ids = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content") or "", str) or \
                    not isinstance(m.get("name") or "", str):
                raise TypeError(f"chat template: a message is a dict with str role, content and name, got {m!r:.80}")
            if m.get("role") not in ROLE_TOKENS:
                raise ValueError(f"chat template: unknown role {m.get('role')!r} "
                                 f"(want one of {', '.join(ROLE_TOKENS)})")
            ids += self._header(m["role"], m.get("name") or m["role"])
            ids += self.encode_ordinary(m.get("content") or "") + [self.im_end_id]
        if add_generation_prompt:
            ids += self._header("assistant", "assistant")
        return ids

    def _header(self, role, name):
        return [self.special_id(ROLE_TOKENS[role])] + self.encode_ordinary(name) + [self.special_id("<|im_middle|>")]

    def encode_ordinary(self, text):
        raise NotImplementedError

    def token_bytes(self, i):
        raise NotImplementedError


class KimiTokenizer(Tokenizer):
    """Kimi's tiktoken BPE: ranks from `tiktoken.model`, then 256 specials (named from tokenizer_config.json's
    added_tokens_decoder when present, else Kimi's standard names; unnamed ones `<|reserved_token_{id}|>`)."""

    def __init__(self, ranks, specials):
        super().__init__(specials)
        self.encoding = tiktoken.Encoding(name="kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=self.specials)
        self.vocab_size = len(ranks) + NUM_RESERVED

    @classmethod
    def from_dir(cls, path):
        path = Path(path)
        ranks = load_ranks(path / "tiktoken.model")
        base = len(ranks)
        names = {base + off: name for off, name in KIMI_SPECIALS.items()}
        names.update(_config_specials(path / "tokenizer_config.json", base))
        specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_RESERVED)}
        return cls(ranks, specials)

    def encode_ordinary(self, text):
        ids = []
        for chunk in _chunks(text):
            ids += self.encoding.encode_ordinary(chunk)
        return ids

    def token_bytes(self, i):
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"tokenizer: id {i} is outside the vocabulary of {self.vocab_size}")
        return self.encoding.decode_single_token_bytes(i)


def load_ranks(file):
    """Parse a tiktoken rank file: one `<base64 token> <rank>` per line, ranks 0..n-1 each used once."""
    regular_file(file, "tokenizer")
    ranks = {}
    for n, line in enumerate(Path(file).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"tokenizer: {file} line {n} is not '<base64 token> <rank>': {line[:60]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"tokenizer: {file} ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def _config_specials(file, base):
    """{id: name} of the added tokens in tokenizer_config.json within the reserved block, if the file exists."""
    if not os.path.lexists(file):
        return {}
    added = read_json(file, "tokenizer").get("added_tokens_decoder", {})
    if not isinstance(added, dict):
        raise ValueError(f"tokenizer: {file}: added_tokens_decoder must be an object, got {describe(added)}")
    out = {}
    for key, token in added.items():
        if not key.isdigit() or not isinstance(token, dict) or not isinstance(token.get("content"), str):
            raise ValueError(f"tokenizer: {file}: added_tokens_decoder.{key} must map an id to "
                             f'{{"content": "<name>", ...}}, got {describe(token)}')
        if base <= int(key) < base + NUM_RESERVED:
            out[int(key)] = token["content"]
    return out


def _chunks(text):
    """Split text for tiktoken: pieces of at most MAX_CHUNK chars, cut at the start of a whitespace or
    non-whitespace run, or inside a run longer than MAX_RUN."""
    if len(text) <= MAX_RUN:
        yield text
        return
    start, run_start, run_space = 0, 0, None
    for i, ch in enumerate(text):
        space = ch.isspace()
        if space != run_space:
            run_start, run_space = i, space
        if i - run_start >= MAX_RUN:  # an over-long run: cut inside it
            yield text[start:i]
            start = run_start = i
        elif i - start >= MAX_CHUNK:  # a long chunk: cut where the current run began
            cut = run_start if run_start > start else i
            yield text[start:cut]
            start = run_start = cut
    yield text[start:]


class ByteTokenizer(Tokenizer):
    """Bytes 0..255 are ids 0..255; the specials follow at 256.. (for tiny models without a BPE)."""

    NAMES = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
             "[UNK]", "[PAD]")

    def __init__(self, vocab_size):
        if vocab_size < 256 + len(self.NAMES):
            raise ValueError(f"ByteTokenizer: vocab_size {vocab_size} cannot hold 256 bytes + "
                             f"{len(self.NAMES)} specials")
        super().__init__({name: 256 + i for i, name in enumerate(self.NAMES)})
        self.vocab_size = vocab_size

    def encode_ordinary(self, text):
        return list(text_bytes(text))

    def token_bytes(self, i):
        if not 0 <= i < 256:
            raise ValueError(f"tokenizer: id {i} is neither a byte nor a special token")
        return bytes([i])


def token_id(value):
    """`value` as a Python int token id: ints, numpy/torch integer scalars; TypeError for a float or a bool."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        raise TypeError(f"token ids must be integers, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"token ids must be integers, got {value!r} ({type(value).__name__})") from None


def text_bytes(text):
    """The UTF-8 bytes of `text`. Undecodable bytes of a command line (kept by Python as surrogates U+DC80..
    U+DCFF) come back as the bytes they were; any other lone surrogate becomes U+FFFD, as tiktoken does."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


def load_tokenizer(model_dir, vocab_size):
    """KimiTokenizer when `model_dir` holds tiktoken.model, else ByteTokenizer(vocab_size)."""
    if model_dir is not None and os.path.lexists(Path(model_dir) / "tiktoken.model"):
        tok = KimiTokenizer.from_dir(model_dir)
        if tok.vocab_size > vocab_size:
            raise ValueError(f"tokenizer: {tok.vocab_size} tokens do not fit the model's vocab_size {vocab_size}")
        return tok
    return ByteTokenizer(vocab_size)
