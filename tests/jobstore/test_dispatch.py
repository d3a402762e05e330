"""The broker side of a job, against the real Redis: priority lists and a message moved to the head."""

from __future__ import annotations

import uuid

from jobstore.dispatch import QUEUE, make_celery, move_to_head, queue_key, send_job


def taken_order(redis_client, key: str, ids: list[uuid.UUID]) -> list[uuid.UUID]:
    """The job ids in the order a consumer takes them (kombu BRPOPs: the right end first)."""
    order = []
    while (message := redis_client.rpop(key)) is not None:
        order += [i for i in ids if str(i).encode() in message]
    return order


def test_a_job_sent_back_goes_to_the_head_of_its_priority(settings, redis_client):
    settings = settings.replace(redis_key_prefix=f"{settings.redis_key_prefix}head-{uuid.uuid4().hex[:6]}:")
    app = make_celery(settings)
    key = queue_key(settings, QUEUE, 7)
    try:
        waiting = [uuid.uuid4() for _ in range(3)]
        for job_id in waiting:
            send_job(app, job_id, 7)
        back, urgent = uuid.uuid4(), uuid.uuid4()
        send_job(app, urgent, 0)  # another priority's list is not touched
        send_job(app, back, 7)
        assert move_to_head(redis_client, settings, back, 7)
        assert not move_to_head(redis_client, settings, uuid.uuid4(), 7)  # not there: nothing moves
        assert taken_order(redis_client, key, [*waiting, back]) == [back, *waiting]
        assert taken_order(redis_client, queue_key(settings, QUEUE, 0), [urgent]) == [urgent]
    finally:
        app.close()
        redis_client.delete(key, queue_key(settings, QUEUE, 0))
