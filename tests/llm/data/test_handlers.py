"""Each handler's output, read back with megatron-core's IndexedDataset, against the tokenizer called directly."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_llm.data import IGNORE_INDEX
from tests.llm.data.conftest import read_dataset, write_jsonl

ALPACA_SYSTEM = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def masked_prefix(labels: np.ndarray) -> int:
    """Length of the -100 prefix; asserts nothing after it is -100 (one reply per sample)."""
    n = int(np.argmax(labels != IGNORE_INDEX))
    assert (labels[:n] == IGNORE_INDEX).all() and (labels[n:] != IGNORE_INDEX).all()
    return n


def test_pretrain_documents_equal_the_tokenizer_with_eod(tmp_path, run, tok) -> None:
    texts = ["Once upon a time, a small fox lived near the river.", "   ", "7 plus 5 is 12. {braces} stay."]
    report, prefix = run(write_jsonl(tmp_path / "in.jsonl", [{"text": t, "other": 1} for t in texts]), append_eod=True)
    docs = read_dataset(prefix + "_text_document")
    expected = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts if t.strip()]
    assert [d.tolist() for d in docs] == expected
    assert docs[0].dtype == np.uint16  # vocab < 65500: megatron's optimal dtype
    assert (report.records, report.samples, report.skipped_empty) == (3, 2, 1)
    assert report.tokens == sum(map(len, expected))


def test_pretrain_several_json_keys_and_a_renamed_column(tmp_path, run, tok) -> None:
    rows = [
        {"title": "The owl", "body": "An owl sat on a branch."},
        {"title": "Bread", "body": "Bread is made from flour."},
    ]
    _, prefix = run(write_jsonl(tmp_path / "in.jsonl", rows), json_keys=["title", "text"], map_keys={"text": "body"})
    assert [d.tolist() for d in read_dataset(prefix + "_title_document")] == [
        tok(r["title"])["input_ids"] for r in rows
    ]
    assert [d.tolist() for d in read_dataset(prefix + "_text_document")] == [tok(r["body"])["input_ids"] for r in rows]


def test_alpaca_instruction_with_a_prompt_type(tmp_path, run, tok) -> None:
    rows = [
        {"instruction": "Write the word backwards.", "input": "garden", "output": "nedrag"},
        {
            "instruction": "What is 2 plus 3?",
            "output": "2 plus 3 is 5.",
            "system": "Be brief.",
            "history": [["Hello {there}", "Hi."]],
        },
    ]
    _, prefix = run(
        write_jsonl(tmp_path / "in.jsonl", rows), handler_name="AlpacaStyleInstructionHandler", prompt_type="alpaca"
    )
    got = {k: read_dataset(f"{prefix}_packed_{k}_document") for k in ("input_ids", "attention_mask", "labels")}
    eos = tok.eos_token_id
    # Independent rendering of the alpaca template: each prompt and reply tokenized on its own.
    p0 = ids(tok, f"{ALPACA_SYSTEM}\n\n### Instruction:\nWrite the word backwards.\ngarden\n\n### Response:\n")
    r0 = ids(tok, "nedrag") + [eos]
    p1a = ids(tok, "Be brief.\n\n### Instruction:\nHello {there}\n\n### Response:\n")
    r1a = ids(tok, "Hi.") + [eos]
    p1b = ids(tok, "\n\n### Instruction:\nWhat is 2 plus 3?\n\n### Response:\n")
    r1b = ids(tok, "2 plus 3 is 5.") + [eos]
    assert got["input_ids"][0].tolist() == p0 + r0
    assert got["labels"][0].tolist() == [IGNORE_INDEX] * len(p0) + r0
    assert got["input_ids"][1].tolist() == p1a + r1a + p1b + r1b
    assert got["labels"][1].tolist() == [IGNORE_INDEX] * len(p1a) + r1a + [IGNORE_INDEX] * len(p1b) + r1b
    assert all((m == 1).all() and len(m) == len(i) for m, i in zip(got["attention_mask"], got["input_ids"]))


def test_alpaca_instruction_with_the_tokenizers_chat_template(tmp_path, run, tok) -> None:
    row = {"instruction": "Sort these numbers.", "input": "3, 1, 2", "output": "1, 2, 3"}
    _, prefix = run(write_jsonl(tmp_path / "in.jsonl", [row]), handler_name="AlpacaStyleInstructionHandler")
    input_ids = read_dataset(prefix + "_packed_input_ids_document")[0]
    labels = read_dataset(prefix + "_packed_labels_document")[0]
    messages = [
        {"role": "user", "content": "Sort these numbers.\n3, 1, 2"},
        {"role": "assistant", "content": "1, 2, 3"},
    ]
    assert input_ids.tolist() == ids(tok, tok.apply_chat_template(messages, tokenize=False))
    n = masked_prefix(labels)
    assert tok.decode(input_ids[:n]) == tok.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(labels[n:]) == "1, 2, 3<|im_end|>\n"
    assert (labels[n:] == input_ids[n:]).all()


def test_sharegpt_instruction_multi_turn_system_and_openai_layout(tmp_path, run, tok) -> None:
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "Be kind."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "Bye"},
            {"from": "gpt", "value": "Goodbye."},
        ]
    }
    openai = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    _, prefix = run(
        write_jsonl(tmp_path / "a.jsonl", [sharegpt]),
        handler_name="SharegptStyleInstructionHandler",
        prompt_type="chatml",
        name="a",
    )
    input_ids, labels = (read_dataset(f"{prefix}_packed_{k}_document")[0] for k in ("input_ids", "labels"))
    turns = [
        (
            "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
            "Hello!<|im_end|>",
        ),
        ("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", "Goodbye.<|im_end|>"),
    ]
    want_ids, want_labels = [], []
    for prompt, reply in turns:
        want_ids += ids(tok, prompt) + ids(tok, reply)
        want_labels += [IGNORE_INDEX] * len(ids(tok, prompt)) + ids(tok, reply)
    assert (input_ids.tolist(), labels.tolist()) == (want_ids, want_labels)

    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    _, prefix = run(
        write_jsonl(tmp_path / "b.jsonl", [openai]),
        handler_name="SharegptStyleInstructionHandler",
        map_keys={"messages": "messages", "tags": tags},
        name="b",
    )
    labels = read_dataset(prefix + "_packed_labels_document")[0]
    assert tok.decode(labels[masked_prefix(labels) :]) == "Hello!<|im_end|>\n"


@pytest.mark.parametrize("style", ["alpaca", "sharegpt"])
def test_pairwise_chosen_and_rejected_share_the_masked_prompt(tmp_path, run, tok, style) -> None:
    if style == "alpaca":
        row = {"instruction": "What is 4 plus 4?", "chosen": "8.", "rejected": "9.", "history": [["Hi", "Hello."]]}
        handler = "AlpacaStylePairwiseHandler"
    else:
        row = {
            "conversations": [
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello."},
                {"from": "human", "value": "What is 4 plus 4?"},
            ],
            "chosen": {"from": "gpt", "value": "8."},
            "rejected": {"from": "gpt", "value": "9."},
        }
        handler = "SharegptStylePairwiseHandler"
    _, prefix = run(write_jsonl(tmp_path / "in.jsonl", [row]), handler_name=handler, prompt_type="default")
    eos = tok.eos_token_id
    prompt = (
        ids(tok, "Human: Hi\nAssistant:")
        + ids(tok, "Hello.")
        + [eos]
        + ids(tok, "\nHuman: What is 4 plus 4?\nAssistant:")
    )
    for side, reply in (("chosen", "8."), ("rejected", "9.")):
        input_ids = read_dataset(f"{prefix}_packed_{side}_input_ids_document")[0]
        labels = read_dataset(f"{prefix}_packed_{side}_labels_document")[0]
        assert input_ids.tolist() == prompt + ids(tok, reply) + [eos]
        assert labels.tolist() == [IGNORE_INDEX] * len(prompt) + ids(tok, reply) + [eos]  # history reply masked too


def test_packing_keeps_every_sample_and_its_boundaries(tmp_path, run) -> None:
    from mindspeed_llm.tokenizer import DEMO_ALPACA

    seq = 160
    report, plain = run(DEMO_ALPACA, handler_name="AlpacaStyleInstructionHandler", seq_length=seq, name="plain")
    packed_report, packed = run(
        DEMO_ALPACA, handler_name="AlpacaStyleInstructionHandler", seq_length=seq, pack=True, name="packed"
    )
    samples = list(zip(*(read_dataset(f"{plain}_packed_{k}_document") for k in ("input_ids", "labels"))))
    rows = list(
        zip(*(read_dataset(f"{packed}_packed_{k}_document") for k in ("input_ids", "attention_mask", "labels")))
    )
    assert packed_report.samples == report.samples == len(samples) and packed_report.packs == len(rows)
    found = []
    loads = []
    for input_ids, segments, labels in rows:
        assert len(input_ids) == len(segments) == len(labels) == seq
        n_segments = segments.max()
        used = int((segments > 0).sum())
        loads.append(used)
        # Segments are 1..k, contiguous, in order, then padding (0, pad id, label -100).
        assert segments[:used].tolist() == sorted(segments[:used].tolist()) and set(segments[:used]) == set(
            range(1, n_segments + 1)
        )
        assert (segments[used:] == 0).all() and (labels[used:] == IGNORE_INDEX).all()
        for s in range(1, n_segments + 1):
            where = segments == s
            found.append((tuple(input_ids[where]), tuple(labels[where])))
    assert sorted(found) == sorted((tuple(ids), tuple(labels)) for ids, labels in samples)
    # Any-fit packing: no two rows could have been one.
    loads.sort()
    assert len(loads) < 2 or loads[0] + loads[1] > seq
    assert len(rows) >= -(-sum(loads) // seq)


def test_seq_length_drops_and_counts_long_samples(tmp_path, run) -> None:
    rows = [{"instruction": "short", "output": "ok"}, {"instruction": "long " * 100, "output": "ok"}]
    report, prefix = run(
        write_jsonl(tmp_path / "in.jsonl", rows), handler_name="AlpacaStyleInstructionHandler", seq_length=40
    )
    assert (report.samples, report.skipped_too_long) == (1, 1)
    assert "dropped 1 sample(s) longer than --seq-length" in report.describe()
    assert len(read_dataset(prefix + "_packed_input_ids_document")) == 1


def test_every_input_format_and_max_samples(tmp_path, run, tok) -> None:
    import pandas as pd
    from datasets import Dataset

    folder = tmp_path / "mixed"
    folder.mkdir()
    pd.DataFrame({"text": ["csv one", "csv, two\nlines"]}).to_csv(folder / "a.csv", index=False)
    pd.DataFrame({"text": ["parquet one"], "n": [1]}).to_parquet(folder / "b.parquet")
    (folder / "c.txt").write_text("text one\ntext two\n")
    (folder / "d.json").write_text('[{"text": "array one"}, {"text": "array two"}]')
    write_jsonl(folder / "e.jsonl", [{"text": "lines one"}])
    Dataset.from_dict({"text": ["arrow one"]}).save_to_disk(str(folder / "f"))  # .arrow + metadata .json files
    (folder / "notes.md").write_text("not data")
    report, prefix = run(folder)
    texts = [
        "csv one",
        "csv, two\nlines",
        "parquet one",
        "text one",
        "text two",
        "array one",
        "array two",
        "lines one",
        "arrow one",
    ]
    assert [d.tolist() for d in read_dataset(prefix + "_text_document")] == [tok(t)["input_ids"] for t in texts]
    report, prefix = run(folder, max_samples=4, name="first4")
    assert report.records == 4 and len(read_dataset(prefix + "_text_document")) == 4
