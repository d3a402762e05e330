"""The broker side of a job, against the real Redis: priority lists, a message moved to the head, and the
bulk sender of batches writing the messages Celery writes."""

from __future__ import annotations

import json
import uuid

from contract.dispatch import (
    PRIORITIES,
    QUEUE,
    BulkSender,
    jobs_in_queue,
    make_celery,
    model_queue,
    move_to_head,
    peek_head,
    queue_key,
    queue_lengths,
    send_job,
    send_to_head,
    take_jobs,
    take_messages,
    waiting_jobs,
)


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


def test_bulk_sender_writes_the_message_celery_writes(settings, redis_client):
    settings = settings.replace(redis_key_prefix=f"{settings.redis_key_prefix}bulk-{uuid.uuid4().hex[:6]}:")
    app = make_celery(settings)
    sender = BulkSender(app, settings, pipeline_size=3)
    try:
        job_id = uuid.uuid4()
        send_job(app, job_id, 4)
        celerys = json.loads(redis_client.lpop(queue_key(settings, QUEUE, 4)))
        ours = json.loads(sender.message(job_id, 4))
        # the task id is the job's (one task per job, however often it is sent)
        assert celerys["headers"]["id"] == ours["headers"]["id"] == str(job_id)
        for message in (celerys, ours):  # fresh per message: kombu's delivery tag
            message["properties"].update(delivery_tag=None)
        assert ours == celerys
        sender.send_one(job_id, 4)  # POST /jobs' send: the same message, on the same list
        single = json.loads(redis_client.lpop(queue_key(settings, QUEUE, 4)))
        single["properties"].update(delivery_tag=None)
        assert single == celerys

        # more than one pipeline's worth, and a run of one priority longer than a pipeline (one LPUSH each)
        jobs = [(uuid.uuid4(), p) for p in (0, 9, 9, 5, 9, 0, 9, 9, 9, 9, 9, 5)]
        assert sender.send(jobs) == len(jobs)
        for priority in (0, 5, 9):
            expected = [j for j, p in jobs if p == priority]
            assert taken_order(redis_client, queue_key(settings, QUEUE, priority), expected) == expected
    finally:
        sender.close()
        app.close()
        redis_client.delete(*(queue_key(settings, QUEUE, p) for p in (0, 4, 5, 9)))


def test_the_jobs_waiting_in_each_queue_are_read_at_its_head_and_found_anywhere(settings, redis_client):
    """waiting_jobs reads each priority's length and its next messages (Celery's and BulkSender's alike);
    jobs_in_queue finds job ids anywhere in a list, read a chunk at a time."""
    settings = settings.replace(redis_key_prefix=f"{settings.redis_key_prefix}wait-{uuid.uuid4().hex[:6]}:")
    app = make_celery(settings)
    sender = BulkSender(app, settings)
    key = queue_key(settings, QUEUE, 4)
    try:
        celery_sent = [uuid.uuid4() for _ in range(5)]
        for job_id in celery_sent:
            send_job(app, job_id, 4)
        bulk_sent = [uuid.uuid4() for _ in range(5)]
        sender.send([(job_id, 4) for job_id in bulk_sent])
        waiting = waiting_jobs(redis_client, settings, limit=3)
        assert waiting[4] == (10, celery_sent[:3])  # the next three to be taken, next first
        assert waiting[0] == (0, []) and set(waiting) == set(range(10))
        assert waiting_jobs(redis_client, settings, limit=64)[4] == (10, celery_sent + bulk_sent)
        absent = uuid.uuid4()
        sought = [celery_sent[0], bulk_sent[-1], absent]
        assert jobs_in_queue(redis_client, settings, 4, sought, chunk=3) == {celery_sent[0], bulk_sent[-1]}
        assert jobs_in_queue(redis_client, settings, 5, sought) == set()
    finally:
        sender.close()
        app.close()
        redis_client.delete(key)


def test_the_priority_lists_are_named_as_the_installed_kombu_names_them(settings):
    """queue_key is kombu's Redis transport's naming (its channel's list of a queue's priority step, under the
    global key prefix): a kombu that names them otherwise fails here, not in a worker that finds no jobs."""
    settings = settings.replace(redis_key_prefix="genq-test-names:")
    app = make_celery(settings)
    try:
        with app.connection_for_write() as connection:
            channel = connection.default_channel
            assert channel.priority_steps == list(PRIORITIES)
            kombus = [
                channel.global_keyprefix + channel._q_for_pri(QUEUE, channel.priority(p)) for p in PRIORITIES
            ]
    finally:
        app.close()
    assert [queue_key(settings, QUEUE, p) for p in PRIORITIES] == kombus


def test_messages_are_taken_most_urgent_first_and_in_order_within_a_priority(settings, redis_client):
    settings = settings.replace(redis_key_prefix=f"{settings.redis_key_prefix}take-{uuid.uuid4().hex[:6]}:")
    app = make_celery(settings)
    sender = BulkSender(app, settings)
    try:
        sent = [(uuid.uuid4(), p) for p in (9, 5, 0, 5, 0, 9)]
        for job_id, priority in sent[:3]:
            send_job(app, job_id, priority)  # Celery's messages and the bulk sender's alike
        sender.send(sent[3:])
        urgent = [(j, p) for j, p in sent if p == 0]
        assert take_messages(redis_client, settings, PRIORITIES, 5, wait=None) == urgent  # one list per take
        assert take_messages(redis_client, settings, range(5), 5, wait=None) == []  # 5 and 9 not looked at
        fives = [(j, p) for j, p in sent if p == 5]
        assert take_messages(redis_client, settings, PRIORITIES, 1, wait=0.1) == fives[:1]
        assert take_messages(redis_client, settings, PRIORITIES, 9, wait=0.1) == fives[1:]
        nines = [(j, p) for j, p in sent if p == 9]
        assert take_messages(redis_client, settings, PRIORITIES, 9, wait=0.1) == nines
        assert take_messages(redis_client, settings, PRIORITIES, 9, wait=0.1) == []  # waited, none came
    finally:
        sender.close()
        app.close()
        redis_client.delete(*(queue_key(settings, QUEUE, p) for p in PRIORITIES))


def test_each_model_has_its_own_queue_and_the_default_keeps_generate(settings, redis_client):
    """The fleet's default model's queue is `generate` (one model: the lists of old); another model's is
    `generate.<name>`, written by Celery's send, the bulk sender and a send to the head alike, taken apart."""
    settings = settings.replace(redis_key_prefix=f"{settings.redis_key_prefix}models-{uuid.uuid4().hex[:6]}:")
    assert model_queue(settings, None) == model_queue(settings, settings.model) == QUEUE == "generate"
    assert model_queue(settings, "small") == "generate.small"
    worker_of_small = settings.replace(
        model="/models/small", model_name="small", default_model=settings.model
    )
    assert model_queue(worker_of_small, worker_of_small.served_model_name()) == "generate.small"
    assert model_queue(worker_of_small, None) == QUEUE  # a row naming no model is the default's
    app, small = make_celery(settings), "generate.small"
    sender = BulkSender(app, settings)
    try:
        celery_sent, bulk_sent, back, default = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        send_job(app, celery_sent, 3, small)
        sender.send_one(bulk_sent, 3, small)
        send_to_head(app, redis_client, settings, back, 3, small)
        sender.send([(default, 3)])
        assert queue_lengths(redis_client, settings, [QUEUE, small]) == {
            QUEUE: [0, 0, 0, 1, 0, 0, 0, 0, 0, 0],
            small: [0, 0, 0, 3, 0, 0, 0, 0, 0, 0],
        }
        message = json.loads(redis_client.lindex(queue_key(settings, small, 3), 0))
        assert message["properties"]["delivery_info"] == {"exchange": "", "routing_key": small}
        assert take_messages(redis_client, settings, PRIORITIES, 9, None, small) == [
            (back, 3),
            (celery_sent, 3),
            (bulk_sent, 3),
        ]
        assert take_messages(redis_client, settings, PRIORITIES, 9, None) == [(default, 3)]
    finally:
        sender.close()
        app.close()
        redis_client.delete(*(queue_key(settings, q, p) for q in (QUEUE, small) for p in PRIORITIES))


def test_a_window_at_the_head_is_seen_without_taking_and_any_of_it_taken_where_it_stands(
    settings, redis_client
):
    """peek_head names the jobs at the head of the most urgent non-empty list (next first) and takes nothing;
    take_jobs takes the named ones from anywhere in the window, in the order asked, leaves the rest in their
    order (a job beyond the window or taken already is not taken), and take_messages then takes the rest."""
    settings = settings.replace(redis_key_prefix=f"{settings.redis_key_prefix}peek-{uuid.uuid4().hex[:6]}:")
    app = make_celery(settings)
    sender = BulkSender(app, settings)
    try:
        assert peek_head(redis_client, settings, PRIORITIES, 4) is None  # every list empty
        fives = [uuid.uuid4() for _ in range(6)]
        send_job(app, fives[0], 5)  # Celery's messages and the bulk sender's alike
        sender.send([(job_id, 5) for job_id in fives[1:]])
        nine = uuid.uuid4()
        send_job(app, nine, 9)
        assert peek_head(redis_client, settings, PRIORITIES, 4) == (5, 6, fives[:4])
        assert peek_head(redis_client, settings, range(5), 4) is None  # 5 and 9 not looked at
        assert peek_head(redis_client, settings, [9], 4) == (9, 1, [nine])
        assert waiting_jobs(redis_client, settings, limit=4)[5] == (6, fives[:4])  # nothing was taken
        # fives[5] is beyond a window of 4; a job not in the list is not taken either
        asked = [fives[3], fives[1], fives[5], uuid.uuid4()]
        assert take_jobs(redis_client, settings, 5, asked, 4) == [(fives[3], 5), (fives[1], 5)]
        assert take_jobs(redis_client, settings, 5, [fives[3]], 4) == []  # taken already
        assert peek_head(redis_client, settings, PRIORITIES, 8) == (
            5,
            4,
            [fives[0], fives[2], fives[4], fives[5]],
        )
        assert take_messages(redis_client, settings, PRIORITIES, 9, wait=None) == [
            (job_id, 5) for job_id in (fives[0], fives[2], fives[4], fives[5])
        ]
    finally:
        sender.close()
        app.close()
        redis_client.delete(*(queue_key(settings, QUEUE, p) for p in PRIORITIES))


def test_a_take_planned_from_a_look_yields_to_a_more_urgent_message_sent_since(settings, redis_client):
    """The intake looks (peek_head), then takes what it chose from the list it saw. A message sent meanwhile to a
    more urgent list goes first: take_jobs with `more_urgent` takes nothing while one waits there, and the head's
    take over the more urgent lists and the seen one takes the urgent message."""
    settings = settings.replace(redis_key_prefix=f"{settings.redis_key_prefix}race-{uuid.uuid4().hex[:6]}:")
    app = make_celery(settings)
    try:
        fives = [uuid.uuid4() for _ in range(3)]
        for job_id in fives:
            send_job(app, job_id, 5)
        assert peek_head(redis_client, settings, PRIORITIES, 4) == (5, 3, fives)  # the look
        urgent = uuid.uuid4()
        send_job(app, urgent, 0)  # sent after the look
        assert take_jobs(redis_client, settings, 5, [fives[1]], 4, more_urgent=range(5)) == []
        assert take_messages(redis_client, settings, [*range(5), 5], 2, wait=None) == [(urgent, 0)]
        assert take_jobs(redis_client, settings, 5, [fives[1]], 4, more_urgent=range(5)) == [(fives[1], 5)]
        assert take_jobs(redis_client, settings, 5, [fives[2]], 4) == [(fives[2], 5)]  # none asked about
    finally:
        app.close()
        redis_client.delete(*(queue_key(settings, QUEUE, p) for p in PRIORITIES))
