"""``mindspeed-llm evaluate`` end to end: table on stdout, JSON report, one-line errors with exit 2."""

from __future__ import annotations

import json

import pytest

from mindspeed_llm.cli import main
from mindspeed_llm.evaluation import EvalSettings, TransformersLM
from mindspeed_llm.evaluation.mmlu import MMLUTask
from mindspeed_llm.evaluation.runner import DEMO_DATA_DIR, parse_shots

from .conftest import write_gsm8k, write_mmlu, write_text

pytestmark = pytest.mark.usefixtures("restore_logging")


def test_evaluate_all_tasks(tmp_path, tiny_model_dir, tiny_hf, capsys) -> None:
    root = tmp_path / "data"
    write_mmlu(root / "mmlu", {"alpha": 3, "beta": 2})
    write_gsm8k(root / "gsm8k", n_test=3)
    write_text(root / "ppl" / "docs.jsonl", n_docs=2)
    out = tmp_path / "out" / "results.json"
    code = main(
        [
            "evaluate",
            "--load-dir",
            str(tiny_model_dir),
            "--backend",
            "transformers",
            "--task",
            "mmlu,gsm8k",
            "--task",
            "ppl",
            "--task-data-path",
            str(root),
            "--shots",
            "mmlu=2,gsm8k=1",
            "--max-new-tokens",
            "6",
            "--evaluation-batch-size",
            "4",
            "--output",
            str(out),
            "--log-samples",
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["task", "metric", "value", "n"] and lines[-1] == f"wrote {out}"
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in lines[2:-1]}
    report = json.loads(out.read_text())
    expected_rows = {
        ("mmlu", "acc"),
        ("mmlu", "acc_macro"),
        ("mmlu/alpha", "acc"),
        ("mmlu/beta", "acc"),
        ("gsm8k", "exact_match"),
        ("ppl", "ppl"),
        ("ppl", "nll"),
    }
    assert set(rows) == expected_rows
    for result in report["results"]:  # the table shows the JSON's numbers
        assert rows[(result["task"], result["metric"])] == [f"{result['value']:.4f}", str(result["n"])]
    assert report["settings"]["task"] == ["mmlu", "gsm8k", "ppl"] and report["settings"]["backend"] == "transformers"
    results = {r["task"]: r for r in report["results"]}
    assert [r["metric"] for r in report["results"]] == ["acc", "exact_match", "ppl"]
    assert results["mmlu"]["n"] == 5 and set(results["mmlu"]["groups"]) == {"alpha", "beta"}
    assert results["mmlu"]["settings"]["shots"] == 2 and results["gsm8k"]["settings"]["shots"] == 1
    assert len(results["gsm8k"]["samples"]) == 3 and results["ppl"]["n"] == results["ppl"]["metrics"]["tokens"]
    assert not list(out.parent.glob(".*tmp*"))  # written under a temporary name, then renamed
    # The CLI's numbers are the library's numbers.
    model, tok = tiny_hf
    settings = EvalSettings(shots=2, show_progress=False)
    direct = MMLUTask().run(
        TransformersLM(model, tok, batch_size=4), MMLUTask().load(root / "mmlu", settings), settings
    )
    assert [s["prediction"] for s in direct.samples] == [s["prediction"] for s in results["mmlu"]["samples"]]
    assert results["mmlu"]["value"] == direct.value


def _fails(args: list[str], capsys) -> str:
    assert main(["evaluate", "--load-dir", "x", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    return captured.err


def test_bad_input_exits_2(tmp_path, capsys) -> None:
    err = _fails(["--task", "mmlu,squad", "--task-data-path", "demo"], capsys)
    assert "unknown evaluation task 'squad'" in err and "gsm8k, mmlu, ppl" in err
    err = _fails(["--task", "gsm8k", "--task-data-path", str(tmp_path / "none.jsonl")], capsys)
    assert "none.jsonl" in err and "does not exist" in err
    write_mmlu(tmp_path / "mmlu", {"s": 2})
    with open(tmp_path / "mmlu" / "test" / "s_test.csv", "a", encoding="utf-8") as handle:
        handle.write("q,a,b,c\n")
    err = _fails(["--task", "mmlu", "--task-data-path", str(tmp_path / "mmlu")], capsys)
    assert "s_test.csv:3: expected 6 columns" in err
    err = _fails(["--task", "mmlu,ppl", "--task-data-path", str(tmp_path)], capsys)
    assert "no folder for ppl" in err
    err = _fails(["--task", "mmlu", "--task-data-path", "demo", "--shots", "gsm8k=3"], capsys)
    assert "not in --task" in err
    err = _fails(["--task", "ppl", "--task-data-path", "demo"], capsys)  # data fine, model missing
    assert "--load-dir 'x' does not exist" in err


def test_parse_shots() -> None:
    assert parse_shots(None, ["mmlu", "gsm8k"]) == {"mmlu": None, "gsm8k": None}
    assert parse_shots("3", ["mmlu", "gsm8k"]) == {"mmlu": 3, "gsm8k": 3}
    assert parse_shots("gsm8k=8", ["mmlu", "gsm8k"]) == {"mmlu": None, "gsm8k": 8}
    with pytest.raises(ValueError, match="expected a count"):
        parse_shots("mmlu=five", ["mmlu"])


def test_shipped_sample_data_parses() -> None:
    from mindspeed_llm.evaluation import TASKS

    mmlu = TASKS.get("mmlu").load(DEMO_DATA_DIR / "mmlu", EvalSettings())
    assert {s: len(t) for s, (_, t) in mmlu.subjects.items()} == {
        "calendar": 8,
        "colors_and_seasons": 8,
        "elementary_arithmetic": 8,
    }
    assert all(len(dev) == 5 for dev, _ in mmlu.subjects.values())
    gsm8k = TASKS.get("gsm8k").load(DEMO_DATA_DIR / "gsm8k", EvalSettings(shots=4))
    assert len(gsm8k.problems) == 10 and len(gsm8k.examples) == 4
    assert {1800.0, -7.0, 2.25} <= {p.target for p in gsm8k.problems}
    ppl = TASKS.get("ppl").load(DEMO_DATA_DIR / "ppl", EvalSettings())
    assert len(ppl.documents) == 4 and all(len(doc) > 200 for doc in ppl.documents)


def test_settings_the_window_cannot_hold_exit_2_before_any_task_runs(tiny_model_dir, capsys) -> None:
    args = [
        "evaluate",
        "--load-dir",
        str(tiny_model_dir),
        "--backend",
        "transformers",
        "--task",
        "ppl,gsm8k",
        "--task-data-path",
        "demo",
        "--max-seq-len",
        "16",
    ]
    assert main([*args, "--max-new-tokens", "16"]) == 2
    captured = capsys.readouterr()
    assert "--max-new-tokens 16 leaves no room for a prompt in the model's window of 16 tokens" in captured.err
    assert captured.out == ""  # ppl, the first task, did not run
    assert main([*args, "--ppl-stride", "15", "--max-new-tokens", "8", "--max-seq-len", "15"]) == 2
    assert "--ppl-stride 15 must be below --max-seq-len 15" in capsys.readouterr().err
