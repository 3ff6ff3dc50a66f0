"""``mindspeed-llm generate`` end to end on a tiny model with the demo tokenizer: streaming, batches,
chat template, prompt files, JSON Lines output, the interactive chat, and bad input (exit status 2)."""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_llm.cli import main
from mindspeed_llm.inference import InferenceEngine, SamplingParams
from mindspeed_llm.testing.tiny_models import TINY_CONFIGS
from mindspeed_llm.tokenizer import demo_tokenizer_path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 with the demo tokenizer's vocabulary (2048), its files and its end-of-text id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("generate-cli")
    tokenizer_dir = demo_tokenizer_path(cache_dir=root / "cache")
    config = TINY_CONFIGS.get("qwen3")()
    config.vocab_size = 2048
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)  # peaked logits: varied text
    path = root / "model"
    model.save_pretrained(path)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    eos = AutoTokenizer.from_pretrained(str(path)).eos_token_id
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path


@pytest.fixture(scope="session")
def reference(model_dir) -> InferenceEngine:
    return InferenceEngine.from_pretrained(model_dir)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_single_prompt_streams_the_completion(model_dir, reference, capsys, monkeypatch) -> None:
    import mindspeed_llm.inference.cli as cli

    chunks: list[str] = []
    write = cli._write
    monkeypatch.setattr(cli, "_write", lambda text: (chunks.append(text), write(text)))
    code, out, _ = run(capsys, "--load-dir", str(model_dir), "--prompt", "The river", "--max-new-tokens", "12")
    assert code == 0 and len(chunks) > 5  # the echo, then pieces as tokens arrive, then the newline
    tokenizer = reference.tokenizer
    (want,) = reference.generate([tokenizer("The river")["input_ids"]], SamplingParams(max_new_tokens=12))
    assert out == "The river" + tokenizer.decode(want.token_ids, skip_special_tokens=True) + "\n"


def test_batch_chat_sampling_and_jsonl_output(model_dir, reference, tmp_path, capsys) -> None:
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                "Tell me a story",
                {"instruction": "Name a colour", "input": "in French"},
                {
                    "messages": [
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"},
                        {"role": "user", "content": "Bye"},
                    ]
                },
            ]
        )
        + "\n"
    )
    output = tmp_path / "out" / "results.jsonl"
    flags = [
        "--load-dir",
        str(model_dir),
        "--prompt",
        "Why is the sky blue?",
        "--prompts-file",
        str(prompts_file),
        "--chat",
        "--system",
        "Be brief.",
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "9",
        "--output",
        str(output),
    ]
    code, out, _ = run(capsys, *flags)
    assert code == 0 and out.count("--- completion") == 4
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    tokenizer = reference.tokenizer
    system = [{"role": "system", "content": "Be brief."}]
    chats = [
        system + [{"role": "user", "content": "Why is the sky blue?"}],
        system + [{"role": "user", "content": "Tell me a story"}],
        system + [{"role": "user", "content": "Name a colour\nin French"}],
        rows[3]["prompt"]["messages"],
    ]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    params = SamplingParams(max_new_tokens=9, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    want = reference.generate(prompts, params)
    for row, prompt, expected in zip(rows, prompts, want):
        assert row["prompt_token_ids"] == list(prompt)
        assert row["token_ids"] == expected.token_ids and row["finish_reason"] == expected.finish_reason
        assert row["completion"] == tokenizer.decode(expected.token_ids, skip_special_tokens=True)
        assert len(row["logprobs"]) == len(row["token_ids"])
    assert run(capsys, *flags)[0] == 0
    assert [json.loads(line) for line in output.read_text().splitlines()] == rows  # the seed repeats the run


def test_text_prompts_file_and_interactive_chat(model_dir, tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    code, out, _ = run(
        capsys, "--load-dir", str(model_dir), "--prompts-file", str(tmp_path / "p.txt"), "--max-new-tokens", "3"
    )
    assert code == 0 and "--- prompt 1 ---\nsecond prompt\n" in out
    lines = iter(["hello there", "/reset", "again"])

    def fake_input(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(builtins, "input", fake_input)
    code, out, _ = run(capsys, "--load-dir", str(model_dir), "--chat", "--max-new-tokens", "4")
    assert code == 0 and out.count("model> ") == 2


def test_chat_and_prompts_from_a_pipe(model_dir, reference, capsys, monkeypatch) -> None:
    """``printf ... | generate --chat``: a turn per line until EOF; ``--prompts-file -`` and ``/dev/stdin``."""
    import io

    params = SamplingParams(max_new_tokens=3)
    monkeypatch.setattr(sys, "stdin", io.StringIO("first prompt\n\nsecond prompt\n"))
    code, out, _ = run(capsys, "--load-dir", str(model_dir), "--chat", "--max-new-tokens", "3")
    replies = out.splitlines()
    assert code == 0 and len(replies) == 2 and "model>" not in out and "you>" not in out
    from mindspeed_llm.inference.prompts import encode_prompt

    tok = reference.tokenizer
    (want,) = reference.generate([encode_prompt(tok, "first prompt", True, None)], params)
    assert replies[0] == tok.decode(want.token_ids, skip_special_tokens=True)
    monkeypatch.setattr(sys, "stdin", io.StringIO("first prompt\n\nsecond prompt\n"))
    code, out, _ = run(capsys, "--load-dir", str(model_dir), "--prompts-file", "-", "--max-new-tokens", "3")
    assert code == 0 and "--- prompt 0 ---\nfirst prompt\n" in out and "--- prompt 1 ---\nsecond prompt\n" in out
    # /dev/stdin is a pipe here, not a regular file (file descriptor 0 made a real pipe for the call)
    read_end, write_end = os.pipe()
    os.write(write_end, b"first prompt\n\nsecond prompt\n")
    os.close(write_end)
    saved = os.dup(0)
    try:
        os.dup2(read_end, 0)
        code, out, _ = run(
            capsys, "--load-dir", str(model_dir), "--prompts-file", "/dev/stdin", "--max-new-tokens", "3"
        )
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(read_end)
    assert code == 0 and "--- prompt 0 ---\nfirst prompt\n" in out and "--- prompt 1 ---\nsecond prompt\n" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--load-dir", "{missing}", "--prompt", "hi"], "--load-dir {missing} is not a directory"),
        (["--load-dir", "{model}", "--prompt", "a b c d e f g", "--max-seq-len", "4"], "prompt 0 has 7 tokens"),
        (["--load-dir", "{model}"], "nothing to generate"),
        (["--load-dir", "{model}", "--prompt", "hi", "--dtype", "float8"], "--dtype 'float8' is not one of"),
        (["--load-dir", "{model}", "--prompt", "hi", "--top-p", "1.5"], r"top_p must be in \(0, 1\]"),
        (["--load-dir", "{model}", "--prompts-file", "{missing}"], "--prompts-file {missing} does not exist"),
        (["--load-dir", "{bad_arch}", "--prompt", "hi"], "unsupported architecture GPT2LMHeadModel"),
        (
            ["--load-dir", "{bad_type}", "--prompt", "hi"],
            r"{bad_type}/config.json: unsupported model_type 'foobar' \(FoobarForCausalLM\); .*supported: .*Qwen3ForCausalLM",
        ),
        (["--load-dir", "{model}", "--prompts-file", "{model}"], "--prompts-file {model} is a directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(model_dir, tmp_path, capsys, flags: list[str], message: str) -> None:
    bad_arch = tmp_path / "bad"
    shutil.copytree(model_dir, bad_arch)
    config = json.loads((bad_arch / "config.json").read_text())
    (bad_arch / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    bad_type = tmp_path / "bad_type"
    shutil.copytree(model_dir, bad_type)
    (bad_type / "config.json").write_text(
        json.dumps({**config, "model_type": "foobar", "architectures": ["FoobarForCausalLM"]})
    )
    names = {
        "missing": str(tmp_path / "missing"),
        "model": str(model_dir),
        "bad_arch": str(bad_arch),
        "bad_type": str(bad_type),
    }
    output = tmp_path / "out.jsonl"
    code, out, err = run(capsys, *[f.format(**names) for f in flags], "--output", str(output))
    assert code == 2 and out == ""
    errors = [line for line in err.splitlines() if "error" in line]  # (stderr also carries the log)
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1] and errors[0].startswith("mindspeed-llm: error: ")
    assert re.search(message.format(**names), errors[0])
    assert "pip install" not in err  # our message, not transformers' advice to upgrade it
    assert not output.exists()
