"""An installed genq runs its fast path: the wheel carries every file the CPU kernels are built from,
and the engine installed from it (not this checkout) builds and uses them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import batching, sys
from batching import Engine, EngineConfig
assert batching.__file__.startswith(sys.argv[1]), batching.__file__  # the installed copy, not the checkout
engine = Engine(EngineConfig(model="tiny-llama", dtype="float32", device="cpu"))
print(engine.attention_backend)
"""


def test_the_wheel_builds_the_cpu_kernels_where_it_is_installed(tmp_path):
    # from a copy of the tracked files: a build/ folder left in the checkout would hide a missing file
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    source = tmp_path / "source"
    for name in tracked.stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            wheels,
            source,
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("genq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "batching" / "csrc").iterdir())
    assert set(sources) <= set(names), f"missing from the wheel: {set(sources) - set(names)}"

    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, wheel],
        check=True,
        capture_output=True,
    )
    env = dict(os.environ, PYTHONPATH=str(site), GENQ_KERNEL_CACHE=str(tmp_path / "kernels"))
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(site)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "cpu_kernel", run.stderr[-2000:]
    assert list((tmp_path / "kernels").glob("*.so"))
