"""Remote-control commands of a worker, for `celery -A workers inspect <command>`.

Celery checks a command's name in the process that runs `celery inspect`, against the commands
registered there, before it asks any worker: so they are registered here, in a module that
`workers/__init__.py` imports (the app every `celery -A workers ...` loads), which imports no torch.
The worker answers with its own process's engine (workers/tasks.py).
"""

from __future__ import annotations

from celery.worker.control import inspect_command


@inspect_command()
def engine_stats(state) -> dict:
    """`celery -A workers inspect engine_stats`: the engine's running / waiting / swapped counts, its
    process, device, dtype, threads and KV blocks, and the jobs the worker holds."""
    from workers.tasks import engine_report

    return engine_report()
