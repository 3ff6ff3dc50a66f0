"""Bad input of every kind: a clear ValueError naming the input and the fix, and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mindspeed_llm.data import HANDLERS, PreprocessConfig, preprocess_data
from tests.llm.data.conftest import read_dataset, write_jsonl

GOOD = [{"instruction": f"Say {i}.", "output": f"{i}."} for i in range(100)]


def assert_nothing_written(out: Path) -> None:
    """Not even the output directory the failed run created."""
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_unknown_handler_lists_the_known_ones(tmp_path, run) -> None:
    with pytest.raises(ValueError) as err:
        run(write_jsonl(tmp_path / "in.jsonl", GOOD), handler_name="AlpacaStyleInstructionHandlr")
    message = str(err.value)
    assert "Did you mean 'AlpacaStyleInstructionHandler'" in message
    assert all(name in message for name in HANDLERS)
    assert_nothing_written(tmp_path / "out")


def test_malformed_json_line_names_file_and_line_and_leaves_nothing(tmp_path, run) -> None:
    path = tmp_path / "in.jsonl"
    lines = [json.dumps(r) for r in GOOD]
    lines[49] = '{"instruction": "broken", "output": '
    path.write_text("\n".join(lines) + "\n")
    # The column is the line's (json alone would say "column 1": of the next line of the text it was given).
    expected = rf"{path}:50: malformed JSON \(Expecting value at column 37, the end of the line: .*--skip-bad-records"
    with pytest.raises(ValueError, match=expected):
        run(path, handler_name="AlpacaStyleInstructionHandler")
    assert_nothing_written(tmp_path / "out")  # 49 samples were tokenized before the failure


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_json_errors_in_the_middle_of_a_file_name_their_line_and_column(tmp_path, newline: str) -> None:
    from mindspeed_llm.data.readers import iter_records

    lines = [json.dumps({"text": f"doc {i}"}) for i in range(9)]
    lines[3] = '{"text": "cut short", '  # ends inside the object
    lines[5] = '  {"text": "a" "b"}'  # a missing comma, mid-line, after indentation
    lines[7] = '{"text": "ünïcödé", "x": }'  # characters, not bytes
    path = tmp_path / "in.jsonl"
    path.write_bytes(("\ufeff" + newline.join(lines) + newline).encode("utf-8"))  # with a byte-order mark
    errors = {r.location: r.error for r in iter_records([path]) if r.error}
    assert errors == {
        f"{path}:4": "malformed JSON (Expecting property name enclosed in double quotes at column 23, the end of "
        "the line: is the record cut short?)",
        f"{path}:6": "malformed JSON (Expecting ',' delimiter at column 16)",
        f"{path}:8": "malformed JSON (Expecting value at column 26)",
    }


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"a": "unterminated', "Unterminated string starting at column 7"),
        ('{"a": "tab\there"}', "Invalid control character at column 11"),
        ('{"a": 1', "Expecting ',' delimiter at column 8"),
    ],
)
def test_json_error_says_at_column_once(text: str, problem: str) -> None:
    """json's own messages of some problems end in "at": no "at at column" in ours."""
    from mindspeed_llm.data.readers import describe_json_error

    with pytest.raises(json.JSONDecodeError) as err:
        json.loads(text)
    assert describe_json_error(err.value) == problem


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"instruction": "no output"}, r"missing key 'output' \(the record has: instruction\)"),
        ({"instruction": 3, "output": "x"}, "key 'instruction' must be str, got int"),
        ({"instruction": "a", "output": "b", "history": [["only one"]]}, "history entry 0 must be a"),
        (["not", "an", "object"], "expected a JSON object, got list"),
    ],
)
def test_bad_alpaca_records(tmp_path, run, record, message) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", GOOD[:3] + [record] + GOOD[3:6])
    with pytest.raises(ValueError, match=rf"{path}:4: {message}"):
        run(path, handler_name="AlpacaStyleInstructionHandler")
    assert_nothing_written(tmp_path / "out")


def test_bad_sharegpt_roles(tmp_path, run) -> None:
    bad = {"conversations": [{"from": "gpt", "value": "reply first"}, {"from": "human", "value": "?"}]}
    path = write_jsonl(tmp_path / "in.jsonl", [bad])
    with pytest.raises(ValueError, match=r"in.jsonl:1: message 0 has role 'assistant' where user or observation"):
        run(path, handler_name="SharegptStyleInstructionHandler")


def test_missing_text_key_for_pretraining(tmp_path, run) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}, {"content": "wrong column"}])
    with pytest.raises(ValueError, match=r"in.jsonl:2: missing key 'text' \(the record has: content\)"):
        run(path)


def test_skip_bad_records_counts_them_in_the_summary(tmp_path, run, tok) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "one"}\nnot json\n{"body": "x"}\n\n{"text": "two"}\n')
    report, prefix = run(path, skip_bad_records=True)
    assert (report.records, report.samples, report.skipped_bad) == (4, 2, 2)
    text = report.describe()
    assert (
        "skipped 2 malformed record(s)" in text
        and f"{path}:2: malformed JSON" in text
        and f"{path}:3: missing key" in text
    )
    assert [d.tolist() for d in read_dataset(prefix + "_text_document")] == [
        tok("one")["input_ids"],
        tok("two")["input_ids"],
    ]


def test_empty_input_and_all_records_skipped(tmp_path, run) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no records"):
        run(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text("nope\n")
    with pytest.raises(ValueError, match="no sample to write: all 1 records were malformed"):
        run(tmp_path / "bad.jsonl", skip_bad_records=True)
    assert_nothing_written(tmp_path / "out")


def test_missing_paths_and_unsupported_files(tmp_path, run) -> None:
    with pytest.raises(ValueError, match="--input .* does not exist"):
        run(tmp_path / "nothing.jsonl")
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(ValueError, match="unsupported extension '.xml'"):
        run(tmp_path / "data.xml")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        run(tmp_path / "folder")
    config = PreprocessConfig(
        input=str(write_jsonl(tmp_path / "in.jsonl", GOOD)),
        output_prefix=str(tmp_path / "out" / "x"),
        tokenizer_name_or_path=str(tmp_path / "no-tokenizer"),
    )
    with pytest.raises(ValueError, match="tokenizer directory .*no-tokenizer.* does not exist"):
        preprocess_data(config)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"pack": True}, "--pack applies to instruction handlers"),
        ({"handler_name": "AlpacaStyleInstructionHandler", "pack": True}, "--pack needs --seq-length"),
        (
            {"handler_name": "AlpacaStylePairwiseHandler", "pack": True, "seq_length": 64},
            "--pack applies to instruction",
        ),
        (
            {"handler_name": "AlpacaStyleInstructionHandler", "json_keys": ["text"]},
            "--json-keys applies to GeneralPretrainHandler",
        ),
        ({"handler_name": "AlpacaStyleInstructionHandler", "map_keys": {"promt": "q"}}, "no attribute 'promt'"),
        (
            {"handler_name": "SharegptStyleInstructionHandler", "map_keys": {"tags": {"rol_tag": "r"}}},
            "unknown tags rol_tag",
        ),
        ({"handler_name": "AlpacaStyleInstructionHandler", "prompt_type": "chatmll"}, "unknown prompt type 'chatmll'"),
        ({"workers": 0}, "--workers must be at least 1"),
    ],
)
def test_conflicting_flags(tmp_path, run, flags, message) -> None:
    with pytest.raises(ValueError, match=message):
        run(write_jsonl(tmp_path / "in.jsonl", GOOD), **flags)
    assert_nothing_written(tmp_path / "out")


def test_no_chat_template_and_no_prompt_type(tmp_path, tok_dir) -> None:
    plain = tmp_path / "tok"
    shutil.copytree(tok_dir, plain)
    (plain / "chat_template.jinja").unlink()
    config = PreprocessConfig(
        input=str(write_jsonl(tmp_path / "in.jsonl", GOOD)),
        tokenizer_name_or_path=str(plain),
        output_prefix=str(tmp_path / "out" / "x"),
        handler_name="AlpacaStyleInstructionHandler",
    )
    with pytest.raises(ValueError, match="no chat template; pass --prompt-type"):
        preprocess_data(config)


def test_a_failed_run_keeps_the_previous_output(tmp_path, run) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "kept"}])
    _, prefix = run(good)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "new"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        run(bad)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_a_chat_template_that_refuses_a_record(tmp_path, tok_dir) -> None:
    strict = tmp_path / "tok"
    shutil.copytree(tok_dir, strict)
    template = (strict / "chat_template.jinja").read_text()
    refuse = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    (strict / "chat_template.jinja").write_text(refuse + template)
    rows = [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": "d", "system": "be terse"}]
    config = PreprocessConfig(
        input=str(write_jsonl(tmp_path / "in.jsonl", rows)),
        tokenizer_name_or_path=str(strict),
        output_prefix=str(tmp_path / "out" / "x"),
        handler_name="AlpacaStyleInstructionHandler",
    )
    with pytest.raises(
        ValueError, match=r"in.jsonl:2: the tokenizer's chat template refused .*System role not supported"
    ):
        preprocess_data(config)
    config.skip_bad_records = True
    assert preprocess_data(config).skipped_bad == 1


def test_a_pair_whose_answers_tokenize_the_same_is_refused(tmp_path, tok_dir) -> None:
    """A chat template that renders prompts only (the RL demo policy's) made every pair identical: log 2 forever."""
    prompts_only = tmp_path / "tok"
    shutil.copytree(tok_dir, prompts_only)
    (prompts_only / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\nA:{% endif %}{% endfor %}"
    )
    rows = [{"instruction": "What is 1 + 1?", "input": "", "chosen": " 2", "rejected": " 3"}]
    config = PreprocessConfig(
        input=str(write_jsonl(tmp_path / "in.jsonl", rows)),
        tokenizer_name_or_path=str(prompts_only),
        output_prefix=str(tmp_path / "out" / "x"),
        handler_name="AlpacaStylePairwiseHandler",
    )
    with pytest.raises(ValueError, match=r"in.jsonl:1: chosen and rejected give the same tokens .*--prompt-type"):
        preprocess_data(config)
    assert_nothing_written(tmp_path / "out")
    config.prompt_type = "question_answer"  # <s>Question: ...\nAnswer:<reply>
    preprocess_data(config)
    chosen, rejected = (
        read_dataset(f"{config.output_prefix}_packed_{k}_input_ids_document")[0] for k in ("chosen", "rejected")
    )
    assert list(chosen[:-1]) == list(rejected[:-1]) and chosen[-1] != rejected[-1]  # the same prompt, not reply
