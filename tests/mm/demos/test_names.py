"""Demo names are resolved by the entry points (mindspeed_mm.demos.names): evaluate's ``demo`` keeps its task name."""

from __future__ import annotations

from pathlib import Path

from mindspeed_mm.demos import mmbench, names, vlm
from mindspeed_mm.evaluation.config import EvaluateConfig


def test_evaluate_demo_names_become_the_demo_files(tmp_path, monkeypatch) -> None:
    # The demo's files as if built (building them is the slow test_demo's part): only the names are checked here.
    paths = {"model": tmp_path / "model", "heldout": tmp_path / "data" / "heldout.jsonl"}
    monkeypatch.setattr(vlm, "demo_paths", lambda: paths)
    monkeypatch.setattr(mmbench, "demo_paths", lambda: paths)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "demo.tsv").write_text("index\tquestion\n")
    config = EvaluateConfig(load_dir="demo", task_data_path=["demo", "other.tsv"], base_dir="demo")
    resolved = names.resolve_evaluate_demo(config)
    assert resolved.load_dir == resolved.base_dir == str(paths["model"])
    demo_tsv, other = (Path(p) for p in resolved.task_data_path)
    assert demo_tsv == tmp_path / "data" / "demo.tsv" and other == Path("other.tsv")  # the report's task: demo
    assert names.resolve_evaluate_demo(EvaluateConfig(load_dir="run/hf", task_data_path=["a.tsv"])) == EvaluateConfig(
        load_dir="run/hf", task_data_path=["a.tsv"]
    )
    assert names.resolve_model_dir("some/dir") == "some/dir" and names.resolve_model_dir(None) is None
