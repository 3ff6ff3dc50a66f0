"""A checkpoint from elsewhere runs no code: a malicious file on every load path is one line, exit 2.

Each planted file is a pickle whose loading would run ``touch MARKER`` (``os.system``), where a
checkpoint holds a pickle: DCP's ``.metadata``, megatron's ``common.pt``, a legacy
``model_optim_rng.pt``, an older multimodal ``trainer_state.pt``, a ``pytorch_model.bin`` beside a
Hugging Face config. Every command runs in this process (its ``main``); each must exit 2 with
one ``error:`` line naming the file (and the refused class where one is refused), no traceback,
and the marker must never appear. The LLM cases use one real 2-step checkpoint; the others
plant the file in a directory laid out as the command expects (``complete.json`` included, so
that the resume scan takes it), which is all a command reads before it reaches the file.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from mindspeed.checkpointing import write_marker, write_tracker
from tests.reliability import harness

pytestmark = pytest.mark.faults

#: The class the planted pickles name (``os.system`` pickles as ``posix.system`` on Linux).
REFUSED = f"{os.system.__module__}.system"


class _Payload:
    """Unpickling it runs ``touch marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "a file from a checkpoint ran code"


@pytest.fixture
def evil(marker: Path) -> bytes:
    """A pickle whose loading runs code."""
    return pickle.dumps(_Payload(marker))


def _one_line(capsys: pytest.CaptureFixture, code: int, prog: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
    return line


def _plant(directory: Path, files: dict[str, bytes], step: int) -> Path:
    """``directory`` holding ``files``, marked complete, and the tracker beside it naming ``step``."""
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    write_marker(directory, step)
    write_tracker(directory.parent, step)
    return directory


def _padded(evil: bytes, like: Path) -> bytes:
    """``evil`` padded to ``like``'s size: pickle stops at its end, the size check of complete.json passes."""
    return evil + b"\0" * (like.stat().st_size - len(evil))


def _torch_file(obj: object) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def llm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(a data prefix, the save directory of a 2-step tiny pretrain with one checkpoint, ``iter_0000002``)."""
    from mindspeed_llm.cli import main
    from tests.llm.training.datasets import write_indexed_dataset

    root = tmp_path_factory.mktemp("untrusted-llm")
    prefix = write_indexed_dataset(root / "d", 200, seed=3)
    assert main(["--log-level", "ERROR", "pretrain", *harness.recipe(prefix, root / "run", steps=2)]) == 0
    return prefix, root / "run"


def test_llm_checkpoint_load_and_resume_scan_run_no_code(
    llm_run: tuple[str, Path], tmp_path: Path, evil: bytes, capsys: pytest.CaptureFixture
) -> None:
    from mindspeed_llm.cli import main

    prefix, run = llm_run

    def pretrain(*overrides: str) -> str:
        code = main(["--log-level", "ERROR", "pretrain", *harness.recipe(prefix, tmp_path / "fresh", 4), *overrides])
        return _one_line(capsys, code, "mindspeed-llm")

    # checkpoint.load=DIR: .metadata (padded: complete.json records its size), then common.pt.
    foreign = tmp_path / "foreign" / "iter_0000002"
    shutil.copytree(run / "iter_0000002", foreign)
    (foreign / ".metadata").write_bytes(_padded(evil, foreign / ".metadata"))
    line = pretrain(f"checkpoint.load={foreign}")
    assert f"{foreign / '.metadata'} holds a pickled {REFUSED}" in line and "runs no code" in line
    shutil.copy(run / "iter_0000002" / ".metadata", foreign / ".metadata")
    (foreign / "complete.json").unlink()  # as a checkpoint of another tool: a zip cannot be padded
    (foreign / "common.pt").write_bytes(_torch_file({"args": _Payload(tmp_path / "MARKER")}))
    line = pretrain(f"checkpoint.load={foreign}")
    assert f"{foreign / 'common.pt'} was refused" in line and REFUSED in line

    # The resume scan of checkpoint.save: a .metadata padded to the size complete.json records.
    save = tmp_path / "save"
    shutil.copytree(run, save)
    metadata = save / "iter_0000002" / ".metadata"
    metadata.write_bytes(_padded(evil, metadata))
    line = pretrain(f"checkpoint.save={save}")
    assert f"{metadata} holds a pickled {REFUSED}" in line


def test_convert_ckpt_runs_no_code_from_any_input_format(
    llm_run: tuple[str, Path], tmp_path: Path, evil: bytes, capsys: pytest.CaptureFixture
) -> None:
    from mindspeed_llm.cli import main

    def convert(load: Path, load_type: str, save_type: str) -> str:
        argv = ["--load-model-type", load_type, "--save-model-type", save_type, "--load-dir", str(load)]
        code = main(["convert-ckpt", *argv, "--save-dir", str(tmp_path / f"out-{load.name}"), "--no-progress"])
        assert not (tmp_path / f"out-{load.name}").exists()
        return _one_line(capsys, code, "mindspeed-llm")

    # torch_dist (megatron-core's dist format): the trainer's own layout.
    dist = tmp_path / "dist"
    shutil.copytree(llm_run[1], dist)
    (dist / "iter_0000002" / ".metadata").write_bytes(evil)
    line = convert(dist, "mg", "hf")
    assert f"{dist / 'iter_0000002' / '.metadata'} holds a pickled {REFUSED}" in line

    # Legacy per-rank files: the pickle's classes stay inert placeholders; where it holds one
    # instead of Megatron's args, state dict or a tensor, one line names it.
    args = argparse.Namespace(model_type_hf="llama2", num_layers=1, hidden_size=16)
    payload = _Payload(tmp_path / "MARKER")
    cases = {
        "whole": payload,
        "args": {"args": payload, "model": {}},
        "chunk": {"args": args, "model": payload},
        "tensor": {"args": args, "model": {"embedding.word_embeddings.weight": payload}},
    }
    for name, obj in cases.items():
        legacy = tmp_path / f"legacy-{name}"
        (legacy / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
        (legacy / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(_torch_file(obj))
        write_tracker(legacy, 1)
        line = convert(legacy, "mg", "hf")
        assert f"pickled {REFUSED} (outside the allow-list: not run)" in line and "model_optim_rng.pt" in line, name

    # Hugging Face: weights are read from safetensors only; a pickled pytorch_model.bin is never opened.
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (hf / "pytorch_model.bin").write_bytes(_torch_file({"model.embed_tokens.weight": payload}))
    line = convert(hf, "hf", "mg")
    assert "holds no safetensors weights" in line


def test_mm_train_convert_generate_evaluate_run_no_code(
    mm_model: tuple[Path, Path], tmp_path: Path, evil: bytes, capsys: pytest.CaptureFixture
) -> None:
    from mindspeed_mm.cli import main

    model, data = mm_model
    fields = {"step": 2, "model_class": None, "trainable_only": False}
    state = json.dumps({**fields, "rng": "00"}).encode()
    # A harmless trainer_state.pt beside it (read by earlier versions, which then reached .metadata).
    harmless = _torch_file({**fields, "rng": torch.get_rng_state()})

    def mm(*argv: str) -> str:
        return _one_line(capsys, main(["--log-level", "ERROR", *argv]), "mindspeed-mm")

    # train's resume scan: the step's .metadata (padded: complete.json records its size).
    save = tmp_path / "save"
    step = _plant(
        save / "step_00000002", {"trainer_state.json": state, "trainer_state.pt": harmless, ".metadata": evil}, 2
    )
    line = mm("train", *harness.mm_recipe(model, data, save))
    assert f"{step / '.metadata'} holds a pickled {REFUSED}" in line

    # An older checkpoint's trainer_state.pt is read weights-only.
    older = tmp_path / "older"
    _plant(older / "step_00000002", {"trainer_state.pt": _torch_file({"rng": _Payload(tmp_path / "MARKER")})}, 2)
    line = mm("train", *harness.mm_recipe(model, data, older))
    assert "trainer_state.pt was refused" in line and REFUSED in line

    # convert, generate and evaluate read a DCP checkpoint's .metadata first.
    out = tmp_path / "hf-out"
    line = mm(
        "convert",
        "--load-format",
        "dcp",
        "--save-format",
        "hf",
        "--load-dir",
        str(step),
        "--base-dir",
        str(model),
        "--save-dir",
        str(out),
    )
    assert f"{step / '.metadata'} holds a pickled {REFUSED}" in line and not out.exists()
    line = mm("generate", "--load-dir", str(step), "--base-dir", str(model), "--prompt", "hi")
    assert f"{step / '.metadata'} holds a pickled {REFUSED}" in line
    line = mm("evaluate", "--load-dir", str(step), "--base-dir", str(model), "--task-data-path", str(data))
    assert f"{step / '.metadata'} holds a pickled {REFUSED}" in line


def test_rl_resume_runs_no_code(
    llm_run: tuple[str, Path], tmp_path: Path, evil: bytes, capsys: pytest.CaptureFixture
) -> None:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint
    from mindspeed_rl.cli import main

    save_tiny_checkpoint("llama2", tmp_path / "hf", seed=0)
    save = tmp_path / "run"
    state = json.dumps({"step": 2, "version": 2, "sampler": {}}).encode()
    common = (llm_run[1] / "iter_0000002" / "common.pt").read_bytes()
    step = _plant(save / "iter_0000002", {"rl_state.json": state, ".metadata": evil, "common.pt": common}, 2)
    argv = [f"actor.model={tmp_path / 'hf'}", "data.path=demo", "data.prompt_format=plain", f"checkpoint.save={save}"]
    line = _one_line(capsys, main(["--log-level", "ERROR", "grpo", *argv]), "mindspeed-rl")
    assert f"{step / '.metadata'} holds a pickled {REFUSED}" in line
