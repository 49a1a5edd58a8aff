"""libpolybeast.ActorPool against EnvServers in this process: rollout layout, the overlap between
consecutive unrolls, episode boundaries, agent state, extra environment fields, environment error
counts, a server restart, and shutdown. Against broken TorchBeast-like servers
(tests/torchbeast_server.py): streams that go silent (stream_timeout_s) or end before a rollout is
complete (no progress, connect_timeout_s), and the rate-limited log. And interpreter exit while
run() is active."""

import os
import pathlib
import re
import threading
import time

import numpy as np
import pytest

import libpolybeast
from libpolybeast import ActorPool, BatchingQueue, DynamicBatcher, EnvServer
from torchbeast_server import LivesEnv, TorchBeastServer, rpcenv_modules

JOIN_TIMEOUT_S = 30
WAIT_S = 60  # upper bound for rollouts to arrive; never reached when things work
EPISODE_LENGTH = 5
UNROLL_LENGTH = 4
NUM_ACTIONS = 3
# The environment-side keys of today's rollouts, which every step must carry.
ENV_KEYS = ("frame", "reward", "done", "game_over", "episode_return", "episode_step",
            "last_action")


class CountingEnv:
    """Deterministic adapter. frame = [server, instance, steps since creation, episode step].

    With extras, each step also has fields that C++ does not know by name: lives (int32
    scalar, 100 + steps since creation) and aux (float32 [2], [steps, episode step / 2]).
    With fail_at_step, step() raises at that step of its lifetime."""

    def __init__(self, server, instance, extras=False, fail_at_step=None):
        self.server, self.instance = server, instance
        self.extras, self.fail_at_step = extras, fail_at_step
        self.total = 0
        self.episode_step = 0
        self.episode_return = 0.0

    def frame(self):
        return np.array([self.server, self.instance, self.total, self.episode_step], np.int64)

    def with_extras(self, result):
        if self.extras:
            result.update(lives=np.int32(100 + self.total),
                          aux=np.array([self.total, self.episode_step / 2], np.float32))
        return result

    def initial(self):
        return self.with_extras(dict(frame=self.frame(), reward=0.0, done=True, game_over=False,
                                     episode_return=0.0, episode_step=0))

    def step(self, action):
        self.total += 1
        if self.total == self.fail_at_step:
            raise RuntimeError("the emulator crashed")
        self.episode_step += 1
        self.episode_return += float(action)
        result = dict(reward=np.float32(action), episode_return=np.float32(self.episode_return),
                      episode_step=np.int32(self.episode_step))
        done = self.episode_step == EPISODE_LENGTH
        if done:
            self.episode_step = 0
            self.episode_return = 0.0
        result.update(frame=self.frame(), done=done, game_over=done)
        return self.with_extras(result)


class CountingVectorEnv:
    """num_envs CountingEnvs behind one stream, in beast.vector_envs' format (Step.batch)."""

    def __init__(self, envs):
        self.envs = envs
        self.num_envs = len(envs)

    DTYPES = dict(frame=np.int64, reward=np.float32, done=np.bool_, game_over=np.bool_,
                  episode_return=np.float32, episode_step=np.int32)

    def _stack(self, results, last_action):
        batch = {key: np.array([r[key] for r in results], dtype)
                 for key, dtype in self.DTYPES.items()}
        batch["last_action"] = np.asarray(last_action, np.int64)
        for key in results[0].keys() - batch.keys():  # the extras, with their own dtypes
            batch[key] = np.stack([r[key] for r in results])
        return batch

    def initial(self):
        return self._stack([env.initial() for env in self.envs], np.zeros(self.num_envs))

    def step(self, actions):
        assert actions.shape == (self.num_envs,) and actions.dtype == np.int64
        return self._stack([env.step(a) for env, a in zip(self.envs, actions)], actions)


class FlakyVectorEnv(CountingVectorEnv):
    """Says it restarted one of its environments itself (`restarts`, as GymnasiumVectorEnv
    counts them) at its step 2, and raises at its step 4 unless told not to."""

    def __init__(self, envs, fails):
        super().__init__(envs)
        self.fails = fails
        self.steps = 0
        self.restarts = 0

    def step(self, actions):
        self.steps += 1
        if self.steps == 2:
            self.restarts += 1
        if self.steps == 4 and self.fails:
            raise RuntimeError("the vector env crashed")
        return super().step(actions)


FLAKY_ADAPTERS = 2  # with flaky=True, the first adapters of each server raise in step()
# Restarts each server's stream reports with flaky=True: per single-environment stream, one
# per failing adapter; per batched stream, each failing adapter's restart and its own
# `restarts` (1 each), plus the `restarts` of the adapter that lasts.
FLAKY_ERRORS = {None: FLAKY_ADAPTERS, 3: 2 * FLAKY_ADAPTERS + 1}


class Server:
    """An EnvServer in a thread; instances are numbered across restarts. extras and flaky: see
    CountingEnv and FlakyVectorEnv."""

    instances = 0

    def __init__(self, index, address, envs_per_stream=None, extras=False, flaky=False):
        self.index, self.address = index, address
        self.envs_per_stream = envs_per_stream  # None: single-environment streams
        self.extras, self.flaky = extras, flaky
        self.adapters = 0  # adapters this server created
        self.start()

    def _counting_env(self, fail_at_step=None):
        Server.instances += 1
        return CountingEnv(self.index, Server.instances, self.extras, fail_at_step)

    def factory(self, envs_per_stream=None):  # the learner's ask: this server keeps its own
        self.adapters += 1
        fails = self.flaky and self.adapters <= FLAKY_ADAPTERS
        if self.envs_per_stream is None:
            return self._counting_env(fail_at_step=3 if fails else None)
        envs = [self._counting_env() for _ in range(self.envs_per_stream)]
        if self.flaky:
            return FlakyVectorEnv(envs, fails)
        return CountingVectorEnv(envs)

    def start(self):
        self.server = EnvServer(self.factory, self.address)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.stop()
        self.thread.join(JOIN_TIMEOUT_S)
        assert not self.thread.is_alive()


def policy(frame):
    """The action the test inference picks for a frame [..., 4]."""
    return (frame[..., 2] * 7 + frame[..., 3]) % NUM_ACTIONS


def inference_loop(batcher, errors, delay_s=0.0):
    """Answers with a deterministic action (after delay_s); agent state = number of steps
    computed; the state each step saw is echoed as 'state_seen' so the test can line it up
    with the rollout."""
    try:
        for batch in batcher:
            env_outputs, state = batch.get_inputs()
            frame = env_outputs["frame"]  # [1, B, 4]
            time.sleep(delay_s)
            batch.set_outputs((
                dict(action=policy(frame).astype(np.int64),
                     policy_logits=np.zeros(frame.shape[:2] + (NUM_ACTIONS,), np.float32),
                     baseline=np.zeros(frame.shape[:2], np.float32),
                     state_seen=state.copy()),
                state + 1,
            ))
    except Exception as error:  # noqa: BLE001 - reported by the test
        errors.append(error)


class Pool:
    """Servers (or the given addresses), an inference thread, the pool, and a thread that
    collects rollouts while `collecting` is set."""

    def __init__(self, tmp_path, num_servers=2, connect_timeout_s=60.0, envs_per_stream=None,
                 extras=False, flaky=False, env_keys=ENV_KEYS, addresses=None,
                 unroll_length=UNROLL_LENGTH, stream_timeout_s=30.0, inference_delay_s=0.0,
                 learner_queue_size=8, collecting=True, scheme="unix", ask_envs_per_stream=0):
        self.servers = [] if addresses is not None else [
            Server(i, f"{scheme}:{tmp_path}/env.{i}", envs_per_stream, extras, flaky)
            for i in range(num_servers)]
        addresses = addresses or [s.address for s in self.servers]
        self.learner_queue = BatchingQueue(batch_dim=1, minimum_batch_size=1,
                                           maximum_batch_size=1,
                                           maximum_queue_size=learner_queue_size)
        self.batcher = DynamicBatcher(batch_dim=1, minimum_batch_size=1, maximum_batch_size=4,
                                      timeout_ms=5)
        self.initial_state = np.zeros((1, 1, 1), np.float32)  # [layers, B, hidden]
        self.pool = ActorPool(
            unroll_length=unroll_length, learner_queue=self.learner_queue,
            inference_batcher=self.batcher, env_server_addresses=addresses,
            initial_agent_state=self.initial_state, env_keys=list(env_keys),
            connect_timeout_s=connect_timeout_s, stream_timeout_s=stream_timeout_s,
            envs_per_stream=ask_envs_per_stream)
        self.errors, self.run_errors = [], []
        self.rollouts = []  # (rollout dict, initial agent state), in arrival order
        self.lock = threading.Lock()
        self.collecting = threading.Event()
        if collecting:
            self.collecting.set()
        self.threads = [threading.Thread(target=inference_loop,
                                         args=(self.batcher, self.errors, inference_delay_s),
                                         daemon=True),
                        threading.Thread(target=self._collect, daemon=True)]
        self.pool_thread = threading.Thread(target=self._run, daemon=True)
        for thread in self.threads + [self.pool_thread]:
            thread.start()

    def _run(self):
        try:
            self.pool.run()
        except Exception as error:  # noqa: BLE001 - inspected by the test
            self.run_errors.append(error)

    def _collect(self):
        rollouts = iter(self.learner_queue)
        while True:
            while not self.collecting.wait(0.05):
                if self.learner_queue.is_closed():
                    return
            try:
                rollout, state = next(rollouts)
            except StopIteration:
                return
            with self.lock:
                self.rollouts.append((rollout, state))

    def wait_for(self, condition, what):
        """Waits until condition(rollouts so far) holds."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            with self.lock:
                if condition(list(self.rollouts)):
                    return
            assert self.pool_thread.is_alive(), f"ActorPool.run() ended: {self.run_errors}"
            time.sleep(0.02)
        pytest.fail(f"timed out waiting for {what}")

    def shutdown(self):
        """Closing the queues is enough to end run()."""
        self.learner_queue.close()
        self.batcher.close()
        self.pool_thread.join(JOIN_TIMEOUT_S)
        assert not self.pool_thread.is_alive(), "ActorPool.run() did not return after close"
        for thread in self.threads:
            thread.join(JOIN_TIMEOUT_S)
            assert not thread.is_alive()
        for server in self.servers:
            server.stop()
        assert self.errors == []


def by_instance(rollouts):
    """{env instance: [(rollout, state), ...]} in arrival order."""
    groups = {}
    for rollout, state in rollouts:
        groups.setdefault(int(rollout["frame"][0, 0, 1]), []).append((rollout, state))
    return groups


def expected_episode_return(total):
    """The episode_return CountingEnv reports after `total` steps of its lifetime under
    `policy`: the rewards (reward[s+1] = action[s]) of the episode that step `total` belongs
    to, the one it ends included; 0 at creation."""
    if total == 0:
        return 0.0
    start = (total - 1) // EPISODE_LENGTH * EPISODE_LENGTH
    steps = np.arange(start, total)
    frames = np.stack([0 * steps, 0 * steps, steps, steps % EPISODE_LENGTH], axis=-1)
    return float(policy(frames).sum())


def check_rollout(rollout, state):
    """Everything that must hold within one rollout."""
    T = UNROLL_LENGTH
    frame = rollout["frame"][:, 0]  # [T+1, 4]
    assert (frame[:, :2] == frame[0, :2]).all(), "a rollout mixes servers or env instances"
    total, episode_step = frame[:, 2], frame[:, 3]
    assert (np.diff(total) == 1).all(), f"frames are not consecutive: {total}"
    # Initial step (total 0) and every EPISODE_LENGTH-th step end an episode.
    np.testing.assert_array_equal(rollout["done"][:, 0], total % EPISODE_LENGTH == 0)
    np.testing.assert_array_equal(rollout["game_over"][:, 0],
                                  (total % EPISODE_LENGTH == 0) & (total > 0))
    np.testing.assert_array_equal(episode_step, total % EPISODE_LENGTH)
    # obs[t] -> action[t]; action[t] -> last_action[t+1] and reward[t+1].
    action = rollout["action"][:, 0]
    np.testing.assert_array_equal(action, policy(frame))
    np.testing.assert_array_equal(rollout["last_action"][1:, 0], action[:-1])
    np.testing.assert_array_equal(rollout["reward"][1:, 0], action[:-1].astype(np.float32))
    if total[0] == 0:
        assert rollout["last_action"][0, 0] == 0 and rollout["reward"][0, 0] == 0
    # The state before step 0 is what the model saw at step 0, and it counts the steps so far.
    assert state.shape == (1, 1, 1)
    assert rollout["state_seen"][0].ravel()[0] == state.ravel()[0] == total[0]
    assert rollout["state_seen"][:, 0, 0].tolist() == list(range(total[0], total[0] + T + 1))
    # The episode's return so far at every step; at an episode's end, the whole episode's.
    np.testing.assert_array_equal(rollout["episode_return"][:, 0],
                                  [expected_episode_return(u) for u in total])
    for t in np.flatnonzero(rollout["game_over"][:, 0]):
        assert rollout["episode_step"][t, 0] == EPISODE_LENGTH


def check_overlap(previous, following):
    """Step T of unroll k is step 0 of unroll k+1, for every key."""
    for key in previous:
        np.testing.assert_array_equal(previous[key][-1], following[key][0], err_msg=key)


@pytest.mark.parametrize("scheme", ["unix", "raw"], ids=["grpc", "raw"])
def test_rollouts_have_the_layout_overlap_and_episode_boundaries(tmp_path, scheme):
    pool = Pool(tmp_path, scheme=scheme)
    try:
        pool.wait_for(lambda rs: all(len(g) >= 4 for g in by_instance(rs).values())
                      and len(by_instance(rs)) == 2, "4 rollouts from each server")
        assert pool.pool.count() > 0
    finally:
        pool.shutdown()

    T = UNROLL_LENGTH
    rollout, state = pool.rollouts[0]
    shapes = {key: (value.shape, value.dtype) for key, value in rollout.items()}
    assert shapes == {
        "frame": ((T + 1, 1, 4), np.int64),
        "reward": ((T + 1, 1), np.float32),
        "done": ((T + 1, 1), np.bool_),
        "game_over": ((T + 1, 1), np.bool_),
        # Absent from the wire (the adapter has no time limit): false, as TorchBeast means.
        "truncated": ((T + 1, 1), np.bool_),
        "episode_return": ((T + 1, 1), np.float32),
        "episode_step": ((T + 1, 1), np.int32),
        "last_action": ((T + 1, 1), np.int64),
        "action": ((T + 1, 1), np.int64),
        "policy_logits": ((T + 1, 1, NUM_ACTIONS), np.float32),
        "baseline": ((T + 1, 1), np.float32),
        "state_seen": ((T + 1, 1, 1), np.float32),
    }
    assert state.dtype == np.float32
    for group in by_instance(pool.rollouts).values():
        assert group[0][0]["frame"][0, 0, 2] == 0, "the first rollout starts at the initial step"
        for k, (rollout, state) in enumerate(group):
            check_rollout(rollout, state)
            assert rollout["frame"][0, 0, 2] == k * T
        for (previous, _), (following, _) in zip(group, group[1:]):
            check_overlap(previous, following)


def os_thread_names():
    """The OS names of this process's threads, as top -H and py-spy see them."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_actor_threads_are_named_by_their_index(tmp_path):
    pool = Pool(tmp_path)
    try:
        pool.wait_for(lambda rs: len(by_instance(rs)) == 2, "a rollout from each server")
        names = os_thread_names()
    finally:
        pool.shutdown()
    assert names.count("actor-0") == 1 and names.count("actor-1") == 1, names


@pytest.mark.parametrize("scheme", ["unix", "raw"], ids=["grpc", "raw"])
def test_batched_streams_give_one_rollout_per_environment(tmp_path, scheme):
    """Servers with 3 environments per stream: the learner queue still gets [T+1, 1] rollouts,
    one sequence per environment, each as consistent as a single-environment stream's."""
    pool = Pool(tmp_path, envs_per_stream=3, scheme=scheme)
    try:
        pool.wait_for(lambda rs: len(by_instance(rs)) == 6 and
                      all(len(g) >= 3 for g in by_instance(rs).values()),
                      "3 rollouts from each of the 6 environments")
    finally:
        pool.shutdown()
    assert pool.pool.count() >= 6 * 3 * UNROLL_LENGTH
    rollout, state = pool.rollouts[0]
    assert rollout["frame"].shape == (UNROLL_LENGTH + 1, 1, 4)
    assert rollout["last_action"].dtype == np.int64 and state.shape == (1, 1, 1)
    groups = by_instance(pool.rollouts)
    servers = sorted(int(g[0][0]["frame"][0, 0, 0]) for g in groups.values())
    assert servers == [0, 0, 0, 1, 1, 1]
    for group in groups.values():
        assert group[0][0]["frame"][0, 0, 2] == 0
        for k, (rollout, state) in enumerate(group):
            check_rollout(rollout, state)
            assert rollout["frame"][0, 0, 2] == k * UNROLL_LENGTH
        for (previous, _), (following, _) in zip(group, group[1:]):
            check_overlap(previous, following)


@pytest.mark.parametrize("scheme", ["unix", "raw"], ids=["grpc", "raw"])
def test_server_restart_does_not_break_rollouts(tmp_path, scheme, capfd):
    pool = Pool(tmp_path, scheme=scheme)
    try:
        pool.wait_for(lambda rs: len(by_instance(rs)) == 2 and
                      all(len(g) >= 2 for g in by_instance(rs).values()), "rollouts from both")
        restarted = pool.servers[0]
        restarted.stop()  # the actor's stream breaks; it reconnects to the new server
        with pool.lock:
            before = set(by_instance(pool.rollouts))
        restarted.start()
        pool.wait_for(lambda rs: any(
            g[0][0]["frame"][0, 0, 0] == 0 and len(g) >= 3
            for i, g in by_instance(rs).items() if i not in before), "rollouts after the restart")
        # The other actor went on throughout.
        other = [i for i, g in by_instance(pool.rollouts).items() if g[0][0]["frame"][0, 0, 0] == 1]
        assert len(other) == 1
    finally:
        pool.shutdown()

    groups = by_instance(pool.rollouts)
    assert len(groups) == 3  # server 0 before and after the restart, server 1
    for group in groups.values():
        assert group[0][0]["frame"][0, 0, 2] == 0
        for k, (rollout, state) in enumerate(group):
            check_rollout(rollout, state)  # no rollout spans the restart
            assert rollout["frame"][0, 0, 2] == k * UNROLL_LENGTH
        for (previous, _), (following, _) in zip(group, group[1:]):
            check_overlap(previous, following)
    err = capfd.readouterr().err
    assert "lost the env server" in err and "reconnected" in err


@pytest.mark.parametrize("scheme", ["unix", "raw"], ids=["grpc", "raw"])
def test_pool_close_ends_run(tmp_path, scheme):
    pool = Pool(tmp_path, scheme=scheme)
    try:
        pool.wait_for(lambda rs: len(rs) >= 1, "a rollout")
        pool.pool.close()
        pool.pool.close()
        pool.pool_thread.join(JOIN_TIMEOUT_S)
        assert not pool.pool_thread.is_alive()
        assert pool.run_errors == []
    finally:
        pool.shutdown()


@pytest.mark.parametrize("scheme", ["unix", "raw"], ids=["grpc", "raw"])
def test_unreachable_server_fails_run_naming_the_address(tmp_path, scheme):
    address = f"{scheme}:{tmp_path}/nobody.sock"
    learner_queue = BatchingQueue(batch_dim=1)
    batcher = DynamicBatcher(batch_dim=1)
    pool = ActorPool(unroll_length=2, learner_queue=learner_queue, inference_batcher=batcher,
                     env_server_addresses=[address], initial_agent_state=(),
                     env_keys=ENV_KEYS, connect_timeout_s=0.5)
    with pytest.raises(RuntimeError, match="nobody.sock.*could not reach"):
        pool.run()
    assert learner_queue.is_closed() and batcher.is_closed()
    with pytest.raises(RuntimeError, match="only be called once"):
        pool.run()


def test_bad_inference_answer_fails_run(tmp_path):
    server = Server(0, f"unix:{tmp_path}/env.0")
    learner_queue = BatchingQueue(batch_dim=1)
    batcher = DynamicBatcher(batch_dim=1)
    pool = ActorPool(unroll_length=2, learner_queue=learner_queue, inference_batcher=batcher,
                     env_server_addresses=[server.address], initial_agent_state=(),
                     env_keys=ENV_KEYS)

    def inference():
        for batch in batcher:
            env_outputs, state = batch.get_inputs()
            batch.set_outputs(({"not_action": env_outputs["reward"]}, state))

    thread = threading.Thread(target=inference, daemon=True)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="env.0.*'action'"):
            pool.run()
        thread.join(JOIN_TIMEOUT_S)
        assert not thread.is_alive()
    finally:
        batcher.close()
        server.stop()


def test_constructor_checks_arguments():
    queue, batcher = BatchingQueue(), DynamicBatcher()
    with pytest.raises(ValueError, match="unroll_length"):
        ActorPool(0, queue, batcher, ["unix:/x"], (), ENV_KEYS)
    for timeout in ("connect_timeout_s", "stream_timeout_s"):
        for value in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match=timeout):
                ActorPool(1, queue, batcher, ["unix:/x"], (), ENV_KEYS, **{timeout: value})
    with pytest.raises(ValueError, match="env_keys"):
        ActorPool(1, queue, batcher, ["unix:/x"], (), ["frame", ""])
    with pytest.raises(TypeError):  # env_keys is required
        ActorPool(1, queue, batcher, ["unix:/x"], ())
    assert libpolybeast.ActorPool is ActorPool


@pytest.mark.parametrize("ask", [2, 3, 0], ids=["other", "same", "none"])
def test_a_server_keeping_its_own_stream_size_is_said_once(tmp_path, capfd, ask):
    """Servers that host 3 environments a stream, asked for `ask`: the pool learns on the
    3, and says once for all streams that the ask was not taken (not when it was, nor when
    nothing was asked)."""
    pool = Pool(tmp_path, envs_per_stream=3, ask_envs_per_stream=ask)
    try:
        pool.wait_for(lambda rs: len(by_instance(rs)) == 6, "rollouts from all 6 environments")
    finally:
        pool.shutdown()
    notes = [line for line in capfd.readouterr().err.splitlines() if "were asked for" in line]
    if ask == 2:
        assert len(notes) == 1, notes
        assert "hosts 3 environment(s) a stream, where 2 were asked for" in notes[0]
    else:
        assert notes == []


@pytest.mark.parametrize("envs_per_stream", [None, 3], ids=["single", "batched"])
def test_extra_env_fields_reach_the_rollouts(tmp_path, envs_per_stream):
    """Keys of the adapter's dict that C++ does not know by name arrive with their dtype and
    values, [T+1, 1, ...] like every field, and can be required by env_keys."""
    pool = Pool(tmp_path, envs_per_stream=envs_per_stream, extras=True,
                env_keys=ENV_KEYS + ("lives", "aux"))
    try:
        pool.wait_for(lambda rs: len(rs) >= 6, "6 rollouts")
    finally:
        pool.shutdown()
    T = UNROLL_LENGTH
    for rollout, state in pool.rollouts:
        assert rollout["lives"].shape == (T + 1, 1) and rollout["lives"].dtype == np.int32
        assert rollout["aux"].shape == (T + 1, 1, 2) and rollout["aux"].dtype == np.float32
        total, episode_step = rollout["frame"][:, 0, 2], rollout["frame"][:, 0, 3]
        np.testing.assert_array_equal(rollout["lives"][:, 0], 100 + total)
        np.testing.assert_array_equal(rollout["aux"][:, 0, 0], total)
        np.testing.assert_array_equal(rollout["aux"][:, 0, 1], episode_step / 2)
        check_rollout(rollout, state)
    for group in by_instance(pool.rollouts).values():
        for (previous, _), (following, _) in zip(group, group[1:]):
            check_overlap(previous, following)


@pytest.mark.parametrize("envs_per_stream", [None, 3], ids=["single", "batched"])
def test_step_without_an_env_key_fails_run_naming_key_and_server(tmp_path, envs_per_stream):
    pool = Pool(tmp_path, num_servers=1, envs_per_stream=envs_per_stream,
                env_keys=ENV_KEYS + ("lives",))
    pool.pool_thread.join(JOIN_TIMEOUT_S)
    assert not pool.pool_thread.is_alive(), "ActorPool.run() did not fail"
    pool.shutdown()
    assert len(pool.run_errors) == 1 and isinstance(pool.run_errors[0], RuntimeError)
    message = str(pool.run_errors[0])
    assert "env.0" in message and "without the env key(s) 'lives'" in message, message
    assert pool.rollouts == []


@pytest.mark.parametrize("envs_per_stream", [None, 3], ids=["single", "batched"])
def test_env_errors_count_restarts_of_flaky_adapters(tmp_path, envs_per_stream, capfd):
    """Each server's adapters raise in step() (and, batched, restart environments themselves);
    env_errors() sums what every stream reports, counting each restart once."""
    pool = Pool(tmp_path, envs_per_stream=envs_per_stream, flaky=True)
    expected = 2 * FLAKY_ERRORS[envs_per_stream]
    try:
        assert pool.pool.env_errors() <= expected
        deadline = time.monotonic() + WAIT_S
        while pool.pool.env_errors() < expected and time.monotonic() < deadline:
            assert pool.pool_thread.is_alive(), f"ActorPool.run() ended: {pool.run_errors}"
            time.sleep(0.02)
        assert pool.pool.env_errors() == expected
        # Steps that report the same total add nothing.
        with pool.lock:
            seen = len(pool.rollouts)
        pool.wait_for(lambda rs: len(rs) >= seen + 4, "4 more rollouts")
        assert pool.pool.env_errors() == expected
    finally:
        pool.shutdown()
    assert all(server.adapters == FLAKY_ADAPTERS + 1 for server in pool.servers)
    assert "crashed" in capfd.readouterr().err


# Servers that go silent, or end their streams too early: see tests/torchbeast_server.py.

@pytest.fixture(scope="module")
def rpcenv(tmp_path_factory):
    """The Python protobuf/gRPC modules generated from csrc/rpcenv.proto."""
    return rpcenv_modules(tmp_path_factory.mktemp("rpcenv_stubs"))


def lost_lines(err):
    return [line for line in err.splitlines() if "lost the env server" in line]


def test_silent_stream_is_cancelled_and_the_actor_reconnects(tmp_path, rpcenv, capfd):
    """A server that stops answering after 3 Steps (one rollout of 2 steps) each stream: the
    actor cancels the stream after stream_timeout_s, says so, and goes on with a new one."""
    address = f"unix:{tmp_path}/silent.sock"
    server = TorchBeastServer(rpcenv, address, steps_per_stream=3, then="hang")
    pool = Pool(tmp_path, addresses=[address], unroll_length=2, stream_timeout_s=0.5)
    try:
        pool.wait_for(lambda rs: len(rs) >= 3, "a rollout from each of 3 streams")
    finally:
        pool.shutdown()
        server.stop()
    assert pool.run_errors == []
    assert len(server.envs) >= 3
    for rollout, _ in pool.rollouts:  # each stream has a fresh env and gives one rollout
        np.testing.assert_array_equal(rollout["frame"][:, 0, 0], [0, 1, 2])
    lines = lost_lines(capfd.readouterr().err)
    assert lines, "the stream timeout was not logged"
    assert re.search(rf"\({re.escape(address)}\): lost the env server \(no Step for [0-9.]+ s, "
                     r"more than stream_timeout_s 0.5 s; cancelled the stream\)", lines[0]), lines


@pytest.mark.parametrize("steps_per_stream", [0, 2], ids=["no-step", "silent-mid-rollout"])
def test_server_that_goes_silent_every_time_fails_the_run(tmp_path, rpcenv, steps_per_stream):
    """Accepting streams but never sending a Step is no contact; going silent before a rollout
    is complete is no progress. Either ends the run after connect_timeout_s, naming why."""
    address = f"unix:{tmp_path}/silent.sock"
    server = TorchBeastServer(rpcenv, address, steps_per_stream=steps_per_stream, then="hang")
    pool = Pool(tmp_path, addresses=[address], unroll_length=4, stream_timeout_s=0.3,
                connect_timeout_s=1.0)
    try:
        pool.pool_thread.join(JOIN_TIMEOUT_S)
        assert not pool.pool_thread.is_alive(), "ActorPool.run() did not fail"
    finally:
        pool.shutdown()
        server.stop()
    assert pool.rollouts == [] and len(pool.run_errors) == 1
    message = str(pool.run_errors[0])
    assert address in message and "more than stream_timeout_s 0.3 s" in message, message
    if steps_per_stream == 0:
        assert "could not reach the env server for 1 s (last problem: no Step for" in message
    else:
        assert re.search(r"no complete rollout for [0-9.]+ s \(connect_timeout_s 1 s\): "
                         r"\d+ stream\(s\) ended before a rollout of unroll_length 4 was "
                         r"complete; the last one: no Step for", message), message


@pytest.mark.slow
def test_streams_that_end_before_a_rollout_fail_the_run(tmp_path, rpcenv, capfd):
    """A server that ends every stream after 2 Steps (a rollout needs 5): no progress, so
    the run ends after connect_timeout_s with the count of such streams and the last reason;
    meanwhile at most one "lost" line per 5 s, with the count of those suppressed."""
    address = f"unix:{tmp_path}/short.sock"
    server = TorchBeastServer(rpcenv, address, steps_per_stream=2, then="end")
    started = time.monotonic()
    pool = Pool(tmp_path, addresses=[address], unroll_length=4, connect_timeout_s=6.5)
    try:
        pool.pool_thread.join(JOIN_TIMEOUT_S)
        assert not pool.pool_thread.is_alive(), "ActorPool.run() did not fail"
    finally:
        pool.shutdown()
        server.stop()
    assert time.monotonic() - started >= 6.5
    assert pool.rollouts == [] and len(pool.run_errors) == 1
    message = str(pool.run_errors[0])
    match = re.search(rf"'{re.escape(address)}' failed: no complete rollout for [0-9.]+ s "
                      r"\(connect_timeout_s 6.5 s\): (\d+) stream\(s\) ended before a rollout "
                      r"of unroll_length 4 was complete; the last one: the server ended the "
                      r"stream", message)
    assert match, message
    # Reconnects back off (0.1 s doubling to 2 s) when a stream gave no rollout.
    streams = int(match.group(1))
    assert streams == len(server.envs) and 5 <= streams <= 10, streams
    lines = lost_lines(capfd.readouterr().err)
    assert len(lines) == 2, lines
    assert "suppressed" not in lines[0]
    assert re.search(r"\((\d+) such line\(s\) suppressed in the last [0-9.]+ s\)$", lines[1])


@pytest.mark.slow
def test_time_in_inference_or_the_learner_queue_does_not_count_as_silence(tmp_path, rpcenv,
                                                                           capfd):
    """A slow but live environment (0.2 s a step), inference slower than the stream timeout,
    and a learner queue that stays full for longer than it: the stream is never cancelled."""

    class SlowLivesEnv(LivesEnv):
        def step(self, action):
            time.sleep(0.2)
            return super().step(action)

    address = f"unix:{tmp_path}/slow.sock"
    server = TorchBeastServer(rpcenv, address, env_factory=SlowLivesEnv)
    pool = Pool(tmp_path, addresses=[address], unroll_length=1, stream_timeout_s=0.6,
                inference_delay_s=0.8, learner_queue_size=1, collecting=False)
    try:
        # One rollout waits in the queue and the actor blocks on the next one.
        deadline = time.monotonic() + WAIT_S
        while pool.learner_queue.size() < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(2.5)  # the second rollout is ready at about 2 s; then the actor waits
        assert pool.pool.count() == 2, "the actor did not wait on the full learner queue"
        pool.collecting.set()
        pool.wait_for(lambda rs: len(rs) >= 3, "3 rollouts")
    finally:
        pool.shutdown()
        server.stop()
    assert len(server.envs) == 1, "the stream was cancelled"
    frames = [rollout["frame"][:, 0, 0].tolist() for rollout, _ in pool.rollouts[:3]]
    assert frames == [[0, 1], [1, 2], [2, 3]]
    assert lost_lines(capfd.readouterr().err) == []


EXIT_DURING_RUN = """
import threading
import time

import libpolybeast


class SlowFinalization:
    '''Holds the GIL for 0.5 s once the interpreter is finalizing: run()'s thread, which takes
    the GIL every 100 ms to check for signals, is then ended with a forced unwind.'''

    def __del__(self, monotonic=time.monotonic):
        end = monotonic() + 0.5
        while monotonic() < end:
            pass


if {kind!r} == "ActorPool":
    run = libpolybeast.ActorPool(
        unroll_length=2, learner_queue=libpolybeast.BatchingQueue(),
        inference_batcher=libpolybeast.DynamicBatcher(), env_server_addresses=[{address!r}],
        initial_agent_state=(), env_keys=["frame"]).run
else:
    run = libpolybeast.EnvServer(dict, {address!r}).run
threading.Thread(target=run, daemon=True).start()
time.sleep(0.3)
slow = SlowFinalization()
"""


@pytest.mark.parametrize("scheme", ["unix", "raw"], ids=["grpc", "raw"])
@pytest.mark.parametrize("kind", ["ActorPool", "EnvServer"])
def test_interpreter_exit_during_run_does_not_abort(tmp_path, kind, scheme):
    """run() in a daemon thread when the interpreter exits: the forced unwind that ends the
    thread as it takes the GIL passes every catch (...) ("FATAL: exception not rethrown"
    otherwise) and the GIL guard of the binding (which would abort taking the GIL again)."""
    import subprocess
    import sys

    code = EXIT_DURING_RUN.format(kind=kind, address=f"{scheme}:{tmp_path}/env.sock")
    result = subprocess.run([sys.executable, "-c", code], cwd=pathlib.Path(__file__).parent.parent,
                            capture_output=True, text=True, timeout=JOIN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert "FATAL" not in result.stderr and "terminate" not in result.stderr, result.stderr
