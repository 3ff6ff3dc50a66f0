"""Each package builds a proper wheel: its modules, its console script and its metadata."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "core": ("mindspeed", "mindspeed"),
    "llm": ("mindspeed_llm", "mindspeed-llm"),
    "mm": ("mindspeed_mm", "mindspeed-mm"),
    "rl": ("mindspeed_rl", "mindspeed-rl"),
}


@pytest.mark.skipif(shutil.which("uv") is None, reason="uv builds the wheels (installed by the README's command)")
def test_every_package_builds_a_wheel(tmp_path) -> None:
    out = subprocess.run(
        ["uv", "build", "--wheel", "--all-packages", "-o", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for folder, (module, script) in PACKAGES.items():
        wheels = list(tmp_path.glob(f"mindspeed_{folder}-*-py3-none-any.whl"))
        assert len(wheels) == 1, f"no wheel for mindspeed-{folder}"
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = wheel.namelist()
            sources = {
                p.relative_to(ROOT / "packages" / folder / "src").as_posix()
                for p in (ROOT / "packages" / folder / "src" / module).rglob("*.py")
            }
            assert sources <= set(names), f"missing from the wheel: {sorted(sources - set(names))[:5]}"
            meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
            entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
            assert f"Name: mindspeed-{folder}" in wheel.read(meta).decode()
            assert f"{script} = {module}.cli:main" in wheel.read(entry).decode()
