"""Paged decode attention for the CPU, from csrc/paged_decode.cpp, built on first use.

On a CPU the torch path spends most of its attention time gathering the decodes' K/V blocks into
a contiguous buffer (a write and a re-read of the whole batch's context per layer). The kernel reads
the blocks where they lie. It is a plain C++ file with no torch headers: the system compiler builds
it in well under a second into a cache folder, keyed by the source, the flags and the CPU, and
ctypes calls it on the tensors' memory (the GIL is released during the call). OpenMP comes from the
libgomp that torch has already loaded, so both share one thread pool.

`load()` returns None where there is no compiler or the build fails: the caller falls back to the
torch path, and the reason is logged once. `EngineConfig(cpu_attention_kernel=False)` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# Value-safe relaxations only: sums may be reordered (as any vectorized reduction does), no errno,
# no traps. Not -ffast-math: its finite-math assumption would be wrong for a -inf score.
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++17",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
]
FUNCTIONS = {
    torch.float32: "genq_paged_decode_f32",
    torch.float64: "genq_paged_decode_f64",
    torch.bfloat16: "genq_paged_decode_bf16",  # computes in float32
}
COMPUTE_DTYPES = {
    torch.float64: torch.float64
}  # the dtype each computes in (and takes sinks in): else float32
_I64, _F64, _PTR = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
ARGTYPES = [
    _PTR,
    _I64,
    _I64,
    _PTR,
    _PTR,
    _PTR,
    _I64,
    _PTR,
    _PTR,
    _I64,
    _I64,
    _I64,
    _I64,
    _I64,
    _I64,
    _I64,
    _I64,
    _F64,
    _F64,
    _PTR,
    _I64,
    ctypes.c_int,
]


class PagedDecodeKernel:
    """`decode(...)`: attention of one query per sequence over its paged context, for one layer."""

    def __init__(self, library: ctypes.CDLL):
        self._functions = {}
        for dtype, name in FUNCTIONS.items():
            fn = getattr(library, name)
            fn.argtypes, fn.restype = ARGTYPES, None
            self._functions[dtype] = fn

    def supports(self, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in self._functions

    def decode(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        block_tables: torch.Tensor,
        width: int,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
        sliding_window: int | None,
    ) -> None:
        """q, out: [n, H, D] (head_dim contiguous); k_blocks, v_blocks: [Hkv, num_blocks, block_size * D]
        contiguous; block_tables: [n * width] int64; context_lens: [n] int64. Writes `out`. float32,
        float64 or bfloat16 (computed in float32, the output rounded once)."""
        n, num_heads, head_dim = q.shape
        num_kv_heads, num_blocks = k_blocks.shape[0], k_blocks.shape[1]
        block_size = k_blocks.shape[2] // head_dim
        if q.stride(-1) != 1:
            q = q.contiguous()
        if sinks is not None:
            sinks = sinks.to(COMPUTE_DTYPES.get(q.dtype, torch.float32)).contiguous()
        self._functions[q.dtype](
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_blocks.data_ptr(),
            v_blocks.data_ptr(),
            block_tables.data_ptr(),
            width,
            context_lens.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            n,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            scale,
            softcap or 0.0,
            None if sinks is None else sinks.data_ptr(),
            sliding_window or 0,
            torch.get_num_threads(),
        )


@functools.lru_cache(maxsize=1)
def load() -> PagedDecodeKernel | None:
    """The kernel, built if need be; None (logged once) where it can't be had."""
    try:
        return PagedDecodeKernel(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("CPU paged-attention kernel unavailable (%s): using the slower torch path", exc)
        return None


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler on PATH (set CXX)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), compiler.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: concurrent builders each install a whole file
    log.info("built the CPU paged-attention kernel: %s", target)
    return target


def _cache_dir() -> Path:
    if path := os.environ.get("GENQ_KERNEL_CACHE"):
        return Path(path)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "genq"


def _cpu_signature() -> str:
    """-march=native code is only valid on the CPU it was built for."""
    try:
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n", 1)[0]
        return "\n".join(
            line
            for line in first_cpu.splitlines()
            if line.startswith(("flags", "Features", "model name", "CPU part"))
        )
    except OSError:
        return platform.machine()
