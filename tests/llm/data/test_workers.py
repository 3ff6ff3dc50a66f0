"""--workers N writes byte-identical output to --workers 1, in input order."""

from __future__ import annotations

import json

import pytest

from mindspeed_llm.tokenizer import DEMO_ALPACA, DEMO_CORPUS


def files_of(prefix: str, keys: list[str]) -> dict[str, bytes]:
    return {
        f"{key}{ext}": open(f"{prefix}_{key}_document{ext}", "rb").read() for key in keys for ext in (".bin", ".idx")
    }


@pytest.mark.parametrize("handler", ["GeneralPretrainHandler", "AlpacaStyleInstructionHandler"])
def test_two_workers_write_the_same_bytes(tmp_path, run, handler) -> None:
    if handler == "GeneralPretrainHandler":
        source, keys, flags = DEMO_CORPUS, ["text"], {"append_eod": True}
    else:
        source, keys, flags = (
            DEMO_ALPACA,
            [f"packed_{k}" for k in ("input_ids", "attention_mask", "labels")],
            {"seq_length": 96},
        )
    # A malformed line in the middle: the skip count and the order around it must not depend on workers.
    lines = source.read_text().splitlines()
    lines.insert(len(lines) // 2, "{broken")
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    one, prefix_one = run(tmp_path / "in.jsonl", handler_name=handler, skip_bad_records=True, name="one", **flags)
    two, prefix_two = run(
        tmp_path / "in.jsonl", handler_name=handler, skip_bad_records=True, name="two", workers=2, **flags
    )
    assert files_of(prefix_one, keys) == files_of(prefix_two, keys)
    assert (one.records, one.samples, one.skipped_bad, one.skipped_too_long) == (
        two.records,
        two.samples,
        1,
        two.skipped_too_long,
    )
    assert one.bad_examples == two.bad_examples and f"in.jsonl:{len(lines) // 2 + 1}:" in one.bad_examples[0]


def test_a_bad_record_stops_the_pool_with_its_location(tmp_path, run) -> None:
    rows = [json.dumps({"text": f"document {i}"}) for i in range(500)]
    rows[300] = json.dumps({"txt": "wrong key"})
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=r"in.jsonl:301: missing key 'text'"):
        run(tmp_path / "in.jsonl", workers=2)
    assert not (tmp_path / "out").exists()
