"""Perplexity: equal to exp(mean NLL) from transformers' own loss, also over sliding windows."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_llm.evaluation import EvalSettings, TransformersLM
from mindspeed_llm.evaluation.perplexity import PerplexityTask, read_documents, windows

from .conftest import write_text


@pytest.mark.parametrize(
    "n, max_seq_len, stride", [(1, 8, 7), (2, 8, 7), (30, 8, 7), (30, 8, 3), (30, 8, 1), (9, 8, 7)]
)
def test_windows_score_every_token_once(n, max_seq_len, stride) -> None:
    scored = []
    for start, begin, end in windows(n, max_seq_len, stride):
        assert 0 <= start < begin < end <= n and end - start <= max_seq_len and end - begin <= stride
        scored.extend(range(begin, end))
    assert scored == list(range(1, n))


def test_bad_stride_and_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="--ppl-stride 8 must be between 1 and the window length minus one"):
        windows(20, 8, 8)
    bad = tmp_path / "a.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"a.jsonl:2: expected a string field 'text'"):
        read_documents(bad)
    with pytest.raises(ValueError, match="does not exist"):
        PerplexityTask().load(tmp_path / "missing.txt", EvalSettings())
    (tmp_path / "b.csv").write_text("x")
    with pytest.raises(ValueError, match="reads .txt/.raw files"):
        read_documents(tmp_path / "b.csv")
    (tmp_path / "wiki.test.raw").write_text(" = Title = \n\n Line one .\n")
    assert read_documents(tmp_path / "wiki.test.raw") == [" = Title = \n\n Line one .\n"]


def test_whole_documents_match_transformers_loss(tmp_path, tiny_hf) -> None:
    model, tok = tiny_hf
    data = PerplexityTask().load(write_text(tmp_path / "docs.jsonl", n_docs=5), EvalSettings())
    result = PerplexityTask().run(TransformersLM(model, tok, batch_size=2), data, EvalSettings(show_progress=False))
    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for text in data.documents:
            ids = torch.tensor([tok(text)["input_ids"]])
            total_nll += float(model(ids, labels=ids).loss) * (ids.shape[1] - 1)  # loss is the mean over n - 1 labels
            total_tokens += ids.shape[1] - 1
    assert result.n == result.metrics["tokens"] == total_tokens
    assert result.metrics["nll"] == pytest.approx(total_nll / total_tokens, rel=1e-5)
    assert result.value == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-5)


@pytest.mark.parametrize("stride", [None, 5])
def test_sliding_windows_match_masked_transformers_loss(tmp_path, tiny_hf, stride) -> None:
    model, tok = tiny_hf
    max_seq_len = 16
    data = PerplexityTask().load(write_text(tmp_path / "docs.jsonl", n_docs=2, words=80), EvalSettings())
    settings = EvalSettings(ppl_stride=stride, show_progress=False)
    result = PerplexityTask().run(TransformersLM(model, tok, batch_size=4, max_seq_len=max_seq_len), data, settings)
    step = stride or max_seq_len - 1
    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for text in data.documents:
            ids = tok(text)["input_ids"]
            assert len(ids) > 2 * max_seq_len
            # Token t sits in the block of `step` scored tokens that holds it; the model sees that block
            # and the tokens before it, at most max_seq_len in all. transformers' loss on labels masked
            # with -100 outside the block gives the block's mean NLL.
            for begin in range(1, len(ids), step):
                end = min(begin + step, len(ids))
                start = max(0, end - max_seq_len)
                inputs = torch.tensor([ids[start:end]])
                labels = inputs.clone()
                labels[0, : begin - start] = -100
                total_nll += float(model(inputs, labels=labels).loss) * (end - begin)
                total_tokens += end - begin
    assert result.n == total_tokens == sum(len(tok(t)["input_ids"]) - 1 for t in data.documents)
    assert result.value == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-5)
