"""tools/bench/report.py: its rows are the benches' ratios (checked on made-up results with known
answers), its arguments fit every bench, and it rewrites only its own table of the page."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("report")
    finally:
        sys.path.remove(str(BENCH))


def test_every_bench_accepts_the_reports_arguments(report):
    for name, bench in report.BENCHES.items():
        module = importlib.import_module(Path(bench.script).stem)
        for argv in (bench.quick, bench.full):
            if hasattr(module, "parse_args"):  # generate.py parses in main()
                module.parse_args([*argv, *report._workdir(name, Path("w")), "--json", "x.json"])


def test_rows_are_the_ratios_in_wall_and_cpu_time(report):
    pretrain = {
        "results": {
            "ours (optimization_level 2)": {"tokens_per_s": 300.0, "step_s": 2.0, "cpu_step_s": 3.0, "load": [1, 2]},
            "Hugging Face Trainer": {"tokens_per_s": 200.0, "step_s": 3.0, "cpu_step_s": 6.0, "peak_rss_mb": 9},
        }
    }
    (row,) = report.rows_of("pretrain", pretrain, "cmd", "2026-12-02")
    assert (row["ratio_wall"], row["ratio_cpu"], row["load"], row["peak_mb"]) == (1.5, 2.0, [1, 2], [None, 9])
    grpo = {"results": {"ours": {"step_s": 1.0, "cpu_step_s": 2.0}, "trl": {"step_s": 2.5, "cpu_step_s": 3.0}}}
    (row,) = report.rows_of("grpo", grpo, "cmd", "d")
    assert (row["ratio_wall"], row["ratio_cpu"], row["goal"]) == (2.5, 1.5, report.BENCHES["grpo"].goal)
    gen = [{"batch": 8, "ours_wall_tok_s": 30.0, "hf_wall_tok_s": 10.0, "ours_cpu_tok_s": 8.0, "hf_cpu_tok_s": 4.0}]
    gen.append(gen[0] | {"engine": "compile", "ours_wall_tok_s": 50.0})  # generate.py --compile's row
    plain, compiled = report.rows_of("generate", gen, "cmd", "d")
    assert (plain["row"], plain["ratio_wall"], plain["ratio_cpu"]) == ("engine, batch 8", 3.0, 2.0)
    assert (compiled["row"], compiled["ratio_wall"]) == ("engine, compile, batch 8", 5.0)
    vlm = {
        "results": {
            "ours full": {"tokens_per_s": 2.0, "cpu_tokens_per_s": 1.0},
            "HF full": {"tokens_per_s": 1.0, "cpu_tokens_per_s": 4.0},
        }
    }
    (row,) = report.rows_of("vlm", vlm, "cmd", "d")
    assert (row["row"], row["ratio_wall"], row["ratio_cpu"]) == ("ours full", 2.0, 0.25)


def test_only_its_table_is_replaced(report):
    page = f"# P\n\nintro\n\n{report.BEGIN}\nold table\n{report.END}\n\n## Accelerator suite\nkept\n"
    new = report.replace_table(page, "new table\n")
    assert new == page.replace("old table\n", "new table\n")
    assert report.replace_table(new, "new table\n") == new
    assert report.BEGIN in report.replace_table("# P\n", "t\n")
