"""List or regenerate the golden losses of the tiny CPU recipes (``tests/golden/``).

    uv run --frozen python tools/golden.py                     # names, recorded keys, carrying tests
    uv run --frozen python tools/golden.py --update            # re-record every golden file for this key
    uv run --frozen python tools/golden.py --update llm_dpo    # only these names' tests

A golden name is carried by the test that calls ``check_golden("<name>", ...)``; ``--update``
runs those test files with ``pytest --update-golden``, which writes
``tests/golden/<name>/<key>.json`` for this machine's key (device, CPU capability, torch).
Review the result with ``git diff tests/golden`` before committing it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
CALL = re.compile(r"check_golden\(\s*\"(\w+)\"")


def carriers() -> dict[str, list[str]]:
    """Golden name -> the test files that check it."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for name in CALL.findall(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--update", nargs="*", metavar="NAME", help="re-record these names (none: all)")
    args = parser.parse_args(argv)
    tests = carriers()
    if args.update is None:
        sys.path.insert(0, str(ROOT))
        from tests.golden import golden_key

        print(f"this machine's key: {golden_key()['key']}")
        for name in sorted(set(tests) | {p.name for p in GOLDEN.iterdir() if p.is_dir() and p.name != "__pycache__"}):
            files = [json.loads(p.read_text()) for p in sorted((GOLDEN / name).glob("*.json"))]
            recorded = ", ".join(f"{f['key']} ({f['threads']} threads)" for f in files) or "none"
            print(f"{name}: recorded {recorded}; checked by {', '.join(tests.get(name, [])) or 'no test'}")
        return 0
    unknown = sorted(set(args.update) - set(tests))
    if unknown:
        print(f"--update: unknown golden name(s) {unknown}; known: {sorted(tests)}", file=sys.stderr)
        return 2
    files = sorted({f for name in (args.update or tests) for f in tests[name]})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "--update-golden", *files], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
