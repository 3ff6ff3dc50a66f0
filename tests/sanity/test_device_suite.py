"""tools/bench/device_suite.py cannot rot: its arguments fit the benches it drives, its 1 B shape is
about 1 B parameters in bf16, and one part runs end to end through ``--dry-run --json``.

The whole ``--dry-run`` (every part) spawns about ten interpreters (each side of each bench) and
costs ~2 minutes of CPU on a 2-core host, over this test's budget: here the cheapest part
(``generate``) runs end to end, and every other part's bench parses the arguments the suite gives it.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"


@pytest.fixture(scope="module")
def suite():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("device_suite")
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("dry_run", [True, False])
def test_benches_accept_the_suites_arguments(suite, dry_run):
    for name, (script, argv) in suite.BENCH_ARGV.items():
        module = importlib.import_module(Path(script).stem)
        if hasattr(module, "parse_args"):  # generate.py parses in main(): it runs end to end below
            module.parse_args([*argv(dry_run), "--json", "x.json"])
        assert name in suite.PARTS
    assert set(suite.PARTS) == {"pretrain_mfu", *suite.BENCH_ARGV}


def test_1b_mfu_is_tokens_times_a_hand_count_over_the_peak(suite):
    spec = {"size": "1b", "dataset": "/nonexistent/demo", "workdir": "/nonexistent", "precision": "bf16"}
    spec.update(seq_length=2048, micro_batch=4, grad_accum=1, steps=8, level=2, vocab_size=1792)
    shape, tokens_per_s, flops, peak, value = suite.measure_mfu(spec, [9.0, 2.0, 1.0], 500.0)
    h, f, s, v = shape.hidden_size, shape.ffn_hidden_size, 2048, 1792
    kv = shape.num_query_groups * h // shape.num_attention_heads
    layer = 2 * h * (h + 2 * kv) + 2 * h * h + 4 * s * h + 3 * 2 * h * f  # projections, attention, SwiGLU
    assert 0.9e9 < shape.num_layers * (layer - 4 * s * h) / 2 < 1.1e9  # a 1 B Llama (without the vocabulary)
    assert shape.params_dtype == "bfloat16" and peak.source == "override"
    assert tokens_per_s == 4 * 2048 / 2.0  # the median step
    expected = 3 * (shape.num_layers * layer + 2 * h * v) * tokens_per_s
    assert abs(flops / expected - 1) < 1e-12 and abs(value - expected / 500e12) < 1e-12


def test_bad_arguments_exit_2(suite, capsys):
    for argv in (["--parts", "nope"], ["--peak-tflops", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            suite.parse_args(argv)
        assert exit_info.value.code == 2
        assert argv[0] in capsys.readouterr().err.splitlines()[-1]


def test_dry_run_writes_the_table_and_rows(tmp_path):
    out = tmp_path / "rows.json"
    argv = ["--dry-run", "--parts", "generate", "--json", str(out), "--workdir", str(tmp_path / "work")]
    proc = subprocess.run([sys.executable, str(BENCH / "device_suite.py"), *argv], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["generate batch 1 vs transformers"]
    assert (
        rows[0]["value"] > 0 and rows[0]["note"] == "fp32; same tokens True" and rows[0]["goal"] == ">= 2x transformers"
    )
    assert "| generate | generate batch 1 vs transformers |" in proc.stdout
