"""libpolybeast.BatchingQueue: one small test per rule, a many-producer/many-consumer stress test
and a randomized comparison against np.concatenate."""

import time

import numpy as np
import pytest

import libpolybeast
from libpolybeast import BatchingQueue, ClosedBatchingQueue

from thread_helpers import JOIN_TIMEOUT_S, join, start


def item(i, rows=1):
    return {"id": np.full((rows,), i, np.int64), "x": np.full((rows, 2), i, np.float32)}


def test_fifo_order_one_at_a_time():
    queue = BatchingQueue(batch_dim=0, minimum_batch_size=1, maximum_batch_size=1)
    for i in range(10):
        queue.enqueue(item(i))
    assert queue.size() == 10
    ids = [next(queue)["id"].tolist() for _ in range(10)]
    assert ids == [[i] for i in range(10)]
    assert queue.size() == 0


def test_batches_keep_fifo_order_and_stop_at_maximum():
    queue = BatchingQueue(batch_dim=0, minimum_batch_size=1, maximum_batch_size=5)
    for i in range(7):
        queue.enqueue(item(i))
    first, second = next(queue), next(queue)
    assert first["id"].tolist() == [0, 1, 2, 3, 4]
    assert first["x"].shape == (5, 2)
    assert second["id"].tolist() == [5, 6]


def test_batch_size_counts_items_not_rows():
    queue = BatchingQueue(batch_dim=0, minimum_batch_size=2, maximum_batch_size=2)
    queue.enqueue(item(0, rows=3))
    queue.enqueue(item(1, rows=1))
    batch = next(queue)
    assert batch["id"].tolist() == [0, 0, 0, 1]


def test_waits_for_minimum_batch_size():
    queue = BatchingQueue(batch_dim=0, minimum_batch_size=3, maximum_batch_size=10)
    results = []
    queue.enqueue(item(0))
    queue.enqueue(item(1))
    consumer = start(lambda: results.append(next(queue)))
    consumer.join(0.2)
    assert consumer.is_alive(), "returned a batch below minimum_batch_size"
    queue.enqueue(item(2))
    join(consumer)
    assert results[0]["id"].tolist() == [0, 1, 2]


def test_timeout_returns_partial_batch():
    queue = BatchingQueue(batch_dim=0, minimum_batch_size=4, maximum_batch_size=8, timeout_ms=20)
    queue.enqueue(item(0))
    queue.enqueue(item(1))
    assert next(queue)["id"].tolist() == [0, 1]


def test_timeout_on_empty_queue_waits_for_one_item():
    queue = BatchingQueue(batch_dim=0, minimum_batch_size=4, timeout_ms=1)
    results = []
    consumer = start(lambda: results.append(next(queue)))
    consumer.join(0.2)
    assert consumer.is_alive(), "returned an empty batch"
    queue.enqueue(item(7))
    join(consumer)
    assert results[0]["id"].tolist() == [7]


def test_bounded_capacity_blocks_enqueue():
    queue = BatchingQueue(batch_dim=0, maximum_batch_size=1, maximum_queue_size=2)
    queue.enqueue(item(0))
    queue.enqueue(item(1))
    producer = start(queue.enqueue, item(2))
    producer.join(0.2)
    assert producer.is_alive(), "enqueue did not block on a full queue"
    assert queue.size() == 2
    assert next(queue)["id"].tolist() == [0]
    join(producer)
    assert [next(queue)["id"].tolist() for _ in range(2)] == [[1], [2]]


def test_many_producers_and_consumers_deliver_every_item_exactly_once():
    num_producers, num_consumers, per_producer = 4, 4, 300
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 4, size=(num_producers, per_producer))
    queue = BatchingQueue(batch_dim=0, minimum_batch_size=1, maximum_batch_size=7,
                          maximum_queue_size=16)
    batches = [[] for _ in range(num_consumers)]

    def produce(p):
        for i in range(per_producer):
            uid = p * per_producer + i
            queue.enqueue({"id": np.full((rows[p, i],), uid, np.int64),
                           "x": np.full((rows[p, i], 3), uid, np.float64)})

    def consume(c):
        for batch in queue:
            batches[c].append(batch)

    consumers = [start(consume, c) for c in range(num_consumers)]
    producers = [start(produce, p) for p in range(num_producers)]
    join(*producers)
    # Every item is enqueued; wait until the consumers have taken them all, then close.
    for _ in range(JOIN_TIMEOUT_S * 100):
        if queue.size() == 0:
            break
        time.sleep(0.01)
    assert queue.size() == 0
    queue.close()
    join(*consumers)

    seen = []
    for consumer_batches in batches:
        for batch in consumer_batches:
            assert (batch["x"] == batch["id"][:, None]).all()
            ids = batch["id"]
            unique = ids[np.concatenate([[True], ids[1:] != ids[:-1]])]
            # Within a batch, each producer's items keep their order.
            for p in range(num_producers):
                mine = unique[unique // per_producer == p]
                assert (np.diff(mine) > 0).all()
            seen.extend(unique.tolist())
            # Each item arrives whole: all its rows together.
            for uid in unique:
                p, i = divmod(int(uid), per_producer)
                assert (ids == uid).sum() == rows[p, i]
    assert sorted(seen) == list(range(num_producers * per_producer))


def test_close_wakes_blocked_producer_and_consumer():
    full = BatchingQueue(batch_dim=0, maximum_queue_size=1)
    full.enqueue(item(0))
    empty = BatchingQueue(batch_dim=0)
    errors, consumed = [], []

    def produce():
        try:
            full.enqueue(item(1))
        except ClosedBatchingQueue as error:
            errors.append(error)

    def consume():
        consumed.extend(empty)

    threads = [start(produce), start(consume)]
    threads[0].join(0.1)
    assert all(t.is_alive() for t in threads)
    full.close()
    empty.close()
    join(*threads)
    assert len(errors) == 1 and consumed == []


def test_close_is_idempotent_drops_pending_items_and_refuses_new_ones():
    queue = BatchingQueue(batch_dim=0)
    queue.enqueue(item(0))
    assert not queue.is_closed()
    queue.close()
    queue.close()
    assert queue.is_closed()
    assert list(queue) == []  # pending items are dropped
    with pytest.raises(ClosedBatchingQueue):
        queue.enqueue(item(1))
    assert issubclass(libpolybeast.ClosedBatchingQueue, RuntimeError)


def test_mismatched_shapes_raise_value_error_naming_key_and_shapes():
    queue = BatchingQueue(batch_dim=1)
    queue.enqueue({"frame": np.zeros((1, 1, 4), np.uint8), "reward": np.zeros((1, 1))})
    with pytest.raises(ValueError, match=r"\['frame'\].*\(1, 1, 5\).*\(1, 1, 4\)|"
                                         r"\['frame'\].*\(1, 1, 4\).*\(1, 1, 5\)"):
        queue.enqueue({"frame": np.zeros((1, 1, 5), np.uint8), "reward": np.zeros((1, 1))})
    with pytest.raises(ValueError, match="dtypes differ.*uint8.*float32"):
        queue.enqueue({"frame": np.zeros((1, 1, 4), np.float32), "reward": np.zeros((1, 1))})
    with pytest.raises(ValueError, match="keys differ"):
        queue.enqueue({"frame": np.zeros((1, 1, 4), np.uint8)})
    with pytest.raises(ValueError, match=r"\['reward'\].*no batch dimension"):
        queue.enqueue({"frame": np.zeros((1, 1, 4), np.uint8), "reward": np.zeros((1,))})
    with pytest.raises(ValueError, match="batch sizes differ"):
        queue.enqueue({"frame": np.zeros((1, 2, 4), np.uint8), "reward": np.zeros((1, 1))})
    with pytest.raises(ValueError, match="str"):
        queue.enqueue({"frame": "not an array"})
    assert queue.size() == 1


def test_without_check_inputs_the_consumer_gets_the_error():
    queue = BatchingQueue(batch_dim=0, minimum_batch_size=2, check_inputs=False)
    queue.enqueue(np.zeros((1, 3)))
    queue.enqueue(np.zeros((1, 4)))
    with pytest.raises(ValueError, match=r"\(1, 3\).*\(1, 4\)"):
        next(queue)


def test_invalid_arguments():
    with pytest.raises(ValueError):
        BatchingQueue(minimum_batch_size=0)
    with pytest.raises(ValueError):
        BatchingQueue(minimum_batch_size=4, maximum_batch_size=2)
    with pytest.raises(ValueError):
        BatchingQueue(maximum_queue_size=0)
    with pytest.raises(ValueError):
        BatchingQueue(batch_dim=-1)


def test_python_scalars_and_structures_round_trip():
    queue = BatchingQueue(batch_dim=0)
    queue.enqueue({"list": [np.ones(1, np.bool_), (np.arange(1, dtype=np.int16),)],
                   "scalar_row": np.array([3.5])})
    batch = next(queue)
    assert isinstance(batch["list"], list) and isinstance(batch["list"][1], tuple)
    assert batch["list"][0].dtype == np.bool_ and batch["list"][1][0].dtype == np.int16
    assert batch["scalar_row"].tolist() == [3.5]


def test_returned_arrays_are_writable_and_independent():
    queue = BatchingQueue(batch_dim=0)
    source = np.arange(4, dtype=np.float32).reshape(1, 4)
    queue.enqueue(source)
    out = next(queue)
    out += 1  # torch.from_numpy wants writable arrays
    assert source.tolist() == [[0, 1, 2, 3]]
    assert out.flags.writeable and out.flags.c_contiguous


DTYPES = [np.uint8, np.int32, np.int64, np.float32, np.float64, np.bool_, np.float16]


def test_randomized_batches_match_numpy_concatenate():
    rng = np.random.default_rng(1234)
    for _ in range(40):
        batch_dim = int(rng.integers(0, 3))
        num_items = int(rng.integers(1, 6))
        leaves = []
        for _ in range(3):
            rank = batch_dim + 1 + int(rng.integers(0, 3))
            shape = rng.integers(1, 4, size=rank)
            leaves.append((shape, DTYPES[rng.integers(len(DTYPES))]))
        queue = BatchingQueue(batch_dim=batch_dim, minimum_batch_size=num_items,
                              maximum_batch_size=num_items)
        items = []
        for _ in range(num_items):
            rows = int(rng.integers(1, 4))
            arrays = []
            for shape, dtype in leaves:
                shape = shape.copy()
                shape[batch_dim] = rows
                arrays.append((rng.standard_normal(shape) * 10).astype(dtype))
            nest = {"a": arrays[0], "b": [arrays[1], (arrays[2],)]}
            items.append(arrays)
            queue.enqueue(nest)
        batch = next(queue)
        got = [batch["a"], batch["b"][0], batch["b"][1][0]]
        for leaf, out in enumerate(got):
            expected = np.concatenate([arrays[leaf] for arrays in items], axis=batch_dim)
            assert out.dtype == expected.dtype
            np.testing.assert_array_equal(out, expected)
