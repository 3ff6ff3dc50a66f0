"""Run the side-by-side benches and write the main table of docs/performance.md (regenerated, not hand-edited).

Each bench of :data:`BENCHES` runs in a fresh interpreter with ``--json`` (``--quick``: its smoke
size, for CI and a first look; without it: its default size, by hand on a quiet machine). Every
row is one of ours next to its peer: the ratio in wall time and in CPU time of the process, our
step in wall and CPU seconds, both peak RSS, the load average around the runs, the date, the
command that reproduces the row, and the goal. The table replaces what lies between the
``report.py`` markers of the page; the rest of the page is left as it is. Usage::

    uv run --frozen python tools/bench/report.py --quick                 # every bench at its smoke size
    uv run --frozen python tools/bench/report.py                         # full size, a quiet machine
    uv run --frozen python tools/bench/report.py --benches pretrain grpo --output /tmp/perf.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path

BEGIN, END = "<!-- begin: tools/bench/report.py writes this table -->", "<!-- end: tools/bench/report.py -->"
QUICK_NOTE = "--quick: smoke sizes, so the ratios are a check that the benches run, not their verdict"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "performance.md"

#: One pair: (row label, our side, the peer's side), each a bench's result dictionary.
Pair = tuple[str, dict[str, Any], dict[str, Any]]


@dataclass(frozen=True)
class Bench:
    """A bench of the report: its script, its arguments at each size, its pairs and its goal."""

    script: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    pairs: Callable[[Any], list[Pair]]
    goal: str


def _named_pairs(payload: Any, ours: str, peer: str) -> list[Pair]:
    """One pair per result of ``payload["results"]`` whose name starts with ``ours``, each against ``peer``'s."""
    results = payload["results"]
    return [(name, results[name], results[peer]) for name in results if name.startswith(ours)]


def _vlm_pairs(payload: Any) -> list[Pair]:
    """vlm.py lists each of ours before the HF run of the same kind."""
    items = list(payload["results"].items())
    return [(name, ours, peer) for (name, ours), (_, peer) in zip(items[::2], items[1::2])]


def _dit_pairs(payload: Any) -> list[Pair]:
    (name, ours), (_, peer) = payload["part1"]["results"].items()
    return [(name, ours, peer)]


def _generate_pairs(payload: Any) -> list[Pair]:
    """generate.py's rows (one per batch size) as our side and transformers' side."""

    def side(row: dict[str, Any], who: str) -> dict[str, Any]:
        return {"tokens_per_s": row[f"{who}_wall_tok_s"], "cpu_tokens_per_s": row[f"{who}_cpu_tok_s"], **row}

    def label(row: dict[str, Any]) -> str:
        return f"engine{', compile' if row.get('engine') == 'compile' else ''}, batch {row['batch']}"

    return [(label(row), side(row, "ours"), side(row, "hf")) for row in payload]


#: The benches, in the order of the table. Extend by adding an entry.
BENCHES: dict[str, Bench] = {
    "pretrain": Bench(
        "pretrain.py",
        ("--quick",),
        ("--compile",),
        lambda p: _named_pairs(p, "ours (optimization_level", "Hugging Face Trainer"),
        ">= 1.25x HF Trainer, wall and CPU",
    ),
    "sft": Bench(
        "sft.py",
        ("--quick",),
        (),
        lambda p: _named_pairs(p, "ours LoRA", "HF Trainer + peft LoRA, padding collator"),
        ">= 1.25x HF Trainer + peft",
    ),
    "vlm": Bench("vlm.py", ("--quick",), (), _vlm_pairs, ">= 1.5x HF Trainer"),
    "dit": Bench("dit.py", ("--quick", "--parts", "1"), ("--parts", "1"), _dit_pairs, ">= 1.2x the diffusers loop"),
    "generate": Bench(
        "generate.py",
        ("--new-tokens", "32", "--repeat", "1"),
        ("--compile",),
        _generate_pairs,
        ">= 2x transformers generate",
    ),
    "grpo": Bench(
        "grpo.py",
        ("--quick", "--no-buffer-modes"),
        ("--no-buffer-modes", "--repeats", "3", "--compile", "rollout", "--ab-compile", "none"),
        lambda p: [
            (
                f"ours (sync, compile {p.get('compile', {}).get(side) or 'none'})",
                p["results"][side],
                p["results"]["trl"],
            )
            for side in ("ours", "ours_ab")
            if side in p["results"]
        ],
        ">= 1.5x TRL sync, wall and CPU",
    ),
}


def measures(side: dict[str, Any]) -> dict[str, Any]:
    """A side's rates (higher is faster: tokens/s, else steps/s), its step, peak RSS and load range."""
    wall = side["tokens_per_s"] if "tokens_per_s" in side else 1.0 / side["step_s"]
    cpu = side["cpu_tokens_per_s"] if "cpu_tokens_per_s" in side else 1.0 / side["cpu_step_s"]
    return {
        "wall": wall,
        "cpu": cpu,
        "step_s": side.get("step_s"),
        "cpu_step_s": side.get("cpu_step_s"),
        "peak_mb": side.get("peak_rss_mb"),
        "load": side.get("load") or side.get("load_around"),
        "noisy": bool(side.get("noisy")),
    }


def rows_of(name: str, payload: Any, command: str, date: str) -> list[dict[str, Any]]:
    """The report's rows of one bench's JSON."""
    bench, rows = BENCHES[name], []
    for label, ours, peer in bench.pairs(payload):
        a, b = measures(ours), measures(peer)
        loads = [x for m in (a, b) if m["load"] for x in m["load"]]
        rows.append(
            {
                "bench": name,
                "row": label,
                "ratio_wall": a["wall"] / b["wall"],
                "ratio_cpu": a["cpu"] / b["cpu"],
                "step_s": a["step_s"],
                "cpu_step_s": a["cpu_step_s"],
                "peak_mb": [a["peak_mb"], b["peak_mb"]],
                "load": [min(loads), max(loads)] if loads else None,
                "noisy": a["noisy"] or b["noisy"],
                "date": date,
                "command": command,
                "goal": bench.goal,
            }
        )
    return rows


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]], header: str) -> str:
    """The markdown table of the rows (a row measured on a busy machine is marked noisy)."""
    columns = ("bench", "row", "ours / peer (wall)", "ours / peer (CPU time)", "our step s wall / CPU")
    columns += ("peak RSS MB ours / peer", "load", "date", "goal", "command")
    cells = [
        (
            r["bench"],
            _child.mark(r["row"], r["noisy"]),
            f"{r['ratio_wall']:.2f}x",
            f"{r['ratio_cpu']:.2f}x",
            f"{_num(r['step_s'], '.3f')} / {_num(r['cpu_step_s'], '.3f')}",
            " / ".join(_num(m, ".0f") for m in r["peak_mb"]),
            "-" if r["load"] is None else f"{r['load'][0]:.1f}-{r['load'][1]:.1f}",
            r["date"],
            r["goal"],
            f"`{r['command']}`",
        )
        for r in rows
    ]
    return _child.markdown(header, columns, cells)


def replace_table(page: str, text: str) -> str:
    """``page`` with ``text`` between the markers (appended with them when the page has none)."""
    if BEGIN in page and END in page:
        head, rest = page.split(BEGIN, 1)
        return f"{head}{BEGIN}\n{text}{END}{rest.split(END, 1)[1]}"
    return f"{page.rstrip()}\n\n## Side by side (CPU)\n\n{BEGIN}\n{text}{END}\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every bench at its smoke size (a few minutes)")
    parser.add_argument("--benches", nargs="+", default=list(BENCHES), help=f"default all: {' '.join(BENCHES)}")
    parser.add_argument(
        "--output", default=str(PAGE), help="the page whose table is replaced (default docs/performance.md)"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--workdir", default=None, help="benches' files and logs (default: a temporary directory)")
    args = parser.parse_args(argv)
    unknown = [b for b in args.benches if b not in BENCHES]
    if unknown:
        parser.error(f"--benches {' '.join(unknown)}: unknown; the benches are {', '.join(BENCHES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benches, print the table and write it into the page; exit status 1 when a bench failed."""
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-report-"))
    work.mkdir(parents=True, exist_ok=True)
    started, rows, failed = time.perf_counter(), [], []
    for name in args.benches:
        bench = BENCHES[name]
        argv_ = list(bench.quick if args.quick else bench.full)
        command = " ".join(["uv run --frozen python tools/bench/" + bench.script, *argv_])
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
        try:
            payload = _child.run_bench(bench.script, [*argv_, *_workdir(name, work)], work)
        except RuntimeError as err:
            failed.append(f"{name}: {err}")
            continue
        rows += rows_of(name, payload, command, date)
    import torch

    header = (
        f"{QUICK_NOTE if args.quick else 'full size'}; "
        f"{_cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"{time.perf_counter() - started:.0f} s in all; every row fp32 on the CPU, both sides the same work"
        + (f"; failed: {'; '.join(failed)}" if failed else "")
    )
    text = table(rows, header)
    sys.stdout.write(text)
    page = Path(args.output)
    tmp = page.with_suffix(".tmp")
    tmp.write_text(replace_table(page.read_text() if page.is_file() else "# Performance\n", text))
    os.replace(tmp, page)
    if args.json:
        _child.write_json(args.json, {"header": header, "rows": rows})
    return 1 if failed else 0


def _workdir(name: str, work: Path) -> list[str]:
    """``--workdir`` for the benches that take one (generate.py keeps its model in a temporary directory)."""
    return [] if name == "generate" else ["--workdir", str(work / name)]


def _cpu_model() -> str:
    from mindspeed.metrics.peak import device_name

    return device_name()


if __name__ == "__main__":
    sys.exit(main())
