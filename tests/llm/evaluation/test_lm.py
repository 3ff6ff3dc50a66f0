"""Token-level helpers both adapters share: special prefixes, context/continuation split, truncation, stops."""

from __future__ import annotations

import pytest

from mindspeed_llm.evaluation.lm import (
    encode_context,
    encode_pair,
    eos_token_ids,
    fit_prompt,
    fit_request,
    special_prefix,
    stop_strings,
    truncate_at_stop,
)


def _word_tokenizer(bos: bool):
    """A word-level fast tokenizer that puts <s> first when ``bos`` (as Llama's does), nothing otherwise."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("Answer : A B C D the cat".split())}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    if bos:
        tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_special_prefix_and_pairs() -> None:
    with_bos, plain = _word_tokenizer(True), _word_tokenizer(False)
    assert special_prefix(with_bos) == [1] and special_prefix(plain) == []
    ids = plain("the cat Answer :", add_special_tokens=False)["input_ids"]
    assert encode_context(with_bos, "the cat Answer :") == [1, *ids]
    assert encode_pair(with_bos, "the cat Answer :", " B") == ([1, *ids], [plain.convert_tokens_to_ids("B")])
    # A space ending the context belongs to the continuation.
    assert encode_pair(plain, "the cat Answer : ", "B") == encode_pair(plain, "the cat Answer :", " B")


def test_demo_bpe_split_matches_whole_string(demo_tok_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_tok_dir), local_files_only=True)
    context, continuation = encode_pair(tok, "Question: what?\nAnswer:", " C")
    assert context + continuation == tok("Question: what?\nAnswer: C")["input_ids"] and len(continuation) == 1


def test_truncation() -> None:
    assert fit_request([1, 2, 3], [4, 5], 10) == ([1, 2, 3, 4, 5], 2)
    assert fit_request([1, 2, 3], [4, 5], 3) == ([3, 4, 5], 2)  # context loses its left tokens
    assert fit_request([1], [2, 3, 4, 5], 3) == ([3, 4, 5], 2)  # only what has a token before it is scored
    with pytest.raises(ValueError, match="non-empty context"):
        fit_request([], [1], 4)
    assert fit_prompt([1, 2, 3, 4], max_new_tokens=2, max_seq_len=4) == [3, 4]
    with pytest.raises(ValueError, match="--max-new-tokens 4 leaves no room"):
        fit_prompt([1], max_new_tokens=4, max_seq_len=4)


def test_stops() -> None:
    tok = _word_tokenizer(False)
    assert eos_token_ids(tok, [2, 7], None, 9) == (2, 7, 9)
    assert stop_strings(tok, ["Question:"], (2,)) == ["Question:", "</s>"]
    assert truncate_at_stop("12 apples</s>Question: more", ["Question:", "</s>"]) == "12 apples"
    assert truncate_at_stop("no stop here", ["Question:"]) == "no stop here"
