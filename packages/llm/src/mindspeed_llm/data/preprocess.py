"""``preprocess_data``: raw records to Megatron indexed datasets, with a pool of tokenizer workers.

The main process reads records in order and sends them in chunks to ``workers`` processes
(a bounded window of chunks in flight, so memory stays flat on large inputs); results come
back in input order, so the output is byte-identical for any number of workers. A malformed
record stops the run with its file and line (exit status 2 from the CLI) unless
``skip_bad_records`` is set, in which case it is counted in the report. Output is written
under temporary names and renamed only at the end.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mindspeed.log import get_logger
from mindspeed_llm.data.handlers import HANDLERS, DatasetHandler, GeneralPretrainHandler
from mindspeed_llm.data.readers import RawRecord, iter_records, list_input_files
from mindspeed_llm.data.templates import BadRecordError
from mindspeed_llm.data.writer import IndexedOutputs, build_pack, dataset_prefix, import_indexed_dataset, pack_lengths
from mindspeed_llm.tokenizer import load_tokenizer, resolve_tokenizer_path

logger = get_logger(__name__)

CHUNK_SIZE = 64
#: How many bad-record messages the report keeps.
MAX_BAD_EXAMPLES = 5


@dataclass
class PreprocessConfig:
    """Settings of one ``preprocess-data`` run (the CLI flags, one field each).

    Attributes:
        input: a file or directory of jsonl/json/parquet/arrow/csv/txt files.
        tokenizer_name_or_path: a local Hugging Face tokenizer directory, or "demo".
        output_prefix: path prefix of the datasets written.
        handler_name: how records become samples (see HANDLERS).
        json_keys: columns to tokenize (GeneralPretrainHandler only; default text).
        append_eod: append the EOS id to every document or sample.
        seq_length: drop instruction/pairwise samples longer than this; the pack size with pack.
        pack: pack instruction samples into rows of exactly seq_length tokens.
        prompt_type: conversation template (see PROMPT_TYPES); default: the tokenizer's chat template.
        map_keys: column names per handler attribute, e.g. {"prompt": "question"}.
        workers: tokenizer processes.
        max_samples: read at most this many records.
        skip_bad_records: count malformed records and go on, instead of stopping at the first.
        log_interval: log progress every this many records.
    """

    input: str
    tokenizer_name_or_path: str
    output_prefix: str
    handler_name: str = "GeneralPretrainHandler"
    json_keys: list[str] | None = None
    append_eod: bool = False
    seq_length: int | None = None
    pack: bool = False
    prompt_type: str | None = None
    map_keys: dict[str, Any] | None = None
    workers: int = 1
    max_samples: int | None = None
    skip_bad_records: bool = False
    log_interval: int = 1000

    def validate(self) -> type[DatasetHandler]:
        """Check the flags against each other; returns the handler class.

        Raises:
            ValueError: naming the flag and the fix.
        """
        handler_cls = HANDLERS.get(self.handler_name)
        is_pretrain = issubclass(handler_cls, GeneralPretrainHandler)
        for name in ("workers", "log_interval", "max_samples", "seq_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.pack and not handler_cls.packable:
            raise ValueError(
                f"--pack applies to instruction handlers; {self.handler_name} output is not packed "
                "(pretraining documents are cut into sequences at training time)"
            )
        if self.pack and self.seq_length is None:
            raise ValueError("--pack needs --seq-length (the length of each packed row)")
        if self.json_keys is not None and not is_pretrain:
            raise ValueError(
                f"--json-keys applies to GeneralPretrainHandler; {self.handler_name} reads the columns "
                "named by --map-keys"
            )
        if self.map_keys is not None and not isinstance(self.map_keys, dict):
            raise ValueError('--map-keys must be a JSON object, e.g. \'{"prompt": "question"}\'')
        if not self.output_prefix or Path(self.output_prefix).name == "":
            raise ValueError(
                f"--output-prefix {self.output_prefix!r} must end with a file name prefix, e.g. data/alpaca"
            )
        handler_cls.resolve_columns(self.map_keys)
        return handler_cls


@dataclass
class PreprocessReport:
    """What a run read and wrote."""

    handler: str
    outputs: list[str] = field(default_factory=list)
    records: int = 0
    samples: int = 0
    packs: int | None = None
    tokens: int = 0
    skipped_bad: int = 0
    skipped_empty: int = 0
    skipped_too_long: int = 0
    bad_examples: list[str] = field(default_factory=list)
    workers: int = 1
    seconds: float = 0.0
    process_seconds: float = 0.0

    def describe(self) -> str:
        """A few lines for the terminal."""
        lines = [
            f"{self.handler}: {self.records} records read, {self.samples} written"
            + (f" in {self.packs} packed rows" if self.packs is not None else "")
            + f", {self.tokens} tokens with {self.workers} worker(s) in {self.seconds:.2f} s"
            + (
                f" ({self.process_seconds:.2f} s reading, tokenizing and writing: "
                f"{self.records / self.process_seconds:.0f} records/s)"
                if self.process_seconds > 0
                else ""
            )
        ]
        if self.skipped_bad:
            lines.append(f"skipped {self.skipped_bad} malformed record(s) (--skip-bad-records), e.g.:")
            lines += [f"  {example}" for example in self.bad_examples]
        if self.skipped_empty:
            lines.append(f"skipped {self.skipped_empty} empty text(s)")
        if self.skipped_too_long:
            lines.append(f"dropped {self.skipped_too_long} sample(s) longer than --seq-length")
        lines += [f"wrote {prefix}.bin/.idx" for prefix in self.outputs]
        return "\n".join(lines)


# -- per-record work, run in the main process or in a worker --------------------------------
_WORKER: dict[str, Any] = {}


def _init_worker(config: PreprocessConfig, tokenizer_path: str) -> None:
    if "handler" in _WORKER:  # forked: the parent's handler came along
        return
    handler_cls = HANDLERS.get(config.handler_name)
    _WORKER["handler"] = handler_cls(load_tokenizer(tokenizer_path), config)


def _process_chunk(chunk: list[RawRecord], handler: DatasetHandler | None = None) -> list[tuple[str, str, Any]]:
    """``(status, location, payload)`` per record: ok/bad/too_long with the sequences or the reason."""
    handler = handler or _WORKER["handler"]
    seq_length = handler.options.seq_length
    out = []
    for raw in chunk:
        if raw.error is not None:
            out.append(("bad", raw.location, raw.error))
            continue
        try:
            encoded = handler.encode(raw.data)
        except BadRecordError as err:
            out.append(("bad", raw.location, str(err)))
            continue
        too_long = seq_length is not None and handler.sample_length(encoded) > seq_length
        out.append(("too_long" if too_long else "ok", raw.location, encoded))
    return out


@contextlib.contextmanager
def _worker_pool(workers: int, config: PreprocessConfig, tokenizer_path: str, handler: DatasetHandler) -> Iterator[Any]:
    # Fork where it is safe (Linux): workers start in milliseconds with the parent's handler
    # instead of re-importing transformers and reloading the tokenizer. gc.freeze() keeps the
    # children's garbage collector from touching (and so copying) the parent's whole heap.
    # Setting TOKENIZERS_PARALLELISM keeps the Rust library from printing a warning in every
    # child when this process has trained or batch-encoded before.
    method = "fork" if sys.platform == "linux" else "spawn"
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if method == "fork":
        _WORKER["handler"] = handler
        gc.freeze()
    try:
        with multiprocessing.get_context(method).Pool(workers, _init_worker, (config, tokenizer_path)) as pool:
            if method == "fork":
                gc.unfreeze()
            yield pool
    finally:
        _WORKER.pop("handler", None)
        gc.unfreeze()
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _chunks(records: Iterator[RawRecord], max_samples: int | None) -> Iterator[list[RawRecord]]:
    records = itertools.islice(records, max_samples)
    while chunk := list(itertools.islice(records, CHUNK_SIZE)):
        yield chunk


def _results(
    config: PreprocessConfig, handler: DatasetHandler, tokenizer_path: str, chunks: Iterator[list[RawRecord]]
) -> Iterator[tuple[str, str, Any]]:
    """Processed records in input order, from this process or the pool."""
    if config.workers == 1:
        for chunk in chunks:
            yield from _process_chunk(chunk, handler)
        return
    with _worker_pool(config.workers, config, tokenizer_path, handler) as pool:
        window: deque = deque()
        for chunk in chunks:
            window.append(pool.apply_async(_process_chunk, (chunk,)))
            if len(window) >= 4 * config.workers:
                yield from window.popleft().get()
        while window:
            yield from window.popleft().get()


def preprocess_data(config: PreprocessConfig) -> PreprocessReport:
    """Tokenize ``config.input`` with the chosen handler and write the indexed datasets.

    Args:
        config: the run's settings.

    Returns:
        A :class:`PreprocessReport`.

    Raises:
        ValueError: bad flags, unreadable input or tokenizer, a malformed record (without
            ``skip_bad_records``), or no record to write. Nothing is written then.
    """
    start = time.perf_counter()
    handler_cls = config.validate()
    if config.seq_length is not None and issubclass(handler_cls, GeneralPretrainHandler):
        logger.warning(
            "--seq-length has no effect on %s: documents are cut into sequences at training time", config.handler_name
        )
    files = list_input_files(config.input)
    tokenizer_path = str(resolve_tokenizer_path(config.tokenizer_name_or_path))
    tokenizer = load_tokenizer(tokenizer_path)
    handler = handler_cls(tokenizer, config)  # checks prompt type / chat template before any work
    keys = handler.output_names()
    prefixes = {key: dataset_prefix(config.output_prefix, handler.output_suffix, key) for key in keys}
    if handler.output_suffix:  # int32: labels hold -100
        dtype: type[np.number] = np.int32
    else:
        dtype = import_indexed_dataset().DType.optimal_dtype(len(tokenizer))
    report = PreprocessReport(handler=config.handler_name, workers=config.workers)
    kept: list[dict[str, np.ndarray]] = []  # samples waiting to be packed
    outputs = IndexedOutputs(prefixes, dtype)
    work_start = time.perf_counter()  # after the one-off imports and tokenizer loading
    try:
        chunks = _chunks(iter_records(files), config.max_samples)
        results = contextlib.closing(_results(config, handler, tokenizer_path, chunks))
        with results as processed:  # closing it stops the pool at once when a record fails
            for status, location, payload in processed:
                report.records += 1
                if report.records % config.log_interval == 0:
                    logger.info(
                        "processed %d records (%.0f records/s)",
                        report.records,
                        report.records / (time.perf_counter() - start),
                    )
                if status == "bad":
                    if not config.skip_bad_records:
                        raise ValueError(f"{location}: {payload}; fix the record or pass --skip-bad-records")
                    report.skipped_bad += 1
                    if len(report.bad_examples) < MAX_BAD_EXAMPLES:
                        report.bad_examples.append(f"{location}: {payload}")
                elif status == "too_long":
                    report.skipped_too_long += 1
                elif config.pack:
                    kept.append(payload)
                else:
                    _write_sample(outputs, payload, report)
        if config.pack:
            _write_packs(outputs, kept, config.seq_length, _pad_id(tokenizer), report)
        if report.records == 0:
            raise ValueError(f"--input {config.input!r} holds no records")
        if report.samples == 0:
            raise ValueError(f"no sample to write: all {report.records} records were malformed, empty or too long")
        report.outputs = outputs.commit()
    except BaseException:
        outputs.abort()
        raise
    report.process_seconds = time.perf_counter() - work_start
    report.seconds = time.perf_counter() - start
    logger.debug("%s", report.describe())
    return report


def _write_sample(outputs: IndexedOutputs, sample: dict[str, np.ndarray | None], report: PreprocessReport) -> None:
    present = {key: seq for key, seq in sample.items() if seq is not None}
    report.skipped_empty += len(sample) - len(present)
    if not present:
        return
    if len(present) == len(sample):
        outputs.add_document(present)
    else:  # pretraining with several --json-keys: each key's dataset is independent
        for key, seq in present.items():
            outputs.add_to(key, seq)
    report.samples += 1
    report.tokens += len(next(iter(present.values())))


def _write_packs(
    outputs: IndexedOutputs,
    samples: list[dict[str, np.ndarray]],
    seq_length: int,
    pad_id: int,
    report: PreprocessReport,
) -> None:
    packs = pack_lengths([len(s["input_ids"]) for s in samples], seq_length)
    for pack in packs:
        outputs.add_document(build_pack([samples[i] for i in pack], seq_length, pad_id))
    report.packs = len(packs)
    report.samples = len(samples)
    report.tokens = sum(len(s["input_ids"]) for s in samples)


def _pad_id(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    raise ValueError("--pack pads rows with the pad (or EOS) token, and the tokenizer has neither")
