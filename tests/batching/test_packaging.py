"""`pip install .` in a fresh virtual environment gives genq's fast path (issue 29): the wheel carries
every file the CPU kernels are built from, the engine installed from it (not this checkout) builds the
kernels from its own copy and runs them, and the workload of record runs through it as fast as through
the checkout.

The fresh environment downloads nothing: it is made without pip, the wheel goes in with `--no-deps
--no-index` (this environment's pip, `--python` the fresh one), and its dependencies (torch,
transformers, ...) come from this project's environment through a .pth file there. A .pth line only
appends a folder to sys.path, so this environment's editable install of the checkout (a .pth of its own
in that folder) is not processed in the fresh one: `batching` there is the installed copy alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# bench/engine_throughput.py's record workload (prompts 16-256 tokens, 16-128 new), a few of its requests,
# through the bench's own genq system (one torch thread); the fastest of the passes counts
REQUESTS, PASSES = 8, 2
MIN_SPEED_RATIO = 0.8  # installed / checkout

# argv: installed|checkout, the checkout's copy, the fresh venv, the bench's checkpoint (built if missing).
# It prints one line: which batching ran, the kernel library the process mapped, the attention path, and
# genq's speed, in useful tokens per CPU second of the process (on a shared machine the wall time of a
# pass is what the OS gave it; the CPU it took is the cost of the path that ran)
DRIVER = f"""
import json, sys
mode, source, venv, model_dir = sys.argv[1:5]
if mode == "checkout":
    sys.path.insert(0, source)
import batching  # before bench/ puts the checkout first on sys.path: this copy is the one that runs
from batching import cpu_attention

sys.path.append(source)
import torch
from bench.engine_throughput import WORKLOADS, GenqSystem, build_model_dir, make_workload, useful_tokens
from bench.harness import own_seconds

torch.set_num_threads(1)
_, prompt_range, output_range = WORKLOADS["record"]
reqs = make_workload({REQUESTS}, 0, prompt_range, output_range)
warm = make_workload(4, 1, prompt_range=(8, 32), output_range=(4, 8))  # as the bench warms up
if mode == "installed":  # first: the checkout's run reuses the checkpoint
    build_model_dir(model_dir, 0)
genq = GenqSystem(model_dir, reqs, "cpu", warm)
speeds = []
for _ in range({PASSES}):
    cpu = own_seconds()
    _, tokens = genq.run(None)
    cpu = own_seconds() - cpu
    assert sum(map(len, tokens)) == useful_tokens(reqs)
    speeds.append(useful_tokens(reqs) / cpu)
with open("/proc/self/maps") as f:
    mapped = sorted({{line.split()[-1] for line in f if "paged_attention-" in line}})
report = dict(batching=batching.__file__, kernel_sources=[str(p) for p in cpu_attention.SOURCES],
              kernel_libraries=mapped, attention=genq.engine.attention_backend, speed=max(speeds))
print("DRIVER " + json.dumps(report))
"""


def _copy_tracked(source: Path) -> None:
    """The checkout's tracked files (a build/ folder left in the checkout would hide a missing file)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in tracked.stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)


def _fresh_venv(venv: Path) -> Path:
    """A new virtual environment, no pip, whose dependencies are this environment's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, capture_output=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "genq-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_an_installed_genq_builds_and_runs_the_cpu_kernels_at_the_checkouts_speed(tmp_path):
    source, kernels = tmp_path / "source", tmp_path / "kernels"
    _copy_tracked(source)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("genq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    csrc = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "batching" / "csrc").iterdir())
    assert set(csrc) <= set(names), f"missing from the wheel: {set(csrc) - set(names)}"

    venv = tmp_path / "venv"
    python = _fresh_venv(venv)
    subprocess.run(
        [*pip, "--python", python, "install", "--no-deps", "--no-index", wheel],
        check=True,
        capture_output=True,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout on the path
    env["GENQ_KERNEL_CACHE"] = str(kernels)  # empty: the installed copy builds the kernels itself

    def drive(mode: str) -> dict:
        done = subprocess.run(
            [python, "-c", DRIVER, mode, source, venv, tmp_path / "model"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("DRIVER "))[7:])

    installed = drive("installed")
    assert installed["batching"].startswith(f"{venv}/"), installed  # the installed copy, not the checkout
    assert all(p.startswith(f"{venv}/") for p in installed["kernel_sources"]), installed
    assert installed["attention"] == "cpu_kernel", installed
    built = [str(p) for p in kernels.glob("paged_attention-*.so")]  # from the installed sources
    assert len(built) == 1 and installed["kernel_libraries"] == built, (installed, built)

    checkout = drive("checkout")  # the same interpreter and workload, the checkout's batching
    assert checkout["batching"].startswith(f"{source}/") and checkout["attention"] == "cpu_kernel", checkout
    ratio = installed["speed"] / checkout["speed"]
    print(f"tokens per CPU second: installed {installed['speed']:.0f}, checkout {checkout['speed']:.0f}")
    assert ratio >= MIN_SPEED_RATIO, f"the installed genq runs at {ratio:.2f}x the checkout's speed"
