"""libpolybeast.DynamicBatcher: callers get their own rows back, batch sizes are respected, and no
failure (bad outputs, a dropped batch, close) leaves a caller blocked."""

import time

import numpy as np
import pytest

from libpolybeast import Batch, ClosedBatchingQueue, DynamicBatcher

from thread_helpers import JOIN_TIMEOUT_S, join, start


def serve(batcher, answer, batch_sizes=None):
    """An inference thread: answers every batch with answer(inputs)."""

    def loop():
        for batch in batcher:
            inputs = batch.get_inputs()
            if batch_sizes is not None:
                batch_sizes.append(len(inputs["id"][0]))
            batch.set_outputs(answer(inputs))

    return start(loop)


def call(batcher, inputs, results, errors, key):
    try:
        results[key] = batcher.compute(inputs)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        errors[key] = error


def test_every_caller_gets_its_own_slice():
    batcher = DynamicBatcher(batch_dim=1, minimum_batch_size=1, maximum_batch_size=5,
                             timeout_ms=5)
    batch_sizes = []
    inference = serve(batcher, lambda x: {"id": x["id"] * 2, "obs": x["obs"] * 2}, batch_sizes)
    failures = []

    def caller(i):
        rng = np.random.default_rng(i)
        for step in range(25):
            obs = rng.standard_normal((1, 1, 3)).astype(np.float32)
            out = batcher.compute({"id": np.full((1, 1), i, np.int64), "obs": obs})
            if out["id"].tolist() != [[2 * i]] or not np.array_equal(out["obs"], obs * 2):
                failures.append((i, step, out))

    callers = [start(caller, i) for i in range(12)]
    join(*callers)
    batcher.close()
    join(inference)
    assert failures == []
    assert sum(batch_sizes) == 12 * 25
    assert max(batch_sizes) <= 5


def test_callers_with_several_rows_get_their_rows():
    batcher = DynamicBatcher(batch_dim=0, minimum_batch_size=3, maximum_batch_size=3)
    inference = serve(batcher, lambda x: {"id": x["id"] + 100})
    results, errors = {}, {}
    callers = [start(call, batcher, {"id": np.full((rows, 2), rows)}, results, errors, rows)
               for rows in (1, 2, 3)]
    join(*callers)
    batcher.close()
    join(inference)
    assert errors == {}
    for rows in (1, 2, 3):
        assert results[rows]["id"].shape == (rows, 2)
        assert (results[rows]["id"] == rows + 100).all()


def test_minimum_and_maximum_batch_sizes():
    batcher = DynamicBatcher(batch_dim=1, minimum_batch_size=2, maximum_batch_size=3,
                             timeout_ms=None)
    results, errors = {}, {}
    callers = [start(call, batcher, {"id": np.full((1, 1), i)}, results, errors, i)
               for i in range(8)]
    # All requests queue up first, so the batches are exactly 3, 3, 2.
    for _ in range(JOIN_TIMEOUT_S * 100):
        if batcher.size() == 8:
            break
        time.sleep(0.01)
    assert batcher.size() == 8
    batch_sizes = []
    inference = serve(batcher, lambda x: x, batch_sizes)
    join(*callers)
    batcher.close()
    join(inference)
    assert errors == {} and len(results) == 8
    assert batch_sizes == [3, 3, 2]
    assert all(results[i]["id"].tolist() == [[i]] for i in range(8))


def test_single_caller_below_minimum_waits():
    batcher = DynamicBatcher(batch_dim=1, minimum_batch_size=2, timeout_ms=None)
    results, errors = {}, {}
    caller = start(call, batcher, {"id": np.zeros((1, 1))}, results, errors, 0)
    caller.join(0.2)
    assert caller.is_alive()
    assert batcher.size() == 1
    batcher.close()
    join(caller)
    assert isinstance(errors[0], ClosedBatchingQueue)


def test_wrong_output_batch_size_raises_in_callers_and_inference():
    batcher = DynamicBatcher(batch_dim=1, minimum_batch_size=2, maximum_batch_size=2)
    inference_errors = []

    def inference():
        for batch in batcher:
            outputs = {"id": np.zeros((1, 3))}  # 3 rows for a batch of 2
            try:
                batch.set_outputs(outputs)
            except ValueError as error:
                inference_errors.append(error)

    thread = start(inference)
    results, errors = {}, {}
    callers = [start(call, batcher, {"id": np.full((1, 1), i)}, results, errors, i)
               for i in range(2)]
    join(*callers)
    batcher.close()
    join(thread)
    assert results == {}
    assert set(errors) == {0, 1}
    for error in errors.values():
        assert isinstance(error, RuntimeError) and "batch size 3" in str(error)
    assert len(inference_errors) == 1 and "batch size 3" in str(inference_errors[0])


def test_dropped_batch_raises_in_callers():
    batcher = DynamicBatcher(batch_dim=1)

    def failing_inference():
        for batch in batcher:
            del batch  # as if the model raised before set_outputs

    thread = start(failing_inference)
    results, errors = {}, {}
    caller = start(call, batcher, {"id": np.zeros((1, 1))}, results, errors, 0)
    join(caller)
    batcher.close()
    join(thread)
    assert isinstance(errors[0], RuntimeError)
    assert "dropped without set_outputs" in str(errors[0])


def test_close_wakes_callers_and_ends_iteration():
    batcher = DynamicBatcher(batch_dim=1)
    results, errors = {}, {}
    callers = [start(call, batcher, {"id": np.full((1, 1), i)}, results, errors, i)
               for i in range(4)]
    for _ in range(3000):
        if batcher.size() == 4:
            break
        time.sleep(0.01)
    batcher.close()
    batcher.close()
    join(*callers)
    assert results == {}
    assert all(isinstance(errors[i], ClosedBatchingQueue) for i in range(4))
    assert batcher.is_closed()
    assert list(batcher) == []
    with pytest.raises(ClosedBatchingQueue):
        batcher.compute({"id": np.full((1, 1), 9)})


def test_close_wakes_waiting_inference_thread():
    batcher = DynamicBatcher(batch_dim=1)
    thread = serve(batcher, lambda x: x)
    thread.join(0.1)
    assert thread.is_alive()
    batcher.close()
    join(thread)


def test_set_outputs_twice_raises():
    batcher = DynamicBatcher(batch_dim=0)
    got = []

    def inference():
        batch = next(batcher)
        assert isinstance(batch, Batch)
        batch.set_outputs(batch.get_inputs())
        try:
            batch.set_outputs(batch.get_inputs())
        except RuntimeError as error:
            got.append(error)

    thread = start(inference)
    assert batcher.compute(np.ones((1, 2))).tolist() == [[1, 1]]
    join(thread)
    assert "already" in str(got[0])


def test_inputs_that_do_not_fit_the_first_raise_value_error():
    batcher = DynamicBatcher(batch_dim=1)
    inference = serve(batcher, lambda x: x)
    batcher.compute({"id": np.zeros((1, 1, 4))})
    with pytest.raises(ValueError, match=r"\['id'\].*\(1, 1, 4\).*\(1, 1, 5\)"):
        batcher.compute({"id": np.zeros((1, 1, 5))})
    with pytest.raises(ValueError, match="no batch dimension"):
        batcher.compute({"id": np.zeros((1,))})
    batcher.close()
    join(inference)
