"""workers/process_tuning.py: the settings a worker process takes once its engine is built."""

from __future__ import annotations

import gc
import platform

from workers import process_tuning


def test_settling_freezes_the_heap_built_so_far():
    before = gc.get_freeze_count()
    try:
        process_tuning.settle_for_serving()
        assert gc.get_freeze_count() > before  # what exists now is out of the collector's walks
    finally:
        gc.unfreeze()


def test_malloc_tuning_is_taken_by_glibc_and_skipped_elsewhere():
    """glibc takes all three settings; elsewhere (musl, macOS) the tuning says it did nothing, and raises nothing."""
    assert process_tuning._keep_freed_memory() is (platform.libc_ver()[0] == "glibc")
