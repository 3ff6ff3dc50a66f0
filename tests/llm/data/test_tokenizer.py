"""The demo tokenizer: built offline from the shipped corpus, deterministic, loadable by AutoTokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from mindspeed_llm.tokenizer import (
    DEMO_ALPACA,
    DEMO_CORPUS,
    DEMO_PAIRWISE,
    DEMO_SHAREGPT,
    DEMO_VOCAB_SIZE,
    EOS_TOKEN,
    PAD_TOKEN,
    demo_tokenizer_path,
    iter_corpus_texts,
    load_tokenizer,
    train_demo_tokenizer,
)


def test_shipped_assets_are_ascii_jsonl_of_the_promised_size() -> None:
    assert 200_000 <= DEMO_CORPUS.stat().st_size <= 1_000_000
    for path, minimum in ((DEMO_CORPUS, 300), (DEMO_ALPACA, 100), (DEMO_PAIRWISE, 50), (DEMO_SHAREGPT, 30)):
        lines = path.read_bytes().decode("ascii").splitlines()
        assert len(lines) >= minimum
        assert all(isinstance(json.loads(line), dict) for line in lines)


def test_training_is_deterministic(tmp_path) -> None:
    first = train_demo_tokenizer(tmp_path / "a")
    second = train_demo_tokenizer(tmp_path / "b")
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    vocab = json.loads((first / "tokenizer.json").read_text())["model"]["vocab"]
    assert 1000 <= len(vocab) <= DEMO_VOCAB_SIZE


def test_a_different_corpus_gives_a_different_cache_entry(tmp_path) -> None:
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of a tiny corpus"}) + "\n" for i in range(50)))
    tiny = demo_tokenizer_path(cache_dir=tmp_path / "cache", corpus=corpus, vocab_size=300)
    assert tiny != demo_tokenizer_path(cache_dir=tmp_path / "cache", corpus=corpus, vocab_size=320)
    assert demo_tokenizer_path(cache_dir=tmp_path / "cache", corpus=corpus, vocab_size=300) == tiny


def test_cached_copy_is_reused_and_loads_offline(tok_dir, demo_cache) -> None:
    stamp = (tok_dir / "tokenizer.json").stat().st_mtime_ns
    assert demo_tokenizer_path(cache_dir=demo_cache) == tok_dir
    assert (tok_dir / "tokenizer.json").stat().st_mtime_ns == stamp  # not retrained
    assert not [p for p in tok_dir.parent.iterdir() if p.name.startswith(".")]  # no temporary left
    tok = load_tokenizer("demo")  # resolves through MINDSPEED_CACHE_DIR
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN and tok.eos_token_id != tok.pad_token_id
    assert len(tok) == len(AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True))


def test_round_trip_and_chat_template(tok) -> None:
    for text in list(iter_corpus_texts(DEMO_CORPUS))[:50]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        assert len(ids) < len(text) / 2.5  # the BPE learned the corpus' words
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert tok.convert_ids_to_tokens(tok("<|im_start|>")["input_ids"]) == ["<|im_start|>"]


def test_missing_or_empty_tokenizer_directory_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist.*never downloaded"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)
