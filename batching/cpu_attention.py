"""Paged attention kernels for the CPU, from csrc/paged_decode.cpp and csrc/paged_prefill.cpp (and the pool's
row writes, csrc/kv_write.cpp).

On a CPU the torch path spends much of its attention time gathering K/V blocks into contiguous
buffers (a write and a re-read of the context per layer), and for prefill chunks it repeats them per
query head and computes the scores the causal mask then discards. The kernels read the blocks where
they lie: one for decodes (a query per sequence), one for prefill chunks (query tiles, each stopping
at its last position). They are plain C++ with no torch headers: the system compiler builds them
once, in a few seconds, into a cache folder keyed by the sources, the flags and the CPU, and ctypes
calls them on the tensors' memory (the GIL is released during the call). OpenMP comes from the
libgomp that torch has already loaded, so both share one thread pool.

An int8 KV cache (kv_cache.py) has kernels of its own: the same code with int8 pools and a bfloat16
scale per token and KV head, applied as the rows are read (decode: to a key's score and a value's
weight; prefill: to the keys and values it packs).

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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = [SOURCE_DIR / "paged_decode.cpp", SOURCE_DIR / "paged_prefill.cpp", SOURCE_DIR / "kv_write.cpp"]
HEADERS = [SOURCE_DIR / "attention_common.h"]
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
    "-Wno-psabi",  # 64-byte vectors passed between inlined helpers: no ABI crosses the library's edge
]
DTYPE_SUFFIXES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.bfloat16: "bf16",
}  # bf16 computes in float32
COMPUTE_DTYPES = {
    torch.float64: torch.float64
}  # the dtype each computes in (and takes sinks in): else float32
_I64, _F64, _PTR = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
# q, its strides, the K and V pools, their scale pools (int8 pools; null otherwise), ...
DECODE_ARGTYPES = [
    _PTR,
    _I64,
    _I64,
    _PTR,
    _PTR,
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
PREFILL_ARGTYPES = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]
PREFILL_ARGTYPES += [_I64, _I64, _I64, _I64, _I64, _F64, _F64, _PTR, _I64, ctypes.c_int]
# src, its head and row strides (bytes), the pool, its head stride (bytes), slots, heads, rows, row bytes
WRITE_ROWS_ARGTYPES = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64]


def _function(library: ctypes.CDLL, name: str, argtypes: list):
    fn = getattr(library, name)
    fn.argtypes, fn.restype = argtypes, None
    return fn


class PagedAttentionKernel:
    """Attention over the paged pool for one layer: `decode(...)`, one query per sequence, and
    `prefill(...)`, the queries of prompt chunks."""

    def __init__(self, library: ctypes.CDLL):
        # by (the model's dtype, whether the pools are int8)
        self._decode = {
            (dtype, int8): _function(
                library, f"genq_paged_decode_{suffix}{'_i8' if int8 else ''}", DECODE_ARGTYPES
            )
            for dtype, suffix in DTYPE_SUFFIXES.items()
            for int8 in (False, True)
        }
        self._prefill = {
            (dtype, int8): _function(
                library, f"genq_paged_prefill_{suffix}{'_i8' if int8 else ''}", PREFILL_ARGTYPES
            )
            for dtype, suffix in DTYPE_SUFFIXES.items()
            for int8 in (False, True)
        }

        self._write_rows = _function(library, "genq_write_rows", WRITE_ROWS_ARGTYPES)
        self._prefill_tiles = library.genq_prefill_tiles
        self._prefill_tiles.argtypes, self._prefill_tiles.restype = [ctypes.c_int], ctypes.c_int

    def prefill_tiles(self, wanted: bool | None = None) -> bool:
        """Whether bfloat16 prefill runs its products on AMX tiles (CPUs with amx_bf16, where Linux grants the
        tiles): `wanted` turns them on or off for the process (tests and benches compare both paths); returns
        what runs now."""
        return bool(self._prefill_tiles(-1 if wanted is None else int(wanted)))

    def write_rows(self, cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        """cache[:, slot_mapping[t]] = rows[:, t]: a step's new keys or values of one layer into their slots.
        cache: [Hkv, slots, D] with rows contiguous; rows: [Hkv, T, D] with D contiguous (any other strides);
        slot_mapping: [T] int64, contiguous. Byte copies: every dtype."""
        assert rows.stride(-1) == 1 and cache.stride(-1) == 1 and cache.stride(1) == cache.shape[-1]
        assert (
            slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and rows.dtype == cache.dtype
        )
        size = rows.element_size()
        self._write_rows(
            rows.data_ptr(),
            rows.stride(0) * size,
            rows.stride(1) * size,
            cache.data_ptr(),
            cache.stride(0) * size,
            slot_mapping.data_ptr(),
            rows.shape[0],
            rows.shape[1],
            rows.shape[2] * size,
        )

    def supports(self, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in DTYPE_SUFFIXES

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
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        """q, out: [n, H, D] (head_dim contiguous); k_blocks, v_blocks: [Hkv, num_blocks, block_size * D]
        contiguous; block_tables: [n * width] int64; context_lens: [n] int64. Writes `out`. float32,
        float64 or bfloat16 (computed in float32, the output rounded once). int8 pools come with their
        bfloat16 scales, k_scales and v_scales: [Hkv, num_blocks, block_size] contiguous."""
        n, num_heads, head_dim = q.shape
        num_kv_heads, num_blocks = k_blocks.shape[0], k_blocks.shape[1]
        block_size = k_blocks.shape[2] // head_dim
        q, sinks = _as_kernels_take(q, sinks)
        self._decode[q.dtype, _int8(k_blocks, k_scales, v_scales)](
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_blocks.data_ptr(),
            v_blocks.data_ptr(),
            _pointer(k_scales),
            _pointer(v_scales),
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

    def prefill(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        chunks: PrefillTables,
        out: torch.Tensor,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
        sliding_window: int | None,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        """q, out: [T, H, D] (head_dim contiguous), the packed batch's rows; chunk i owns rows
        [starts[i], starts[i + 1]) and its last query sits at position ctx_lens[i] - 1. Pools (and
        scales) as for `decode`; the chunks' own K/V must already be in them. Writes the chunks' rows of `out`."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, num_blocks = k_blocks.shape[0], k_blocks.shape[1]
        q, sinks = _as_kernels_take(q, sinks)
        self._prefill[q.dtype, _int8(k_blocks, k_scales, v_scales)](
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_blocks.data_ptr(),
            v_blocks.data_ptr(),
            _pointer(k_scales),
            _pointer(v_scales),
            chunks.block_ids.data_ptr(),
            chunks.width,
            chunks.starts.data_ptr(),
            chunks.ctx_lens.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            chunks.ctx_lens.numel(),
            num_heads,
            num_kv_heads,
            head_dim,
            k_blocks.shape[2] // head_dim,
            num_blocks,
            scale,
            softcap or 0.0,
            None if sinks is None else sinks.data_ptr(),
            sliding_window or 0,
            torch.get_num_threads(),
        )


def _int8(k_blocks: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> bool:
    """Whether the pools are int8 (then with both scale pools, bfloat16, contiguous: the kernels index them)."""
    if k_blocks.dtype != torch.int8:
        return False
    for scales in (k_scales, v_scales):
        assert scales is not None and scales.dtype == torch.bfloat16 and scales.is_contiguous()
    return True


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _as_kernels_take(q: torch.Tensor, sinks: torch.Tensor | None):
    """q with head_dim contiguous; sinks (if any) contiguous in the dtype the kernel computes in."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if sinks is not None:
        sinks = sinks.to(COMPUTE_DTYPES.get(q.dtype, torch.float32)).contiguous()
    return q, sinks


@dataclass(slots=True)
class PrefillTables:
    """A step's prompt chunks as the prefill kernel reads them (int64, contiguous, built once per step)."""

    starts: torch.Tensor  # [n + 1]: chunk i's rows of the packed batch are [starts[i], starts[i + 1])
    ctx_lens: torch.Tensor  # [n]: tokens chunk i attends over, its own included
    block_ids: torch.Tensor  # [n * width]: block tables, padded to `width` blocks
    width: int


@functools.lru_cache(maxsize=1)
def load() -> PagedAttentionKernel | None:
    """The kernels, built if need be; None (logged once) where they can't be had."""
    try:
        return PagedAttentionKernel(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning(
            "CPU paged-attention kernel unavailable (%s): using the slower torch path; a C++ compiler "
            "(g++ or clang++ on PATH, or CXX) builds it on the next start",
            exc,
        )
        return None


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler on PATH (set CXX)")
    sources = [path.read_bytes() for path in SOURCES + HEADERS]
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(FLAGS).encode(), compiler.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: concurrent builders each install a whole file
    log.info("built the CPU paged-attention kernels: %s", target)
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
