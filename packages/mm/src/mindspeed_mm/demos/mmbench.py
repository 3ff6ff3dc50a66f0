"""The demo's held-out questions as an MMBench-style TSV (``--task-data-path demo``).

Each held-out question of :mod:`mindspeed_mm.demos.vlm` becomes one row: the question as the demo asks
it, the candidate answers as options (colours: red, green, blue, yellow; shapes: square, circle,
triangle, column D empty), the right letter, the image as base64 and the question kind as
``category``. Written once beside the held-out split (``runs/mm-demo/v1/data/demo.tsv``: its stem is the task's
name in the report).
"""

from __future__ import annotations

from pathlib import Path

from mindspeed_mm.data.mllm import read_mllm_files
from mindspeed_mm.demos.vlm import COLOURS, QUESTIONS, SHAPES, demo_paths
from mindspeed_mm.evaluation.data import LETTERS, encode_image_base64, write_mmbench_tsv

#: The ``--task-data-path`` name of the demo set.
DEMO_TASK = "demo"


def write_demo_mmbench_tsv(heldout: str | Path, target: str | Path) -> Path:
    """Turn the demo's held-out mllm_format file into an MMBench-style TSV at ``target``."""
    rows = []
    for number, sample in enumerate(read_mllm_files([str(heldout)])):
        question, answer = sample.messages[0]["content"], sample.messages[1]["content"]
        kind = "colour" if question == QUESTIONS["colour"] else "shape"
        options = list(COLOURS) if kind == "colour" else list(SHAPES)
        row = {
            "index": str(number),
            "question": question.replace("<image>", ""),
            "answer": LETTERS[options.index(answer)],
            "image": encode_image_base64(sample.images[0]),
            "category": kind,
        }
        row.update(zip(LETTERS, options))
        rows.append(row)
    return write_mmbench_tsv(target, rows)


def demo_mmbench_tsv() -> Path:
    """The demo's held-out TSV (built, with the demo model and data, on first use)."""
    heldout = demo_paths()["heldout"]
    target = heldout.with_name(f"{DEMO_TASK}.tsv")
    if not target.is_file():
        write_demo_mmbench_tsv(heldout, target)
    return target
