"""The ``mindspeed-rl make-data`` subcommand: write a generated arithmetic prompt set (GSM8K format).

``mindspeed-rl make-data --output train.jsonl --num 2000 --max-operand 99 --operators + - *``
writes records that ``data.path`` reads and the ``math`` verifier checks. With
``--test-output`` a held-out split (no question in common) is written too. Bad knobs exit 2.
"""

from __future__ import annotations

import argparse
import sys

from mindspeed_rl.data.arithmetic import OPERATORS, generate_arithmetic, write_jsonl


def add_make_data(sub: argparse._SubParsersAction) -> None:
    """Add ``make-data`` to the ``mindspeed-rl`` subcommands."""
    parser = sub.add_parser(
        "make-data",
        help="write a generated arithmetic prompt set (GSM8K format, jsonl)",
        description="Generate 'What is a + b?' problems with answers ending in '#### N' "
        "(seeded; same flags, same file). Files are written atomically.",
    )
    parser.add_argument("--output", required=True, help="the jsonl file to write")
    parser.add_argument("--num", type=int, default=512, help="records (default 512)")
    parser.add_argument("--test-output", help="also write a held-out split here")
    parser.add_argument("--test-num", type=int, default=64, help="records of the held-out split (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--min-operand", type=int, default=0, help="smallest operand (default 0)")
    parser.add_argument("--max-operand", type=int, default=20, help="largest operand (default 20)")
    parser.add_argument(
        "--operators",
        nargs="+",
        default=["+", "-"],
        metavar="OP",
        help=f"operators drawn from {' '.join(OPERATORS)} (default + -)",
    )
    parser.add_argument("--num-operands", type=int, default=2, help="operands per expression (default 2)")
    parser.add_argument("--negative-results", action="store_true", help="allow negative answers")
    parser.add_argument("--allow-duplicates", action="store_true", help="questions may repeat")
    parser.set_defaults(func=run_make_data)


def run_make_data(args: argparse.Namespace) -> int:
    """Generate and write the file(s); returns the exit status."""
    test_num = args.test_num if args.test_output else 0
    if test_num < 0:
        raise ValueError(f"--test-num {test_num} must be >= 0")
    records = generate_arithmetic(
        args.num + test_num,
        seed=args.seed,
        min_operand=args.min_operand,
        max_operand=args.max_operand,
        operators=args.operators,
        num_operands=args.num_operands,
        negative_results=args.negative_results,
        unique=not args.allow_duplicates,
    )
    write_jsonl(records[: args.num], args.output)
    sys.stdout.write(f"wrote {args.num} records to {args.output}\n")
    if args.test_output:
        write_jsonl(records[args.num :], args.test_output)
        sys.stdout.write(f"wrote {test_num} records to {args.test_output}\n")
    return 0
