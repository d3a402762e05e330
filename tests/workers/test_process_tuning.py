"""workers/process_tuning.py: the settings a worker process takes once its engine is built."""

from __future__ import annotations

import gc

from workers import process_tuning


def test_settling_freezes_the_heap_built_so_far():
    before = gc.get_freeze_count()
    try:
        process_tuning.settle_for_serving()
        assert gc.get_freeze_count() > before  # what exists now is out of the collector's walks
    finally:
        gc.unfreeze()


def test_malloc_tuning_is_accepted_here():
    assert process_tuning._keep_freed_memory() is True  # glibc on this machine takes every setting
