"""lm-evaluation-harness backend: ``--model mindspeed`` equals lm-eval's own ``--model hf`` request by request.

One module, one tiny model, tiny local data: the three shipped ``mindspeed_*`` tasks (multiple
choice by log-likelihood, generate_until, rolling log-likelihood) and a standard lm-eval task
(``arc_easy``) pointed at a local JSONL copy by a YAML override, as docs/llm/evaluate.md shows.
The window is short (48 tokens) so 5-shot prompts are left-truncated and long documents roll over
several windows in both models.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

pytest.importorskip("mindspeed_llm.inference", reason="the inference engine is not in this install")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from mindspeed_llm.evaluation import EngineLM, EvalSettings  # noqa: E402
from mindspeed_llm.evaluation.gsm8k import GSM8KTask  # noqa: E402
from mindspeed_llm.evaluation.harness.model import register_harness_model  # noqa: E402
from mindspeed_llm.evaluation.harness.run import HARNESS_TASKS_DIR  # noqa: E402
from mindspeed_llm.evaluation.mmlu import MMLUTask  # noqa: E402
from mindspeed_llm.evaluation.perplexity import PerplexityTask  # noqa: E402

from .conftest import _arithmetic, write_gsm8k, write_mmlu, write_text  # noqa: E402

MAX_LENGTH = 48
GEN_TOKS = 8
TASKS = ["mindspeed_mmlu", "mindspeed_gsm8k", "mindspeed_ppl", "arc_easy_local"]


def write_arc(path, n: int) -> None:
    """ARC-format JSON Lines (question, choices.text/label, answerKey) of generated sums."""
    rng = random.Random(1)
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(n):
            question, *choices, answer = _arithmetic(rng)
            record = {"id": str(i), "question": question, "choices": {"text": choices, "label": list("ABCD")}}
            handle.write(json.dumps(record | {"answerKey": answer}) + "\n")


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Data of the three built-in tasks, a local arc_easy and the YAML that points arc_easy at it."""
    import lm_eval

    root = tmp_path_factory.mktemp("harness")
    write_mmlu(root / "mmlu", {"alpha": 3, "beta": 3})
    write_gsm8k(root / "gsm8k", n_test=3, n_train=1)
    docs = root / "ppl" / "docs.jsonl"
    write_text(docs, n_docs=3, words=14)
    with open(docs, "a", encoding="utf-8") as handle:  # one long document: several rolling windows
        handle.write(json.dumps({"text": " ".join(["the cat ran to the park and the sun was warm"] * 12)}) + "\n")
    write_arc(root / "arc.jsonl", 4)
    tasks = root / "tasks"
    tasks.mkdir()
    arc_yaml = f"{lm_eval.__path__[0]}/tasks/arc/arc_easy.yaml"
    (tasks / "arc_easy_local.yaml").write_text(
        f"include: {arc_yaml}\ntask: arc_easy_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'arc.jsonl'}\n    train: {root / 'arc.jsonl'}\n"
        "validation_split: null\n"
    )
    metadata = {
        "mindspeed_data": {"mmlu": str(root / "mmlu"), "gsm8k": str(root / "gsm8k"), "ppl": str(docs)},
        "mindspeed_shots": {"mmlu": 5, "gsm8k": 1},
    }
    return {"root": root, "tasks": tasks, "metadata": metadata, "docs": docs}


def run_harness(model: str, model_args: dict, local, tasks=TASKS, limit=None, **options) -> dict:
    manager = TaskManager(
        include_path=[str(HARNESS_TASKS_DIR), str(local["tasks"])], include_defaults=False, metadata=local["metadata"]
    )
    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=manager,
        log_samples=True,
        limit=limit,
        gen_kwargs={"max_gen_toks": GEN_TOKS},
        **options,
    )


@pytest.fixture(scope="module")
def runs(tiny_model_dir, local):
    register_harness_model()
    common = {"pretrained": str(tiny_model_dir), "max_length": MAX_LENGTH, "batch_size": 3, "dtype": "float32"}
    return {
        "mindspeed": run_harness("mindspeed", common, local),
        "hf": run_harness("hf", common | {"device": "cpu"}, local),
    }


def responses(output: dict, task: str) -> list[list]:
    """Per document (in order), its answers flattened: log-likelihoods, is_greedy flags or generated strings."""

    def flat(value) -> list:
        return [x for item in value for x in flat(item)] if isinstance(value, (list, tuple)) else [value]

    return [flat(s["resps"]) for s in sorted(output["samples"][task], key=lambda s: s["doc_id"])]


def assert_same_requests(ours: dict, theirs: dict, tasks: list[str], limit: int | None = None) -> None:
    """Every request's answer equal: log-likelihoods to 1e-5, is_greedy, generated strings; metrics equal."""
    for task in tasks:
        a, b = responses(ours, task), responses(theirs, task)[:limit]
        assert len(a) == len(b) > 0, task
        for doc_a, doc_b in zip(a, b):
            assert len(doc_a) == len(doc_b), task
            for value_a, value_b in zip(doc_a, doc_b):
                if isinstance(value_b, float):
                    assert value_a == pytest.approx(value_b, rel=1e-5, abs=1e-5), task
                else:  # is_greedy or a generated string
                    assert value_a == value_b, task
        if limit is None:
            for metric, value in theirs["results"][task].items():
                if isinstance(value, (int, float)) and "_stderr" not in metric:
                    assert ours["results"][task][metric] == pytest.approx(value, rel=1e-5), (task, metric)


def test_mindspeed_model_equals_lm_eval_hf(runs) -> None:
    ours, theirs = runs["mindspeed"], runs["hf"]
    assert set(ours["results"]) == set(TASKS)
    assert_same_requests(ours, theirs, TASKS)
    # a test that can fail: the model is not degenerate on these requests
    generations = [r[0] for r in responses(ours, "mindspeed_gsm8k")]
    assert sum(len(g) for g in generations) > 0
    lls = [r[0] for r in responses(ours, "mindspeed_mmlu")]
    assert len({round(x, 4) for x in lls}) > 1
    windows = sum(1 for s in ours["samples"]["mindspeed_ppl"] if len(s["doc"]["text"]) > 4 * MAX_LENGTH)
    assert windows == 1  # the long document rolls over several windows


def test_chat_template_and_multiturn_fewshot_pass_through(tiny_model_dir, local) -> None:
    """lm-eval's apply_chat_template / fewshot_as_multiturn / system_instruction: the same requests and answers as hf."""
    register_harness_model()
    common = {"pretrained": str(tiny_model_dir), "max_length": 4 * MAX_LENGTH, "batch_size": 2, "dtype": "float32"}
    options = {"apply_chat_template": True, "fewshot_as_multiturn": True, "system_instruction": "Be brief."}
    tasks = ["arc_easy_local", "mindspeed_gsm8k"]
    ours = run_harness("mindspeed", common, local, tasks, limit=2, num_fewshot=1, **options)
    theirs = run_harness("hf", common | {"device": "cpu"}, local, tasks, limit=2, num_fewshot=1, **options)
    assert_same_requests(ours, theirs, tasks)
    for task in tasks:
        prompts = [s["arguments"][0][0] for s in ours["samples"][task]]
        assert prompts == [s["arguments"][0][0] for s in theirs["samples"][task]]
        assert all(p.count("<|im_start|>") >= 2 and "Be brief." in p for p in prompts), prompts[0][:200]


def test_builtin_tasks_equal_through_the_harness(runs, tiny_model_dir, local) -> None:
    """mmlu, gsm8k and ppl: ``mindspeed-llm evaluate --task`` numbers equal the mindspeed_* harness tasks'."""
    ours = runs["mindspeed"]
    lm = EngineLM.from_pretrained(tiny_model_dir, batch_size=3, max_seq_len=MAX_LENGTH + 1)  # lm-eval's window + 1
    settings = EvalSettings(shots=5, show_progress=False)
    mmlu = MMLUTask().run(lm, MMLUTask().load(local["root"] / "mmlu", settings), settings)
    assert ours["results"]["mindspeed_mmlu"]["acc,none"] == pytest.approx(mmlu.value)
    harness_ll = [doc[0::2] for doc in responses(ours, "mindspeed_mmlu")]  # (loglikelihood, is_greedy) per letter
    torch.testing.assert_close(
        torch.tensor(harness_ll), torch.tensor([s["loglikelihoods"] for s in mmlu.samples]), rtol=1e-5, atol=1e-5
    )

    settings = EvalSettings(shots=1, max_new_tokens=GEN_TOKS, show_progress=False)
    # lm-eval keeps max_length - max_gen_toks prompt tokens: our window is max_length for generation
    gen_lm = EngineLM(lm.engine, batch_size=3, max_seq_len=MAX_LENGTH)
    gsm = GSM8KTask().run(gen_lm, GSM8KTask().load(local["root"] / "gsm8k", settings), settings)
    assert ours["results"]["mindspeed_gsm8k"]["exact_match,none"] == pytest.approx(gsm.value)
    assert [r[0] for r in responses(ours, "mindspeed_gsm8k")] == [s["generation"] for s in gsm.samples]

    # Perplexity: ours scores every token after the first (transformers' loss); lm-eval's rolling scores
    # the first too, conditioned on BOS (EOS for this tokenizer, which adds none). So our ppl task on each
    # document with the EOS text in front equals lm-eval's rolling log-likelihood, long documents (several
    # windows of the same size) included.
    settings = EvalSettings(show_progress=False)
    documents = PerplexityTask().load(local["docs"], settings)
    documents.documents = [lm.tokenizer.eos_token + text for text in documents.documents]
    ppl = PerplexityTask().run(lm, documents, settings)
    rolling = [r[0] for r in responses(ours, "mindspeed_ppl")]
    assert [-s["nll"] for s in ppl.samples] == pytest.approx(rolling, rel=1e-5, abs=1e-5)
    assert max(s["tokens"] for s in ppl.samples) > 2 * MAX_LENGTH


def test_megatron_checkpoint_through_the_cli_equals_its_hf_export(
    runs, tmp_path, tiny_model_dir, local, capsys, restore_logging
) -> None:
    """convert-ckpt to TP2 PP2 shards; ``evaluate --harness`` on them gives the HF directory's answers."""
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
    data = local["metadata"]["mindspeed_data"]
    argv = ["evaluate", "--harness", "--load-dir", str(mg), "--tasks", "mindspeed_mmlu,mindspeed_gsm8k,mindspeed_ppl"]
    argv += ["--include-path", str(local["tasks"]), "--task-data-path", data["mmlu"], data["gsm8k"], data["ppl"]]
    argv += ["--shots", "mmlu=5,gsm8k=1", "--max-seq-len", str(MAX_LENGTH), "--max-new-tokens", str(GEN_TOKS)]
    argv += ["--evaluation-batch-size", "3", "--limit", "2", "--output-dir", str(tmp_path / "out"), "--log-samples"]
    assert main(argv) == 0
    assert "mindspeed_mmlu" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    lm_eval_doc = json.loads((tmp_path / "out" / "lm_eval_results.json").read_text())
    samples = json.loads((tmp_path / "out" / "lm_eval_samples.json").read_text())
    assert {r["task"] for r in report["results"]} == {"mindspeed_mmlu", "mindspeed_gsm8k", "mindspeed_ppl"}
    assert_same_requests(
        {"samples": samples}, runs["mindspeed"], ["mindspeed_mmlu", "mindspeed_gsm8k", "mindspeed_ppl"], limit=2
    )
    assert all(lm_eval_doc["n-samples"][t]["effective"] == 2 for t in samples)


def test_lm_eval_cli_runs_the_mindspeed_model(tiny_model_dir, local, monkeypatch, tmp_path, restore_logging) -> None:
    """``mindspeed-lm-eval run --model mindspeed`` (lm-eval's own CLI) resolves our model and writes its results."""
    import lm_eval.tasks

    from mindspeed_llm.evaluation.harness import cli

    real = lm_eval.tasks.TaskManager  # lm-eval's CLI indexes its 14k tasks (20 s); the local ones suffice here
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: real(**kw, include_defaults=False))
    args = f"pretrained={tiny_model_dir},max_length={MAX_LENGTH}"
    argv = ["mindspeed-lm-eval", "run", "--model", "mindspeed", "--model_args", args, "--tasks", "mindspeed_ppl"]
    argv += [
        "--include_path",
        str(HARNESS_TASKS_DIR),
        "--limit",
        "1",
        "--batch_size",
        "2",
        "--output_path",
        str(tmp_path / "res"),
    ]
    argv += ["--metadata", json.dumps({"mindspeed_data": {"ppl": str(local["docs"])}})]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    written = list((tmp_path / "res").rglob("results_*.json"))
    assert len(written) == 1
    result = json.loads(written[0].read_text())
    assert result["config"]["model"] == "mindspeed" and "mindspeed_ppl" in result["results"]


def test_harness_bad_input_exits_2(tiny_model_dir, tmp_path, monkeypatch, capsys, restore_logging) -> None:
    from mindspeed_llm.cli import main

    def fails(argv: list[str], one_line: bool = True) -> str:
        assert main(["evaluate", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and (len(err.splitlines()) == 1 or not one_line)
        assert err.splitlines()[-1].startswith("mindspeed-llm: error:")
        return err.splitlines()[-1]

    base = ["--load-dir", str(tiny_model_dir), "--tasks", "mindspeed_ppl"]
    assert "is not a directory" in fails(["--harness", *base, "--include-path", str(tmp_path / "nope")])
    assert "--harness" in fails(
        ["--load-dir", str(tiny_model_dir), "--tasks", "ppl", "--task-data-path", "demo", "--num-fewshot", "3"]
    )
    assert "mindspeed_* tasks only" in fails(
        ["--harness", "--load-dir", str(tiny_model_dir), "--tasks", "x", "--task-data-path", "demo"]
    )
    import datasets.config

    hub_tasks = tmp_path / "hub"  # a task whose data are on the Hub only: offline, one line naming the fix
    hub_tasks.mkdir()
    (hub_tasks / "hub_only.yaml").write_text(
        "task: hub_only\ndataset_path: nonexistent-org/none\noutput_type: loglikelihood_rolling\n"
        "test_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
    )
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as on a machine without the Hub
    # found once lm-eval builds the task, after the model's load log lines: the error is the last line
    err = fails(
        ["--harness", "--load-dir", str(tiny_model_dir), "--tasks", "hub_only", "--include-path", str(hub_tasks)],
        one_line=False,
    )
    assert "hub_only" in err and "dataset_path" in err and "local copy" in err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if the eval extra were not installed
    assert "mindspeed-llm[eval]" in fails(["--harness", *base])
    assert not (tmp_path / "out").exists()
