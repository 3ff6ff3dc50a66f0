"""The demo tokenizer: built offline from the shipped corpus, deterministic, loadable by AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

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
    tokenizer_sizes,
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


def _reference_sizes(path) -> tuple[int, int | None]:
    reference = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return len(reference), reference.eos_token_id


def test_sizes_without_transformers_match_autotokenizer(tok_dir, tmp_path) -> None:
    assert tokenizer_sizes(tok_dir) == _reference_sizes(tok_dir)
    # the eos token in its dict form, and the config split over special_tokens_map.json
    variant = tmp_path / "dict_eos"
    shutil.copytree(tok_dir, variant)
    config = json.loads((variant / "tokenizer_config.json").read_text())
    eos = config.pop("eos_token")
    (variant / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": eos, "special": True}}))
    (variant / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_sizes(variant) == _reference_sizes(variant) == tokenizer_sizes(tok_dir)
    # read without importing transformers (the ~180 MB the pretrain benchmark's peak RSS saves)
    code = f"import sys; from mindspeed_llm.tokenizer import tokenizer_sizes; print(tokenizer_sizes({str(tok_dir)!r})); print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == [str(tokenizer_sizes(tok_dir)), "False"]


def test_sizes_of_a_token_transformers_adds_come_from_transformers(tok_dir, tmp_path) -> None:
    variant = tmp_path / "new_eos"
    shutil.copytree(tok_dir, variant)
    config = json.loads((variant / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|a_token_not_in_the_vocabulary|>"
    (variant / "tokenizer_config.json").write_text(json.dumps(config))
    sizes = tokenizer_sizes(variant)
    assert sizes == _reference_sizes(variant)
    assert sizes[1] is not None and sizes != tokenizer_sizes(tok_dir)
