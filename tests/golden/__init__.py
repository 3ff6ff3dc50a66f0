"""Golden losses: the first steps' numbers of the tiny CPU recipes, kept in files and compared bit for bit.

The tests that already run a recipe end to end hand the numbers they read (losses, rewards) to
:func:`check_golden`; ``tests/golden/<name>/<key>.json`` holds the recorded ones, one file per
key ``<device>-<cpu capability>-<cpu kind>-torch<version>`` (as torchtitan keeps golden losses per
hardware; the CPU kind is vendor, family and model: two AVX512 CPUs of different makers pick
different GEMM kernels). Any numeric change of a recipe is then a reviewed diff of a golden file,
never silent.

- The file for this key exists and its thread count is this run's: every number must be the
  same float (its full ``repr``); the failure names the first differing step and how to regenerate.
- No file for this key (another CPU kind or torch), or another thread count: the nearest file of
  this device type is compared at a relative tolerance of ``RTOL`` and a warning (not a failure)
  says that the bit-exact file is missing and how to record it. Series that amplify rounding
  (``chaotic=True``: RL rollouts sampled from a demo policy fitted for hundreds of steps, where a
  last-bit difference of the fit changes which tokens are sampled) are compared only with a file of
  this key; elsewhere a warning says that none is recorded.
- No file of this device type: a warning; no file of this name at all: a failure.

Regenerate with ``uv run --frozen pytest --update-golden <test file>`` or
``uv run --frozen python tools/golden.py --update [NAME ...]``; then review ``git diff tests/golden``.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import torch

from mindspeed.device import get_accelerator

GOLDEN_DIR = Path(__file__).resolve().parent
#: Set by ``pytest --update-golden`` (tests/conftest.py) or the environment: write instead of compare.
UPDATE_ENV = "MINDSPEED_UPDATE_GOLDEN"
#: torch's intra-op threads of a fresh process here (read when tests/conftest.py imports this module,
#: before any test changes them): what a command run as a subprocess of the tests uses.
DEFAULT_THREADS = torch.get_num_threads()
#: Another ISA or torch build reorders float sums: a few ulps per step, compounded over <= 10 steps.
RTOL = 1e-4


class GoldenWarning(UserWarning):
    """A golden comparison that could not be bit-exact (no file for this key), or a recorded file."""


def cpu_kind(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """``<vendor>.<family>.<model>`` of this machine's CPU (``unknown`` where /proc/cpuinfo is not)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return "unknown"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    parts = [fields.get(k, "") for k in ("vendor_id", "cpu family", "model")]
    return ".".join(p.replace(" ", "") for p in parts) if all(parts) else "unknown"


def golden_key() -> dict[str, str]:
    """What a bit-exact comparison depends on: the device type, the CPU kernels' ISA, the CPU's
    kind (its vendor's GEMM kernels differ at the last bit), the torch build."""
    device = get_accelerator().name
    capability = torch.backends.cpu.get_cpu_capability()
    kind = cpu_kind()
    version = torch.__version__.split("+")[0]
    return {
        "device": device,
        "cpu_capability": capability,
        "cpu": kind,
        "torch": version,
        "key": f"{device}-{capability}-{kind}-torch{version}",
    }


def _how_to_update(name: str) -> str:
    node = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
    test = f" {node}" if node else ""
    return (
        f"if the change is intended, regenerate with `uv run --frozen pytest --update-golden{test}` "
        f"(or `uv run --frozen python tools/golden.py --update {name}`) and review `git diff tests/golden`"
    )


def _same(a: float, b: float, rtol: float | None) -> bool:
    if rtol is None:
        return repr(float(a)) == repr(float(b))
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


def _first_difference(got: dict[str, list[float]], want: dict[str, list[float]], rtol: float | None) -> str | None:
    if sorted(got) != sorted(want):
        return f"series {sorted(got)} != golden {sorted(want)}"
    for series in sorted(got):
        if len(got[series]) != len(want[series]):
            return f"{series}: {len(got[series])} steps != golden {len(want[series])}"
    for step in range(len(next(iter(got.values()), []))):
        for series in sorted(got):
            a, b = got[series][step], want[series][step]
            if not _same(a, b, rtol):
                return f"first difference at step {step + 1}: {series} {float(a)!r} != golden {float(b)!r}"
    return None


def _nearest(files: list[dict], key: dict[str, str]) -> dict | None:
    """The recorded file most like this key: the same device type, then the same ISA, then the same torch."""
    same_device = [f for f in files if f["device"] == key["device"]]
    if not same_device:
        return None
    return max(
        same_device,
        key=lambda f: (
            f["cpu_capability"] == key["cpu_capability"],
            f.get("cpu") == key["cpu"],
            f["torch"] == key["torch"],
            f["key"],
        ),
    )


def first_steps(metrics: str | Path, count: int, keys: tuple[str, ...] = ("loss",)) -> dict[str, list[float]]:
    """The ``keys`` of the first ``count`` training steps in a ``metrics.jsonl`` (records holding them all)."""
    records = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
    steps = [r for r in records if r.get("kind", "train") == "train" and all(k in r for k in keys)][:count]
    return {k: [r[k] for r in steps] for k in keys}


def check_golden(
    name: str, series: dict[str, list[float]], *, threads: int | None = None, chaotic: bool = False
) -> None:
    """Compare ``series`` (e.g. ``{"loss": [...]}``, step 1 first) with ``tests/golden/<name>/``.

    Args:
        name: the recipe's golden name (a folder of tests/golden).
        series: the numbers of the first steps, one list per metric, all of the same length.
        threads: the intra-op threads of the process that computed them (a reduction's order
            depends on it; default: this process's now): a file recorded with another count is
            compared with the tolerance.
        chaotic: the series amplify last-bit differences (sampled rollouts of a policy fitted for
            hundreds of steps): compared only with a file of this key and thread count.
    """
    threads = torch.get_num_threads() if threads is None else threads
    series = {k: [float(x) for x in v] for k, v in series.items()}
    key = golden_key()
    folder = GOLDEN_DIR / name
    path = folder / f"{key['key']}.json"
    if os.environ.get(UPDATE_ENV) == "1":
        folder.mkdir(parents=True, exist_ok=True)
        record = {**key, "name": name, "threads": threads, "series": series}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        warnings.warn(GoldenWarning(f"recorded {path.relative_to(GOLDEN_DIR.parents[1])}"), stacklevel=2)
        return
    files = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    assert files, f"no golden file for {name!r} in {folder}: record one: {_how_to_update(name)}"
    exact = next((f for f in files if f["key"] == key["key"] and f["threads"] == threads), None)
    if exact is None and chaotic:
        warnings.warn(
            GoldenWarning(
                f"golden {name}: no file for {key['key']} with {threads} threads, and its numbers amplify "
                f"rounding (not compared with another machine's); record it: {_how_to_update(name)}"
            ),
            stacklevel=2,
        )
        return
    golden = exact or _nearest(files, key)
    if golden is None:
        warnings.warn(
            GoldenWarning(
                f"golden {name}: no file for device {key['device']!r}; not compared ({_how_to_update(name)})"
            ),
            stacklevel=2,
        )
        return
    rtol = None if exact else RTOL
    difference = _first_difference(series, golden["series"], rtol)
    where = f"tests/golden/{name}/{golden['key']}.json (threads {golden['threads']})"
    mode = "bit for bit" if exact else f"at rel {RTOL}"
    assert difference is None, f"golden {name} differs from {where} {mode}: {difference}; {_how_to_update(name)}"
    if not exact:
        warnings.warn(
            GoldenWarning(
                f"golden {name}: no bit-exact file for {key['key']} with {threads} threads; matched {where} "
                f"at rel {RTOL}; record it: {_how_to_update(name)}"
            ),
            stacklevel=2,
        )
