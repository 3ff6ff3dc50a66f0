"""``mindspeed-llm quickstart``: raw text to a trained tiny Llama in a few minutes, on a laptop CPU.

Each step is an ordinary piece of the suite: ``preprocess-data`` tokenizes the demo corpus
shipped with the package with the demo tokenizer (skipped when its output is already there),
``pretrain`` trains the packaged ``tiny_cpu.yaml`` recipe (the same file as
``examples/llm/tiny_cpu.yaml``) on it and exports the result as a Hugging Face directory
(``checkpoint.save_hf``), and the built-in inference engine continues a prompt with it.
Everything goes under one output directory: ``data/``, ``checkpoints/``, ``hf/``, the metrics
and ``report.txt`` (the run's full log).

Run again in the same directory, it continues that run: ``train.steps`` above the saved step
resumes and trains on to it (the learning-rate schedule goes on from the saved step with the new
settings: ``checkpoint.override_scheduler`` is on unless ``checkpoint.use_checkpoint_scheduler=true``
keeps the saved one); at or below, nothing is trained and one line says so (exit 0). A second
quickstart on the same directory while one runs stops at once (exit 2, the run lock).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mindspeed.checkpointing import find_resume, run_lock
from mindspeed.launch import launch
from mindspeed.log import get_logger
from mindspeed_llm.data.preprocess import PreprocessConfig, preprocess_data
from mindspeed_llm.inference import InferenceEngine, SamplingParams
from mindspeed_llm.tokenizer import DEMO_CORPUS, DEMO_TOKENIZER_NAME
from mindspeed_llm.training.config import load_pretrain_config
from mindspeed_llm.training.trainer import pretrain

logger = get_logger(__name__)

#: The packaged copy of ``examples/llm/tiny_cpu.yaml``.
TINY_CPU_RECIPE = Path(__file__).resolve().parent / "recipes" / "tiny_cpu.yaml"


def prepare_demo_data(output_dir: Path) -> str:
    """Tokenize the shipped demo corpus into ``output_dir/data`` (once); returns the dataset prefix."""
    prefix = output_dir / "data" / "demo"
    dataset = f"{prefix}_text_document"
    if Path(dataset + ".bin").is_file() and Path(dataset + ".idx").is_file():
        logger.info("quickstart: reusing %s.bin/.idx", dataset)
        return dataset
    report = preprocess_data(
        PreprocessConfig(
            input=str(DEMO_CORPUS),
            tokenizer_name_or_path=DEMO_TOKENIZER_NAME,
            output_prefix=str(prefix),
            append_eod=True,
        )
    )
    logger.info("quickstart: %s", report.describe())
    return dataset


def add_quickstart(sub: argparse._SubParsersAction) -> None:
    """Add ``quickstart`` to the ``mindspeed-llm`` subcommands."""
    parser = sub.add_parser(
        "quickstart",
        help="preprocess the demo corpus and pretrain a tiny Llama on it (a few minutes on a CPU)",
        description="Tokenize the demo corpus shipped with mindspeed-llm, then pretrain the tiny_cpu recipe on it. "
        "Overrides go to the recipe, e.g. train.steps=100. Run again with the same --output-dir, it "
        "continues that run: train.steps above the saved step trains on to it, at or below it trains "
        "nothing and says so.",
    )
    parser.add_argument(
        "--output-dir",
        default="runs/quickstart",
        help="where data, checkpoints and metrics go (default runs/quickstart)",
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks to spawn (default 1)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. train.steps=100")
    parser.set_defaults(func=run_quickstart)


def run_quickstart(args: argparse.Namespace) -> int:
    """Run ``quickstart`` from parsed arguments; returns the exit status."""
    out = Path(args.output_dir)
    # Check the overrides before spending time on the data.
    ck = load_pretrain_config(TINY_CPU_RECIPE, args.overrides).checkpoint
    # Continuing with other settings (more train.steps: a longer decay) restarts the schedule from
    # them at the saved step, unless the overrides say the saved schedule wins.
    schedule = [] if ck.override_scheduler or ck.use_checkpoint_scheduler else ["checkpoint.override_scheduler=true"]
    dataset = prepare_demo_data(out)
    config = load_pretrain_config(
        TINY_CPU_RECIPE,
        [
            f"data.prefixes=[{dataset}]",
            f"checkpoint.save={out / 'checkpoints'}",
            f"checkpoint.save_hf={out / 'hf'}",
            f"logging.dir={out}",
            *schedule,
            *args.overrides,
        ],
    )
    config.check(args.nproc_per_node)
    with run_lock(config.checkpoint.save):  # one run per output directory
        return _train_and_report(config, args, out)


def _train_and_report(config: Any, args: argparse.Namespace, out: Path) -> int:
    steps = config.train.steps
    # The step the trainer would resume from (the same discovery), without building anything.
    saved = find_resume(config.checkpoint.save, warn=False).step if config.checkpoint.resume else None
    if saved is not None and saved >= steps and not config.checkpoint.load:
        _say_nothing_to_train(config, saved)
        return 0
    result = launch(pretrain, (config,), nproc_per_node=args.nproc_per_node, log_level=args.log_level)
    if result.stopped:
        logger.error("quickstart: training stopped early: %s", result.stopped)
        return 1
    if result.preempted:
        return result.exit_code
    if not result.records:  # resumed at or past train.steps after all
        _say_nothing_to_train(config, int(result.state.get("step", 0)))
        return 0
    if result.records[0]["step"] > 1:
        logger.info(
            "quickstart: resumed the run in %s at step %d and trained on to train.steps=%d",
            out / "checkpoints",
            result.records[0]["step"] - 1,
            steps,
        )
    trained = [r for r in result.records if not r["skipped"]]
    if trained:
        logger.info(
            "quickstart: loss %.3f at step %d -> %.3f at step %d%s",
            trained[0]["loss"],
            trained[0]["step"],
            trained[-1]["loss"],
            trained[-1]["step"],
            f"; validation loss {result.evals[-1]['loss']:.3f}" if result.evals else "",
        )
    logger.info(
        "quickstart: checkpoints in %s, metrics in %s (and TensorBoard events), loss curve %s",
        out / "checkpoints",
        out / "metrics.jsonl",
        out / "loss.png",
    )
    hf = Path(config.checkpoint.save_hf)
    if (hf / "config.json").is_file():
        logger.info("quickstart: Hugging Face model in %s; %r continues as %r", hf, PROMPT, continue_prompt(hf, PROMPT))
    return 0


def _say_nothing_to_train(config: Any, reached: int) -> None:
    """The run in the output directory is at or past train.steps: one line, rather than a stale summary."""
    steps = config.train.steps
    logger.info(
        "quickstart: %s already holds step %d, at or past train.steps=%d: nothing to train. Give "
        "train.steps above %d to train on, or a new --output-dir for a fresh run (the model is in %s)",
        config.checkpoint.save,
        reached,
        steps,
        reached,
        config.checkpoint.save_hf,
    )


#: The prompt the quickstart's model continues at the end.
PROMPT = "The river"


def continue_prompt(model_dir: Path, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy continuation of ``prompt`` by the model in ``model_dir`` (the built-in inference engine)."""
    engine = InferenceEngine.from_pretrained(model_dir, max_batch_size=1)
    ids = engine.tokenizer(prompt)["input_ids"]
    (out,) = engine.generate([ids], SamplingParams(max_new_tokens=max_new_tokens))
    return engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
