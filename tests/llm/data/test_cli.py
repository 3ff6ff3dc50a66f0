"""``mindspeed-llm preprocess-data``: flags, summary on stdout, exit status 2 on user errors."""

from __future__ import annotations

import pytest

from mindspeed_llm.cli import main
from mindspeed_llm.tokenizer import DEMO_PAIRWISE
from tests.llm.data.conftest import read_dataset, write_jsonl


def test_preprocess_data_with_the_demo_tokenizer(tmp_path, capsys, demo_cache) -> None:
    prefix = tmp_path / "pairs"
    code = main(
        [
            "preprocess-data",
            "--input",
            str(DEMO_PAIRWISE),
            "--tokenizer-name-or-path",
            "demo",
            "--output-prefix",
            str(prefix),
            "--handler-name",
            "AlpacaStylePairwiseHandler",
            "--tokenizer-type",
            "PretrainedFromHF",
            "--map-keys",
            '{"query": "input"}',
            "--log-interval",
            "10",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "AlpacaStylePairwiseHandler: 60 records read, 60 written" in out
    for key in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"):
        assert f"wrote {prefix}_packed_{key}_document.bin/.idx" in out
        assert len(read_dataset(f"{prefix}_packed_{key}_document")) == 60


def test_user_errors_exit_2_with_one_line(tmp_path, capsys, demo_cache) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"body": "b"}])
    base = [
        "preprocess-data",
        "--input",
        str(source),
        "--tokenizer-name-or-path",
        "demo",
        "--output-prefix",
        str(tmp_path / "o"),
    ]
    assert main(base + ["--handler-name", "NoSuchHandler"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("mindspeed-llm: error: unknown dataset handler 'NoSuchHandler'")
        and "GeneralPretrainHandler" in err
    )
    assert main(base) == 2
    assert "in.jsonl:2: missing key 'text'" in capsys.readouterr().err
    assert main(base + ["--skip-bad-records"]) == 0
    assert "skipped 1 malformed record(s)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # argparse: not a JSON object
        main(base + ["--map-keys", "{prompt: q}"])
    assert exit_info.value.code == 2 and "not valid JSON" in capsys.readouterr().err
