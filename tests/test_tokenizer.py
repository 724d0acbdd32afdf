"""Tokenizers on a small synthetic tiktoken rank file (no network): Kimi's pre-tokenizer, specials, chat format."""

import base64
import json

import pytest

from model import tokenizer as tk
from model.tokenizer import ByteTokenizer, KimiTokenizer, load_tokenizer

HAN = "中文".encode()  # e4 b8 ad e6 96 87
# Merged tokens after the 256 bytes, lowest rank first. b"\x87a" (the end of 文 glued to "a") has the best
# rank, so it wins wherever the pre-tokenizer lets "文" and "a" share a piece.
MERGES = [b"\x87a", HAN[:2], HAN[:3], HAN[3:5], HAN[3:], HAN, b"ab", b"he", b"ll", b"llo", b"hello", b"12", b"123"]


def write_ranks(path, merges=MERGES):
    tokens = [bytes([b]) for b in range(256)] + merges
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens)))


@pytest.fixture
def kimi(tmp_path):
    write_ranks(tmp_path / "tiktoken.model")
    return KimiTokenizer.from_dir(tmp_path)


def rank(token):
    return 256 + MERGES.index(token)


def test_han_runs_are_their_own_pre_tokens(kimi):
    assert kimi.encode("中文ab") == [rank(HAN), rank(b"ab")]
    assert kimi.encode("hello") == [rank(b"hello")]
    assert kimi.encode("12345") == [rank(b"123"), ord("4"), ord("5")]  # numbers in runs of at most three


def test_specials_follow_the_ranks_with_kimi_names(kimi):
    base = 256 + len(MERGES)
    assert kimi.vocab_size == base + 256
    want = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4, "<|im_system|>": 10,
            "<|im_middle|>": 17, "[UNK]": 254, "[PAD]": 255}
    assert {name: kimi.special_id(name) - base for name in want} == want
    assert kimi.stop_ids == (base + 2, base + 1)
    assert kimi.special_id(f"<|reserved_token_{base + 5}|>") == base + 5


def test_encode_decode_roundtrip_and_special_text(kimi):
    text = "hello 中文ab, naïve café\n\t12345 <|im_end|>"
    ids = kimi.encode(text, allow_special=True)
    assert ids[-1] == kimi.im_end_id
    assert kimi.decode(ids) == text
    assert kimi.decode(ids, skip_special=True) == text[: -len("<|im_end|>")]
    plain = kimi.encode(text)  # the default: a special token's name in text stays text
    assert kimi.im_end_id not in plain and kimi.decode(plain) == text
    assert plain == kimi.encode(text, allow_special=False)


def test_chat_template_is_kimi_format(kimi):
    messages = [{"role": "system", "content": "ab"}, {"role": "user", "content": "hello <|im_end|>"}]
    ids = kimi.apply_chat_template(messages)
    assert kimi.decode(ids) == ("<|im_system|>system<|im_middle|>ab<|im_end|><|im_user|>user<|im_middle|>"
                                "hello <|im_end|><|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert ids.count(kimi.im_end_id) == 2  # the name inside a message stays text
    assert ids[-1] == kimi.special_id("<|im_middle|>")
    assert kimi.apply_chat_template(messages[:1], add_generation_prompt=False)[-1] == kimi.im_end_id
    with pytest.raises(ValueError, match="unknown role 'tool'"):
        kimi.apply_chat_template([{"role": "tool", "content": "x"}])


def test_tokenizer_config_names_override(tmp_path):
    write_ranks(tmp_path / "tiktoken.model")
    base = 256 + len(MERGES)
    added = {str(base + 5): {"content": "<|custom|>"}, str(base): {"content": "<s>"}, "3": {"content": "ignored"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    tok = KimiTokenizer.from_dir(tmp_path)
    assert tok.special_id("<|custom|>") == base + 5 and tok.special_id("<s>") == base
    assert tok.encode("<|custom|>", allow_special=True) == [base + 5]
    assert base + 5 not in tok.encode("<|custom|>")


def test_bad_rank_files_raise(tmp_path):
    (tmp_path / "tiktoken.model").write_bytes(b"YQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match="line 2 is not"):
        KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_bytes(b"YQ== 0\nYg== 5\n")
    with pytest.raises(ValueError, match="ranks are not 0..1"):
        KimiTokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        KimiTokenizer.from_dir(tmp_path / "nowhere")


def test_long_text_chunks_keep_the_text(kimi, monkeypatch):
    monkeypatch.setattr(tk, "MAX_RUN", 7)
    monkeypatch.setattr(tk, "MAX_CHUNK", 20)
    text = "ab " * 10 + "x" * 30 + " " * 16 + "hello"
    chunks = list(tk._chunks(text))
    assert "".join(chunks) == text and max(map(len, chunks)) <= 21 and len(chunks) > 3
    assert kimi.decode(kimi.encode(text)) == text


def test_byte_tokenizer_and_load_tokenizer(tmp_path):
    tok = ByteTokenizer(512)
    text = "héllo <|im_end|>"
    ids = tok.encode(text, allow_special=True)
    assert ids[:2] == [ord("h"), 0xC3] and ids[-1] == tok.im_end_id == 258 and tok.decode(ids) == text
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.apply_chat_template([{"role": "user", "content": "hi"}])) == \
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    with pytest.raises(ValueError, match="cannot hold 256 bytes"):
        ByteTokenizer(260)
    assert isinstance(load_tokenizer(tmp_path, 512), ByteTokenizer)
    assert isinstance(load_tokenizer(None, 512), ByteTokenizer)
    write_ranks(tmp_path / "tiktoken.model")
    assert isinstance(load_tokenizer(tmp_path, 1024), KimiTokenizer)
    with pytest.raises(ValueError, match="do not fit the model's vocab_size 512"):
        load_tokenizer(tmp_path, 512)
