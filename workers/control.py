"""Remote-control commands of a worker, for `celery -A workers inspect|control <command>`.

Celery checks a command's name in the process that runs `celery inspect`, against the commands
registered there, before it asks any worker: so they are registered here, in a module that
`workers/__init__.py` imports (the app every `celery -A workers ...` loads), which imports no torch.
The worker answers with its own process's parts (workers/tasks.py).

The `generate` queue is consumed by the worker's intake (workers/intake.py), not by Celery's consumer, so
Celery's three queue commands are registered again here, the same for every other queue and meaning the
intake for `generate`: `add_consumer generate` resumes it, `cancel_consumer generate` pauses it (held jobs run
on), and `active_queues` lists `generate` while the intake takes jobs.
"""

from __future__ import annotations

from celery.worker import control as celery_control
from celery.worker.control import control_command, inspect_command, ok

from contract.dispatch import is_job_queue


@inspect_command()
def engine_stats(state) -> dict:
    """`celery -A workers inspect engine_stats`: the engine's running / waiting / swapped counts, its
    process, device, dtype, threads and KV blocks, and the jobs the worker holds."""
    from workers.tasks import engine_report

    return engine_report()


@control_command(
    args=[("queue", str), ("exchange", str), ("exchange_type", str), ("routing_key", str)],
    signature="<queue> [exchange [type [routing_key]]]",
)
def add_consumer(state, queue, exchange=None, exchange_type=None, routing_key=None, **options):
    """Tell worker(s) to consume from task queue by name (`generate`: the intake takes jobs again)."""
    if not is_job_queue(queue):
        return celery_control.add_consumer(state, queue, exchange, exchange_type, routing_key, **options)
    from workers.tasks import consume_generate

    consume_generate(True)
    return ok(f"add consumer {queue}")


@control_command(args=[("queue", str)], signature="<queue>")
def cancel_consumer(state, queue, **options):
    """Tell worker(s) to stop consuming from task queue by name (`generate`: the intake takes no more jobs)."""
    if not is_job_queue(queue):
        return celery_control.cancel_consumer(state, queue, **options)
    from workers.tasks import consume_generate

    consume_generate(False)
    return ok(f"no longer consuming from {queue}")


@inspect_command()
def active_queues(state) -> list:
    """List the task queues a worker is currently consuming from (`generate` while the intake takes jobs)."""
    from workers.tasks import consumes_generate

    queues = celery_control.active_queues(state)
    if consumes_generate():
        from workers.tasks import JOB_QUEUE

        amqp_queues = state.consumer.app.amqp.queues
        queue = amqp_queues[JOB_QUEUE] if JOB_QUEUE in amqp_queues else amqp_queues.add(JOB_QUEUE)
        queues.append(dict(queue.as_dict(recurse=True)))
    return queues
