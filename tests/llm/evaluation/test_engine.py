"""Our path equals the reference: the same tiny model scored through the inference engine and through transformers."""

from __future__ import annotations

import json

import pytest
import torch

from mindspeed_llm.evaluation import EvalSettings, TransformersLM
from mindspeed_llm.evaluation.gsm8k import GSM8KTask
from mindspeed_llm.evaluation.mmlu import MMLUTask
from mindspeed_llm.evaluation.perplexity import PerplexityTask

from .conftest import write_gsm8k, write_mmlu, write_text

pytest.importorskip("mindspeed_llm.inference", reason="the inference engine is not in this install")

from mindspeed_llm.evaluation import EngineLM  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-data")
    return {
        "mmlu": MMLUTask().load(write_mmlu(root / "mmlu", {"alpha": 4, "beta": 4}), EvalSettings()),
        "gsm8k": GSM8KTask().load(write_gsm8k(root / "gsm8k", n_test=4), EvalSettings(shots=1)),
        "ppl": PerplexityTask().load(write_text(root / "ppl.jsonl", n_docs=3, words=60), EvalSettings()),
    }


@pytest.mark.parametrize("max_seq_len", [None, 40])  # 40: prompts and documents lose their left part
def test_engine_scores_equal_transformers(tiny_model_dir, tiny_hf, data, max_seq_len) -> None:
    model, tok = tiny_hf
    ours = EngineLM.from_pretrained(tiny_model_dir, batch_size=3, max_seq_len=max_seq_len)
    reference = TransformersLM(model, tok, batch_size=3, max_seq_len=max_seq_len)
    assert ours.max_seq_len == reference.max_seq_len
    settings = EvalSettings(shots=1, max_new_tokens=8, ppl_stride=7 if max_seq_len else None, show_progress=False)
    for task, run in (("mmlu", MMLUTask().run), ("gsm8k", GSM8KTask().run), ("ppl", PerplexityTask().run)):
        a, b = run(ours, data[task], settings), run(reference, data[task], settings)
        assert a.n == b.n
        if task == "ppl":
            assert a.value == pytest.approx(b.value, rel=1e-4)
            continue
        assert a.value == b.value and a.groups == b.groups
        assert [s["prediction"] for s in a.samples] == [s["prediction"] for s in b.samples]
        if task == "mmlu":
            torch.testing.assert_close(
                torch.tensor([s["loglikelihoods"] for s in a.samples]),
                torch.tensor([s["loglikelihoods"] for s in b.samples]),
                rtol=0,
                atol=1e-4,
            )
            if max_seq_len is None:  # the model does not answer one letter to all (it does with a 40-token window)
                assert len({s["prediction"] for s in a.samples}) > 1
        else:
            assert [s["generation"] for s in a.samples] == [s["generation"] for s in b.samples]
            assert sum(len(s["generation"]) for s in a.samples) > 0


def test_cli_engine_on_a_megatron_checkpoint(tmp_path, tiny_model_dir, capsys, restore_logging) -> None:
    """convert-ckpt to TP2 PP2 Megatron shards, evaluated by the engine (default backend) through the CLI."""
    from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint
    from mindspeed_llm.cli import main

    mg = tmp_path / "mg"
    convert_checkpoint(
        ConvertConfig(
            load_dir=tiny_model_dir,
            save_dir=mg,
            target_tensor_parallel_size=2,
            target_pipeline_parallel_size=2,
            progress=False,
        )
    )
    write_text(tmp_path / "ppl" / "docs.jsonl", n_docs=3, words=60)
    common = ["evaluate", "--task", "ppl", "--task-data-path", str(tmp_path / "ppl"), "--max-seq-len", "32"]
    assert main([*common, "--load-dir", str(mg), "--output", str(tmp_path / "ours.json")]) == 0
    assert (
        main(
            [
                *common,
                "--load-dir",
                str(tiny_model_dir),
                "--backend",
                "transformers",
                "--output",
                str(tmp_path / "ref.json"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    ours, ref = (json.loads((tmp_path / f"{name}.json").read_text())["results"][0] for name in ("ours", "ref"))
    assert ours["n"] == ref["n"] and ours["value"] == pytest.approx(ref["value"], rel=1e-4)
