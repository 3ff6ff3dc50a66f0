"""Shared fixtures: the demo tokenizer, a tiny Llama sized to it, and tiny generated data sets."""

from __future__ import annotations

import csv
import json
import logging
import random
from pathlib import Path

import pytest
import torch

from mindspeed_llm.testing.tiny_models import TINY_CONFIGS
from mindspeed_llm.tokenizer import demo_tokenizer_path


@pytest.fixture
def restore_logging():
    """Undo the CLI's ``setup_logging``: its handler holds this test's captured stderr, closed afterwards."""
    from mindspeed.log import _HANDLER_NAME, PACKAGE_LOGGERS

    yield
    for name in PACKAGE_LOGGERS:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
            logger.removeHandler(handler)
        logger.propagate, logger.level = True, logging.NOTSET


@pytest.fixture(scope="session")
def demo_tok_dir(tmp_path_factory) -> Path:
    """The demo BPE tokenizer in a private cache ("demo" resolves there during these tests)."""
    root = tmp_path_factory.mktemp("mindspeed-cache")
    path = demo_tokenizer_path(cache_dir=root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINDSPEED_CACHE_DIR", str(root))
        yield path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_tok_dir) -> Path:
    """A tiny random Llama with the demo tokenizer's vocabulary, saved as a Hugging Face directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_tok_dir), local_files_only=True)
    config = TINY_CONFIGS.get("llama2")()
    config.vocab_size = len(tok)
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # sharper logits than the init gives, so generations are not all one token
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    out = tmp_path_factory.mktemp("tiny-eval-model")
    model.save_pretrained(out)
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir):
    """``(model, tokenizer)`` loaded from :func:`tiny_model_dir` with plain transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


def _arithmetic(rng: random.Random) -> list[str]:
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    right = a + b
    wrong = rng.sample([right - 2, right - 1, right + 1, right + 3, right + 10], 3)
    letter = rng.randrange(4)
    choices = wrong[:letter] + [right] + wrong[letter:]
    return [f"What is {a} + {b}?", *map(str, choices), "ABCD"[letter]]


def write_mmlu(root: Path, subjects: dict[str, int], seed: int = 0, dev_rows: int = 5) -> Path:
    """An MMLU-format directory: ``dev_rows`` dev and the given number of test questions per subject."""
    rng = random.Random(seed)
    for split in ("dev", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
    for subject, n_test in subjects.items():
        for split, rows in (("dev", dev_rows), ("test", n_test)):
            with open(root / split / f"{subject}_{split}.csv", "w", newline="", encoding="utf-8") as handle:
                csv.writer(handle).writerows(_arithmetic(rng) for _ in range(rows))
    return root


def write_gsm8k(root: Path, n_test: int, n_train: int = 3, seed: int = 0) -> Path:
    """A GSM8K-format directory (train.jsonl, test.jsonl) of generated sums."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", n_train), ("test", n_test)):
        with open(root / f"{split}.jsonl", "w", encoding="utf-8") as handle:
            for _ in range(rows):
                a, b = rng.randint(100, 2000), rng.randint(2, 30)
                record = {
                    "question": f"Tom has {a} stones and finds {b} more. How many stones does he have?",
                    "answer": f"He has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} stones.\n#### {a + b:,}",
                }
                handle.write(json.dumps(record) + "\n")
    return root


def write_text(path: Path, n_docs: int, seed: int = 0, words: int = 40) -> Path:
    """A JSON Lines file of ``n_docs`` documents of random common words."""
    rng = random.Random(seed)
    vocab = "the a cat dog ran to park and sun was warm cold tree leaf red green blue child smiled home".split()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(n_docs):
            text = " ".join(rng.choice(vocab) for _ in range(rng.randint(words // 2, words))) + "."
            handle.write(json.dumps({"text": text.capitalize()}) + "\n")
    return path
