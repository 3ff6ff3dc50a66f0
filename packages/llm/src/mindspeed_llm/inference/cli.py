"""The ``mindspeed-llm generate`` subcommand: prompts in, completions out, with the built-in engine.

Flags come from :class:`GenerateConfig` (``max_new_tokens`` -> ``--max-new-tokens``) plus the
repeatable ``--prompt``. A single prompt streams its tokens to the terminal as they are made;
several are generated together (continuous batching) and printed when done. ``--chat`` applies
the tokenizer's chat template, and without prompts holds a conversation: in a terminal, or a turn
per line of standard input when it is a pipe. ``--prompts-file -`` reads prompts from standard
input. Bad input
(a missing directory, an unknown family, a prompt longer than ``--max-seq-len``) ends with one
line on standard error and exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger
from mindspeed.suite_cli import add_dataclass_flags
from mindspeed_llm.inference import InferenceEngine, SamplingParams
from mindspeed_llm.inference.prompts import encode_prompt, prompt_text, read_prompts

logger = get_logger(__name__)


@dataclass(kw_only=True)
class GenerateConfig:
    """Every ``generate`` option besides ``--prompt`` (the CLI flags are these names with dashes).

    Attributes:
        load_dir: the model: a Hugging Face directory or a Megatron checkpoint (any TP/PP/EP layout).
        hf_cfg_dir: directory with config.json and tokenizer files (for a Megatron checkpoint
            without the hf_config folder convert-ckpt leaves in it, or to take another tokenizer).
        model_type_hf: family override (llama2, mistral, qwen25, qwen3, mixtral, qwen3-moe).
        prompts_file: prompts, one per line (.txt) or one JSON value per line (.jsonl: a string,
            or an object with prompt, text, instruction (+ input) or messages); ``-`` (or
            ``/dev/stdin``) reads text lines from standard input.
        chat: apply the tokenizer's chat template; with no prompt, a conversation: interactive in a
            terminal, else a turn per line of standard input until its end.
        system: system message of --chat conversations.
        max_new_tokens: tokens to generate per prompt at most.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_k: sample among the k most likely tokens (0: all).
        top_p: sample among the most likely tokens whose probability reaches p (1: all).
        seed: seed of every request's random stream (sampling is repeatable with it).
        ignore_eos: keep generating past the end-of-sequence token.
        batch_size: prompts decoded at once (KV-cache slots); more wait and join as slots free up.
        max_seq_len: prompt plus generated tokens per prompt (default: the model's max_position_embeddings).
        dtype: compute dtype: float32, bfloat16 or float16 (default: the checkpoint's).
        output: write the results here as JSON Lines (prompt, completion, token ids, logprobs).
        stream: print a single prompt's tokens as they are produced.
        compile: run the decode step under torch.compile (dense models; one graph per batch bucket,
            compiled on first use: worth it for long or many generations, not for one short reply).
    """

    load_dir: Path
    hf_cfg_dir: Path | None = None
    model_type_hf: str | None = None
    prompts_file: Path | None = None
    chat: bool = False
    system: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    batch_size: int = 8
    max_seq_len: int | None = None
    dtype: str | None = None
    output: Path | None = None
    stream: bool = True
    compile: bool = False


def add_generate(sub: argparse._SubParsersAction) -> None:
    """Add ``generate`` to the ``mindspeed-llm`` subcommands."""
    parser = sub.add_parser(
        "generate",
        help="generate text with a Hugging Face or Megatron checkpoint (KV cache, continuous batching)",
        description="Generate completions with the built-in inference engine. One prompt streams to the terminal; "
        "several are batched. --chat without a prompt holds a conversation (a turn per line when standard "
        "input is a pipe); --prompts-file - reads prompts from standard input.",
    )
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    add_dataclass_flags(parser, GenerateConfig)
    parser.set_defaults(func=run_generate)


def _config(args: argparse.Namespace) -> GenerateConfig:
    names = {f.name for f in dataclasses.fields(GenerateConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    for key in ("load_dir", "hf_cfg_dir", "prompts_file", "output"):
        if values.get(key) is not None:
            values[key] = Path(values[key])
    return GenerateConfig(**values)


def run_generate(args: argparse.Namespace) -> int:
    """Run ``generate`` from parsed arguments; returns the exit status."""
    config = _config(args)
    records: list[Any] = list(args.prompt)
    if config.prompts_file is not None:
        records += read_prompts(config.prompts_file)
    conversation = not records and config.chat
    if not records and not conversation:
        raise ValueError(
            "nothing to generate: give --prompt TEXT, --prompts-file FILE (- for standard input), or --chat"
        )
    params = SamplingParams(
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        seed=config.seed,
        ignore_eos=config.ignore_eos,
    )
    if config.output is not None and config.output.is_dir():
        raise ValueError(f"--output {config.output} is a directory; give a file name")
    engine = InferenceEngine.from_pretrained(
        config.load_dir,
        config.dtype,
        config.batch_size,
        config.max_seq_len,
        hf_cfg_dir=config.hf_cfg_dir,
        model_type_hf=config.model_type_hf,
        compile=config.compile,
    )
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError(f"{config.load_dir} has no tokenizer files; pass --hf-cfg-dir with the model's tokenizer")
    if conversation:
        return _chat_loop(engine, params, config, sys.stdin.isatty())
    prompts = [encode_prompt(tokenizer, record, config.chat, config.system) for record in records]
    started = time.perf_counter()
    # The prompt is echoed with the first token: a prompt the engine refuses prints nothing.
    echo = "" if config.chat else prompt_text(records[0])
    printer = _StreamPrinter(tokenizer, echo) if config.stream and len(prompts) == 1 else None
    outputs = engine.generate(prompts, params, stream=printer)
    elapsed = time.perf_counter() - started
    completions = [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]
    if printer is not None:
        printer.finish()
    else:
        for index, (record, output, text) in enumerate(zip(records, outputs, completions)):
            _write(
                f"--- prompt {index} ---\n{prompt_text(record)}\n"
                f"--- completion {index} ({output.finish_reason}, {len(output.token_ids)} tokens) ---\n{text}\n"
            )
    if config.output is not None:
        _write_jsonl(
            config.output,
            [
                {
                    "index": i,
                    "prompt": record,
                    "completion": text,
                    "prompt_token_ids": o.prompt_token_ids,
                    "token_ids": o.token_ids,
                    "logprobs": o.logprobs,
                    "finish_reason": o.finish_reason,
                }
                for i, (record, o, text) in enumerate(zip(records, outputs, completions))
            ],
        )
    generated = sum(len(o.token_ids) for o in outputs)
    logger.info(
        "generate: %d prompts, %d tokens in %.2f s (%.1f tokens/s)%s",
        len(prompts),
        generated,
        elapsed,
        generated / max(elapsed, 1e-9),
        f"; wrote {config.output}" if config.output else "",
    )
    return 0


def _next_turn(interactive: bool) -> str | None:
    """The user's next line; ``None`` at the end (EOF, or an empty line in a terminal)."""
    if interactive:
        try:
            line = input("you> ").strip()
        except EOFError:
            _write("\n")
            return None
        return line or None
    while line := sys.stdin.readline():  # a pipe: every non-empty line is a turn, until EOF
        if line.strip():
            return line.strip()
    return None


def _chat_loop(engine: Any, params: Any, config: GenerateConfig, interactive: bool) -> int:
    """One conversation, a turn per line: from the terminal (``you>`` / ``model>``), or from a pipe
    (standard input until EOF; the replies are printed one per line)."""
    messages = [{"role": "system", "content": config.system}] if config.system else []
    if interactive:
        _write("chat with the model: an empty line or /exit ends, /reset clears the conversation\n")
    while True:
        line = _next_turn(interactive)
        if line is None or line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = messages[:1] if config.system else []
            continue
        messages.append({"role": "user", "content": line})
        try:
            prompt = encode_prompt(engine.tokenizer, {"messages": messages}, True, None)
            printer = _StreamPrinter(engine.tokenizer)
            if interactive:
                _write("model> ")
            (output,) = engine.generate([prompt], params, stream=printer)
        except ValueError as err:  # e.g. the conversation outgrew --max-seq-len: say so, keep the session
            messages.pop()
            _write(f"\n(error: {err})\n")
            continue
        printer.finish()
        messages.append(
            {"role": "assistant", "content": engine.tokenizer.decode(output.token_ids, skip_special_tokens=True)}
        )


class _StreamPrinter:
    """Prints one request's text as its tokens arrive (decoding the whole reply each time, so that
    multi-byte characters split over tokens appear once complete)."""

    def __init__(self, tokenizer: Any, echo: str = "") -> None:
        self.tokenizer, self.echo, self.ids, self.shown = tokenizer, echo, [], ""

    def __call__(self, index: int, token: int) -> None:
        if not self.ids and self.echo:
            _write(self.echo)
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        if text.startswith(self.shown):
            _write(text[len(self.shown) :])
        self.shown = text

    def finish(self) -> None:
        _write("\n")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    # Temporary name then rename: an interrupted run never leaves half a file under the real name.
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with open(temp, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(temp, path)
