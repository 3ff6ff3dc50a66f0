"""The golden-loss check (``tests/golden``) fails on any change of a recorded number, and says how to regenerate.

Also: every golden name a test checks has a recorded file, and every recorded folder is checked by a test.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import tests.golden as golden
from tests.golden import GoldenWarning, check_golden, first_steps, golden_key

ROOT = Path(__file__).resolve().parents[2]
DEMO, OTHER = "demo", "other"  # names held in variables: tools/golden.py finds carriers by a literal name


def _tool():
    """tools/golden.py, the regeneration tool (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("golden_tool", ROOT / "tools" / "golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bit_exact_tolerant_and_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(golden, "GOLDEN_DIR", tmp_path)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/x/test_y.py::test_z (call)")
    losses = {"loss": [2.5, 2.25, 2.125], "reward_mean": [0.0, 0.5, 1.0]}
    with pytest.raises(AssertionError, match="no golden file for 'demo'.*--update-golden tests/x/test_y.py"):
        check_golden(DEMO, losses, threads=2)
    monkeypatch.setenv(golden.UPDATE_ENV, "1")
    with pytest.warns(GoldenWarning, match="recorded"):
        check_golden(DEMO, losses, threads=2)
    monkeypatch.delenv(golden.UPDATE_ENV)
    recorded = json.loads((tmp_path / "demo" / f"{golden_key()['key']}.json").read_text())
    assert recorded["series"] == losses and recorded["threads"] == 2
    check_golden(DEMO, losses, threads=2)  # the same numbers: passes, silently
    one_ulp = {**losses, "loss": [2.5, 2.25000000000000044, 2.125]}
    message = "differs .* bit for bit: first difference at step 2: loss 2.2500000000000004 != golden 2.25; .*tools/golden.py --update demo"
    with pytest.raises(AssertionError, match=message):
        check_golden(DEMO, one_ulp, threads=2)
    with pytest.raises(AssertionError, match="loss: 2 steps != golden 3"):
        check_golden(DEMO, {**losses, "loss": [2.5, 2.25]}, threads=2)
    # Another thread count (or ISA, or torch): the nearest file at rel 1e-4, with a warning.
    with pytest.warns(GoldenWarning, match="no bit-exact file .* with 1 threads; matched .* at rel 0.0001"):
        check_golden(DEMO, one_ulp, threads=1)
    with pytest.raises(AssertionError, match="at rel 0.0001: first difference at step 3: loss 2.126"):
        check_golden(DEMO, {**losses, "loss": [2.5, 2.25, 2.126]}, threads=1)
    other = {**recorded, "device": "elsewhere", "key": "elsewhere-X-torch0"}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "elsewhere-X-torch0.json").write_text(json.dumps(other))
    with pytest.warns(GoldenWarning, match="no file for device"):
        check_golden(OTHER, losses, threads=2)
    # Chaotic series: only this key's file compares; another thread count (or machine) warns.
    with pytest.raises(AssertionError, match="bit for bit"):
        check_golden(DEMO, one_ulp, threads=2, chaotic=True)
    with pytest.warns(GoldenWarning, match="amplify rounding"):
        check_golden(DEMO, {**losses, "loss": [9.0, 9.0, 9.0]}, threads=1, chaotic=True)


def test_cpu_kind_is_vendor_family_model(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
    )
    assert golden.cpu_kind(info) == "AuthenticAMD.26.2"
    assert golden.cpu_kind(tmp_path / "missing") == "unknown"
    info.write_text("processor\t: 0\n")
    assert golden.cpu_kind(info) == "unknown"
    assert golden_key()["key"].startswith(f"{golden_key()['device']}-{golden_key()['cpu_capability']}-")


def test_first_steps_reads_the_training_records(tmp_path: Path) -> None:
    lines = [{"step": 0, "eval/reward_mean": 0.1}, {"kind": "eval", "step": 1, "loss": 9.0}]
    lines += [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert first_steps(tmp_path / "metrics.jsonl", 2) == {"loss": [1.0, 0.5]}


def test_every_checked_name_is_recorded_and_every_record_checked() -> None:
    checked = _tool().carriers()
    assert {"llm_quickstart", "llm_sft_lora", "llm_dpo", "rl_grpo_demo", "mm_vlm_demo", "mm_t2v_demo"} <= set(checked)
    folders = {p.name for p in golden.GOLDEN_DIR.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert sorted(folders - set(checked)) == [], "golden folders no test checks"
    for name in checked:
        files = [json.loads(p.read_text()) for p in (golden.GOLDEN_DIR / name).glob("*.json")]
        assert any(f["device"] == "cpu" for f in files), f"{name}: no CPU golden file (the tests run on the CPU)"
