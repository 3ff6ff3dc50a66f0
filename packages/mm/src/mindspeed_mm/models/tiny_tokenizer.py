"""A tiny byte-level tokenizer with a family's special tokens, built in code (no download).

Every byte is one token (a BPE model without merges over the byte-level alphabet), followed by
the special tokens the family's chat template and placeholders use, so any text round-trips
and a tiny model's vocabulary stays a few hundred entries.
"""

from __future__ import annotations

from typing import Any


def build_byte_tokenizer(special_tokens: list[str], eos_token: str, pad_token: str, chat_template: str) -> Any:
    """A ``PreTrainedTokenizerFast`` of 256 byte tokens plus ``special_tokens`` (in that order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    tokenizer.eos_token, tokenizer.pad_token = eos_token, pad_token
    tokenizer.chat_template = chat_template
    return tokenizer
