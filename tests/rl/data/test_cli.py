"""``mindspeed-rl make-data``: writes what the generator makes; bad knobs exit 2 with one line."""

from __future__ import annotations

import json
import subprocess
import sys

from mindspeed_rl.cli import main
from mindspeed_rl.data import generate_arithmetic, load_prompts
from mindspeed_rl.rewards import MathVerifier


def test_make_data_writes_train_and_held_out_split(tmp_path, capsys) -> None:
    train, test = tmp_path / "train.jsonl", tmp_path / "sub" / "test.jsonl"
    argv = [
        "make-data",
        "--output",
        str(train),
        "--num",
        "30",
        "--test-output",
        str(test),
        "--test-num",
        "10",
        "--operators",
        "*",
        "+",
        "--max-operand",
        "12",
        "--num-operands",
        "3",
        "--seed",
        "5",
    ]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote 30 records to {train}", f"wrote 10 records to {test}"]
    expected = generate_arithmetic(40, seed=5, max_operand=12, operators=("*", "+"), num_operands=3)
    written = [json.loads(line) for line in train.read_text().splitlines() + test.read_text().splitlines()]
    assert written == expected
    verifier = MathVerifier()
    for record in load_prompts(train) + load_prompts(test):
        value = record.reference.split("#### ")[1]
        assert verifier(record.prompt, f"The answer is {value}", record.reference) == 1.0


def test_bad_knobs_exit_2(tmp_path, capsys) -> None:
    out = tmp_path / "x.jsonl"
    assert main(["make-data", "--output", str(out), "--operators", "/"]) == 2
    assert "subset of" in capsys.readouterr().err
    assert main(["make-data", "--output", str(out), "--num", "100", "--max-operand", "2", "--operators", "+"]) == 2
    assert "distinct problems" in capsys.readouterr().err
    assert not out.exists()  # nothing half-written


def test_python_dash_m_sees_the_subcommand(tmp_path) -> None:
    out = tmp_path / "m.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "mindspeed_rl.cli", "make-data", "--output", str(out), "--num", "3"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert len(out.read_text().splitlines()) == 3
