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


def test_1b_shape_is_a_1b_llama_in_bf16(suite):
    spec = {"size": "1b", "dataset": "/nonexistent/demo", "seq_length": 2048, "micro_batch": 4, "grad_accum": 1}
    config = suite.pretrain.load_config({**spec, "workdir": "/nonexistent", "precision": "bf16"}, 8, 2)
    assert config.train.precision == "bf16"
    m = config.model
    layer = 4 * m.hidden_size * m.hidden_size * (1 + m.num_query_groups / m.num_attention_heads) / 2
    layer += 3 * m.hidden_size * m.ffn_hidden_size
    assert 0.9e9 < m.num_layers * layer < 1.1e9  # without the (demo-sized) vocabulary


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
    assert rows[0]["value"] > 0 and rows[0]["note"] == "same tokens True" and rows[0]["goal"] == ">= 2x transformers"
    assert "| generate | generate batch 1 vs transformers |" in proc.stdout
