"""Prompt files (jsonl, json, parquet, map_keys), prompt formats, encoding, the batch sampler."""

from __future__ import annotations

import json

import pytest

from mindspeed_rl.data import PromptFormat, PromptSampler, encode_prompts, load_prompts, read_records


@pytest.fixture(scope="module")
def tokenizer():
    from mindspeed_llm.tokenizer import load_tokenizer

    return load_tokenizer("demo")


def test_jsonl_json_parquet_and_map_keys(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"problem": "1+1?", "solution": "#### 2", "level": 1},
        {"problem": "2+2?", "solution": "#### 4", "level": 2},
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "a.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    keys = {"prompt": "problem", "reference": "solution"}
    for suffix in ("jsonl", "json", "parquet"):
        assert read_records(tmp_path / f"a.{suffix}") == rows
        records = load_prompts(tmp_path / f"a.{suffix}", map_keys=keys)
        assert [(r.prompt, r.reference, r.index, r.extra) for r in records] == [
            ("1+1?", "#### 2", 0, {"level": 1}),
            ("2+2?", "#### 4", 1, {"level": 2}),
        ]
    no_reference = load_prompts(tmp_path / "a.jsonl", map_keys={"prompt": "problem", "reference": "nothing"})
    assert [r.reference for r in no_reference] == [None, None]
    demo = load_prompts("demo", limit=3)
    assert len(demo) == 3 and demo[0].prompt.startswith("What is ") and "####" in demo[0].reference


def test_bad_files_name_the_problem(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(ValueError, match="unsupported format '.csv'"):
        load_prompts(tmp_path / "a.csv")
    (tmp_path / "b.jsonl").write_text('{"question": "q", "answer": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"b.jsonl:2: not valid JSON"):
        load_prompts(tmp_path / "b.jsonl")
    (tmp_path / "c.jsonl").write_text('{"text": "q"}\n')
    with pytest.raises(ValueError, match="no text field 'question'.*data.map_keys.prompt"):
        load_prompts(tmp_path / "c.jsonl")
    (tmp_path / "d.jsonl").write_text('{"question": "q", "answer": "1"}\n{"question": "q2"}\n')
    with pytest.raises(ValueError, match="record 1 has no 'answer'"):
        load_prompts(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match="unknown key"):
        load_prompts("demo", map_keys={"response": "answer"})


def test_chat_and_plain_formats(tokenizer) -> None:
    chat = PromptFormat(style="chat", instruction=" Answer after ####.", system="Be brief.")
    text = chat.render("What is 2 + 3?", tokenizer)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3? Answer after ####."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = PromptFormat(style="plain", template="Q: {prompt}\nA:")
    assert plain.render("What is 2 + 3?") == "Q: What is 2 + 3?\nA:"
    with pytest.raises(ValueError, match="set data.prompt_format=plain"):
        chat.render("x", None)
    with pytest.raises(ValueError, match="placeholder"):
        PromptFormat(style="plain", template="no slot")


def test_encode_drops_long_prompts(tokenizer) -> None:
    texts = [PromptFormat().render(q, tokenizer) for q in ("What is 2 + 3?", "What is " + "1 + " * 40 + "1?", "Hi")]
    ids, kept = encode_prompts(texts, tokenizer, max_length=30)
    assert kept == [0, 2]
    assert ids[0] == tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids[1]) == texts[2]
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == ids[0][0]  # special tokens parsed, not spelled out


def test_sampler_epochs_and_resume() -> None:
    sampler = PromptSampler(10, 4, seed=7)
    batches = [sampler.next_batch() for _ in range(5)]
    # two batches per epoch (the remainder of 2 is dropped), each epoch a permutation without repeats
    for epoch in range(2):
        seen = batches[2 * epoch] + batches[2 * epoch + 1]
        assert len(set(seen)) == 8
    assert batches[0:2] != batches[2:4]
    resumed = PromptSampler(10, 4, seed=7)
    fresh = PromptSampler(10, 4, seed=7)
    for _ in range(3):
        fresh.next_batch()
    resumed.load_state_dict(fresh.state_dict())
    assert [resumed.next_batch() for _ in range(2)] == batches[3:5]
    assert PromptSampler(10, 5, shuffle=False).next_batch() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="same data and train.seed"):
        PromptSampler(10, 4, seed=8).load_state_dict(fresh.state_dict())
    with pytest.raises(ValueError, match="lower train.global_batch"):
        PromptSampler(3, 4)
