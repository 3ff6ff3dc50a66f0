"""``mindspeed-llm convert-ckpt``: MindSpeed-LLM's flags, --dry-run, and every bad input of the issue
as one line on stderr, exit status 2 and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mindspeed_llm.bridges import BRIDGES
from mindspeed_llm.checkpoint import endpoints
from mindspeed_llm.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["convert-ckpt", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


@pytest.fixture
def source(tiny_checkpoints, tmp_path) -> Path:
    path = tmp_path / "hf"
    shutil.copytree(tiny_checkpoints["qwen3"], path)
    return path


def test_flags_convert_and_dry_run_predicts_the_files(source, tmp_path, capsys) -> None:
    flags = [
        "--load-model-type",
        "hf",
        "--save-model-type",
        "mg",
        "--load-dir",
        str(source),
        "--target-tensor-parallel-size",
        "2",
        "--target-pipeline-parallel-size",
        "2",
        "--target-expert-parallel-size",
        "1",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ]
    code, out, _ = run(capsys, *flags, "--save-dir", str(tmp_path / "mg"), "--dry-run")
    assert code == 0 and not (tmp_path / "mg").exists()
    planned = {}
    for line in out.splitlines():
        if line.startswith("  iter_"):
            name, rest = line.strip().split(": ")
            planned[name] = int(rest.split(" tensors")[0])
    assert len(planned) == 4 and out.startswith("plan: hf ")
    code, out, _ = run(capsys, *flags, "--save-dir", str(tmp_path / "mg"))  # with the progress bar
    assert code == 0 and out.splitlines()[-5].startswith("family qwen3")
    for name, count in planned.items():
        state = torch.load(tmp_path / "mg" / name, weights_only=False)
        tensors = [t for key in state if key.startswith("model") for t in state[key].values() if t is not None]
        assert len(tensors) == count, name
    code, _, _ = run(
        capsys,
        "--load-model-type",
        "mg",
        "--save-model-type",
        "hf",
        "--load-dir",
        str(tmp_path / "mg"),
        "--save-dir",
        str(tmp_path / "back"),
        "--no-progress",
    )
    assert code == 0 and (tmp_path / "back" / "model.safetensors.index.json").is_file()


def _bad_architecture(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))


def _missing_shard(path: Path) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    (path / sorted(set(index["weight_map"].values()))[1]).unlink()


def _truncated_shard(path: Path) -> None:
    shard = sorted(path.glob("*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-100])


def _index_to_missing_file(path: Path) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _shape_mismatch(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(config))


#: name -> (how to break the source, extra flags, the message that must come out).
BAD_INPUTS = {
    "unknown architecture": (
        _bad_architecture,
        [],
        "unsupported architecture FalconForCausalLM; supported: " + ", ".join(sorted(BRIDGES)),
    ),
    "TP does not divide heads": (
        None,
        ["--target-tensor-parallel-size", "3"],
        "--target-tensor-parallel-size 3 does not divide num_attention_heads 4",
    ),
    "TP does not divide KV heads": (
        None,
        ["--target-tensor-parallel-size", "4"],
        "--target-tensor-parallel-size 4 does not divide num_key_value_heads 2",
    ),
    "PP does not divide layers": (
        None,
        ["--target-pipeline-parallel-size", "3"],
        "--target-pipeline-parallel-size 3 does not divide the 4 layers; pass --num-layer-list",
    ),
    "missing shard": (_missing_shard, [], "which is not in"),
    "truncated shard": (_truncated_shard, [], "is truncated"),
    "index points at a missing file": (_index_to_missing_file, [], "points at model-99999-of-99999.safetensors"),
    "shape mismatch": (_shape_mismatch, [], "shape mismatch"),
    "unknown family": (None, ["--model-type-hf", "qwen9"], "unknown model family (--model-type-hf) 'qwen9'"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(source, tmp_path, capsys, case: str) -> None:
    breaker, flags, message = BAD_INPUTS[case]
    if breaker:
        breaker(source)
    save = tmp_path / "out" / "mg"
    code, out, err = run(capsys, "--load-dir", str(source), "--save-dir", str(save), *flags)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mindspeed-llm: error: ") and message in lines[0], err
    assert not save.exists() and not (save.parent.exists() and leftovers(save.parent))


def test_non_empty_save_dir_needs_overwrite(source, tmp_path, capsys) -> None:
    save = tmp_path / "mg"
    save.mkdir()
    (save / "keep.txt").write_text("old")
    code, _, err = run(capsys, "--load-dir", str(source), "--save-dir", str(save))
    assert code == 2 and "--save-dir" in err and "pass --overwrite" in err and len(err.strip().splitlines()) == 1
    assert (save / "keep.txt").read_text() == "old"
    code, _, _ = run(capsys, "--load-dir", str(source), "--save-dir", str(save), "--overwrite", "--no-progress")
    assert code == 0 and not (save / "keep.txt").exists() and (save / "latest_checkpointed_iteration.txt").is_file()
    assert leftovers(tmp_path) == []


def test_failure_while_writing_leaves_the_target_untouched(source, tmp_path, capsys, monkeypatch) -> None:
    save = tmp_path / "mg"
    save.mkdir()
    (save / "keep.txt").write_text("old")
    calls = []
    original = endpoints.HFSource.read_blocks

    def failing_read(self, task, plan):
        calls.append(task.mg_name)
        if len(calls) == 7:
            raise ValueError("disk on fire")
        return original(self, task, plan)

    monkeypatch.setattr(endpoints.HFSource, "read_blocks", failing_read)
    code, _, err = run(capsys, "--load-dir", str(source), "--save-dir", str(save), "--overwrite", "--no-progress")
    assert code == 2 and "disk on fire" in err
    assert sorted(p.name for p in save.iterdir()) == ["keep.txt"] and leftovers(tmp_path) == []
