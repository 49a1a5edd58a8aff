"""libpolybeast.EnvServer, talked to by a Python gRPC client built from csrc/rpcenv.proto: the wire
format, extra named fields, episode boundaries, recovery from an environment that raises (and its
count, Step.env_errors), refusing an address in use, and dropping a client that stops answering
keepalive pings. Also libpolybeast.ActorPool against a Python gRPC server that behaves as
TorchBeast's does (tests/torchbeast_server.py)."""

import math
import os
import queue
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import libpolybeast
from torchbeast_server import (NUMPY_TYPES, PROTO_DIR, LivesEnv, TorchBeastServer, array_of,
                               put_array, rpcenv_modules)

JOIN_TIMEOUT_S = 30
EPISODE_LENGTH = 5


@pytest.fixture(scope="module")
def rpcenv(tmp_path_factory):
    """The Python protobuf/gRPC modules generated from csrc/rpcenv.proto."""
    return rpcenv_modules(tmp_path_factory.mktemp("rpcenv_stubs"))


class CountingEnv:
    """Deterministic adapter: the frame encodes (steps since creation, episode step, env id,
    last action); episodes last EPISODE_LENGTH steps; reward = action / 2. With extras, each
    step also has lives (int32 scalar, 3 + env id) and aux (float32 [2], [steps, action])."""

    def __init__(self, env_id, fail_at_step=None, closed=None, extras=False):
        self.env_id = env_id
        self.fail_at_step = fail_at_step
        self.closed = closed if closed is not None else []
        self.extras = extras
        self.total = 0
        self.episode_step = 0
        self.episode_return = 0.0

    def frame(self, action):
        return np.array([[self.total, self.episode_step], [self.env_id, action]], np.int32)

    def with_extras(self, result, action):
        if self.extras:
            result.update(lives=np.int32(3 + self.env_id),
                          aux=np.array([self.total, action], np.float32))
        return result

    def initial(self):
        return self.with_extras(dict(frame=self.frame(0), reward=0.0, done=True, game_over=False,
                                     episode_return=0.0, episode_step=0, last_action=0), 0)

    def step(self, action):
        self.total += 1
        if self.total == self.fail_at_step:
            raise RuntimeError("the emulator crashed")
        reward = action / 2
        self.episode_step += 1
        self.episode_return += reward
        result = dict(reward=np.float32(reward), episode_return=np.float32(self.episode_return),
                      episode_step=np.int32(self.episode_step), last_action=np.int64(action))
        done = self.episode_step == EPISODE_LENGTH
        if done:
            self.episode_step = 0
            self.episode_return = 0.0
        result.update(frame=self.frame(action), done=np.bool_(done), game_over=np.bool_(done))
        return self.with_extras(result, action)

    def close(self):
        self.closed.append(self.env_id)


class Factory:
    def __init__(self, fail_at_step=None, extras=False):
        self.created = 0
        self.closed = []
        self.fail_at_step = fail_at_step
        self.extras = extras

    def __call__(self):
        self.created += 1
        # Only the first env fails, so that the replacement runs normally.
        fail = self.fail_at_step if self.created == 1 else None
        return CountingEnv(self.created, fail, self.closed, self.extras)


class ServerThread:
    def __init__(self, factory, address, **kwargs):
        self.server = libpolybeast.EnvServer(factory, address, **kwargs)
        self.errors = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.server.run()
        except Exception as error:  # noqa: BLE001 - the test inspects it
            self.errors.append(error)

    def stop(self):
        self.server.stop()
        self.server.stop()  # idempotent
        self.thread.join(JOIN_TIMEOUT_S)
        assert not self.thread.is_alive(), "EnvServer.run() did not return after stop()"
        assert self.errors == []


class Client:
    """One StreamingEnv stream, stepped one action at a time."""

    def __init__(self, rpcenv, address, metadata=None, credentials=None, options=(),
                 ready_timeout_s=JOIN_TIMEOUT_S):
        import grpc

        pb2, pb2_grpc = rpcenv
        self.pb2 = pb2
        options = [("grpc.enable_http_proxy", 0), *options]
        if credentials is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:  # TLS (tests/test_tls.py)
            self.channel = grpc.secure_channel(address, credentials, options=options)
        grpc.channel_ready_future(self.channel).result(timeout=ready_timeout_s)
        self.actions = queue.Queue()
        self.steps = pb2_grpc.RPCEnvServerStub(self.channel).StreamingEnv(self._requests(),
                                                                           metadata=metadata)

    def _requests(self):
        while (action := self.actions.get()) is not None:
            yield action

    def first(self):
        return next(self.steps)

    def step(self, action):
        self.actions.put(self.pb2.Action(action=action))
        return next(self.steps)

    def step_batch(self, actions):
        """Sends int64 actions [N] as nest_action (a batched stream)."""
        request = self.pb2.Action()
        put_array(request.nest_action, np.asarray(actions, np.int64))
        self.actions.put(request)
        return next(self.steps)

    def close(self):
        self.actions.put(None)
        self.channel.close()


def frame_of(step):
    array = step.observation.array
    return np.frombuffer(array.data, NUMPY_TYPES[array.dtype]).reshape(tuple(array.shape))


@pytest.fixture
def address(tmp_path):
    return f"unix:{tmp_path}/env.sock"


def test_steps_decode_and_episodes_end_at_the_right_steps(rpcenv, address):
    factory = Factory()
    server = ServerThread(factory, address)
    client = Client(rpcenv, address)
    try:
        first = client.first()
        assert first.observation.array.dtype == np.dtype(np.int32).num
        assert list(first.observation.array.shape) == [2, 2]
        assert len(first.observation.array.data) == 4 * 4
        assert frame_of(first).tolist() == [[0, 0], [1, 0]]
        assert first.done and first.HasField("game_over") and not first.game_over
        assert first.reward == 0 and first.episode_step == 0 and first.episode_return == 0

        expected_return = 0.0
        for t in range(1, 3 * EPISODE_LENGTH + 1):
            action = t % 3
            step = client.step(action)
            expected_return += action / 2
            episode_step = (t - 1) % EPISODE_LENGTH + 1
            done = episode_step == EPISODE_LENGTH
            assert step.done == done, t
            assert step.game_over == done
            assert step.reward == pytest.approx(action / 2)
            assert step.episode_step == episode_step
            assert step.episode_return == pytest.approx(expected_return)
            # After a done step the frame is the next episode's first.
            assert frame_of(step).tolist() == [[t, 0 if done else episode_step], [1, action]]
            if done:
                expected_return = 0.0
    finally:
        client.close()
        server.stop()
    assert factory.created == 1
    assert factory.closed == [1], "the adapter was not closed when the stream ended"


def test_each_stream_gets_its_own_environment(rpcenv, address):
    factory = Factory()
    server = ServerThread(factory, address)
    clients = [Client(rpcenv, address) for _ in range(2)]
    try:
        ids = sorted(int(frame_of(c.first())[1, 0]) for c in clients)
        assert ids == [1, 2]
        for t in range(1, 4):
            for client in clients:
                assert frame_of(client.step(1))[0, 0] == t
    finally:
        for client in clients:
            client.close()
        server.stop()
    assert sorted(factory.closed) == [1, 2]


def test_environment_that_raises_is_replaced_and_the_stream_goes_on(rpcenv, address, capfd):
    factory = Factory(fail_at_step=3)
    server = ServerThread(factory, address)
    client = Client(rpcenv, address)
    try:
        client.first()
        assert frame_of(client.step(1))[0, 0] == 1
        assert frame_of(client.step(1))[0, 0] == 2
        restarted = client.step(1)  # env 1 raises here; env 2 sends its initial step
        assert restarted.done
        assert frame_of(restarted).tolist() == [[0, 0], [2, 0]]
        assert frame_of(client.step(2)).tolist() == [[1, 1], [2, 2]]
    finally:
        client.close()
        server.stop()
    assert factory.closed[0] == 1 and sorted(factory.closed) == [1, 2]
    assert "the emulator crashed" in capfd.readouterr().err


def fork_and_reap():
    """Forks a child that exits at once and waits for it; kills it and fails the test if it
    has not ended within JOIN_TIMEOUT_S (subprocess.run would wait forever instead, reading
    the pipe of a child that never reaches exec)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return
        time.sleep(0.001)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("a child forked beside a busy stream hung before it could run")


# The slow tier forks ten times as often: a lock copied held shows once in a few hundred forks.
@pytest.mark.parametrize("forks", [300, pytest.param(3000, marks=pytest.mark.slow)])
def test_forks_beside_a_grpcio_stream_leave_grpc_alone(rpcenv, address, capfd, forks):
    """Later tests fork in this process (MonoBeast's actors, ffmpeg) after grpcio has run:
    with gRPC's fork support on, every fork runs its handlers ("skipping fork() handlers",
    and now and then pollers whose descriptors were closed under them). tests/conftest.py
    turns it off; here a fork while a stream is busy must not touch gRPC. Nor may it copy
    a lock that the server's stream thread holds: each child must get to run (EnvServer's
    Session keeps its thread's Python state; making one per call hung a child once in a few
    hundred forks)."""
    server = ServerThread(Factory(), address)
    client = Client(rpcenv, address)
    busy = threading.Event()
    stop = threading.Event()

    def step_until_stopped():
        client.first()
        while not stop.is_set():
            client.step(1)
            busy.set()

    stepper = threading.Thread(target=step_until_stopped, daemon=True)
    stepper.start()
    try:
        assert busy.wait(JOIN_TIMEOUT_S)
        capfd.readouterr()
        for _ in range(forks):
            fork_and_reap()
    finally:
        stop.set()
        stepper.join(JOIN_TIMEOUT_S)
        client.close()
        server.stop()
    err = capfd.readouterr().err
    assert "fork" not in err and "Bad file descriptor" not in err, err


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_tcp_address(rpcenv):
    address = f"127.0.0.1:{free_port()}"
    server = ServerThread(Factory(), address)
    client = Client(rpcenv, address)
    try:
        assert frame_of(client.first()).tolist() == [[0, 0], [1, 0]]
        assert frame_of(client.step(2)).tolist() == [[1, 1], [1, 2]]
    finally:
        client.close()
        server.stop()


def test_stop_before_run_and_bad_address(tmp_path, capfd):
    """A socket in a directory that does not exist is refused with one message, before
    gRPC tries (and logs its own error)."""
    server = libpolybeast.EnvServer(Factory(), f"unix:{tmp_path}/early.sock")
    server.stop()
    server.run()  # returns at once
    bad = libpolybeast.EnvServer(Factory(), f"unix:{tmp_path}/no/such/dir/env.sock")
    with pytest.raises(RuntimeError, match=f"could not listen on 'unix:{tmp_path}/no/such/dir/"
                                           f"env.sock': the directory {tmp_path}/no/such/dir "
                                           "does not exist"):
        bad.run(on_listening=lambda: pytest.fail("it did not listen"))
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("scheme", ["unix:", "raw:"])
def test_on_listening_is_called_once_the_server_listens(tmp_path, scheme):
    """run(on_listening) says when the address is bound (what polybeast_env waits for
    before it says it serves); if on_listening raises, the server stops and run() raises it."""
    address = f"{scheme}{tmp_path}/env.sock"
    server = libpolybeast.EnvServer(Factory(), address)
    listened = []

    def on_listening():
        listened.append(os.path.exists(tmp_path / "env.sock"))
        server.stop()

    server.run(on_listening=on_listening)
    assert listened == [True]

    def refuse():
        raise KeyError("no thanks")

    with pytest.raises(KeyError, match="no thanks"):
        libpolybeast.EnvServer(Factory(), address).run(on_listening=refuse)
    with socket.socket(socket.AF_UNIX) as probe:
        assert probe.connect_ex(str(tmp_path / "env.sock")) != 0, "it still listens"


def test_stop_ends_open_streams(rpcenv, address):
    server = ServerThread(Factory(), address)
    client = Client(rpcenv, address)
    client.first()
    server.stop()  # the client never ends its stream; run() must return all the same
    client.close()


@pytest.mark.slow
def test_polybeast_env_serves_and_stops_cleanly_on_sigterm(rpcenv, tmp_path):
    import signal
    import subprocess

    base = f"unix:{tmp_path}/pb"
    process = subprocess.Popen(
        [sys.executable, "-m", "polybeast_env", "--env", "CartPole-v1", "--num_servers", "2",
         "--pipes_basename", base, "--seed", "3"],
        cwd=PROTO_DIR.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # It says it serves once every server listens, not before.
        serving = process.stdout.readline()
        assert serving.startswith("polybeast_env: serving CartPole-v1"), serving
        assert (tmp_path / "pb.0").exists() and (tmp_path / "pb.1").exists()
        for i in range(2):
            client = Client(rpcenv, f"{base}.{i}")
            first = client.first()
            assert first.done and not first.game_over
            assert first.observation.array.dtype == np.dtype(np.float32).num
            assert list(first.observation.array.shape) == [4]
            step = client.step(1)
            assert step.reward == 1.0 and step.episode_step == 1 and not step.done
            client.close()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=JOIN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=JOIN_TIMEOUT_S)
    assert process.returncode == 0, err
    assert "serving" not in out  # said once
    assert not (tmp_path / "pb.0").exists() and not (tmp_path / "pb.1").exists()


def test_polybeast_env_addresses():
    import polybeast_env

    flags = polybeast_env.make_parser().parse_args(["--num_servers", "3"])
    assert polybeast_env.server_addresses(flags) == [
        "unix:/tmp/polybeast.0", "unix:/tmp/polybeast.1", "unix:/tmp/polybeast.2"]
    flags = polybeast_env.make_parser().parse_args(["--num_servers", "2",
                                                     "--address", "tcp:0.0.0.0:4000"])
    assert polybeast_env.server_addresses(flags) == ["0.0.0.0:4000", "0.0.0.0:4001"]
    assert not polybeast_env.is_loopback("0.0.0.0:4000")
    assert polybeast_env.is_loopback("127.0.0.1:4000")
    assert polybeast_env.is_loopback("[::1]:4000")
    assert polybeast_env.is_loopback("localhost:4000")
    assert polybeast_env.is_loopback("unix:/tmp/x")
    with pytest.raises(ValueError):
        polybeast_env.server_address(
            polybeast_env.make_parser().parse_args(["--address", "nohost"]), 0)
    long_basename = "raw:/tmp/" + "d" * 100  # fits; with ".10" it does not
    flags = polybeast_env.make_parser().parse_args(["--num_servers", "11",
                                                     "--pipes_basename", long_basename])
    assert polybeast_env.server_address(flags, 9) == long_basename + ".9"
    with pytest.raises(ValueError, match="--pipes_basename: the socket path .* is 108 bytes"):
        polybeast_env.server_addresses(flags)


def batch_of(step):
    """Step.batch (a stream of several environments) as {name: array [N, ...]}."""
    return {key: array_of(nest.array) for key, nest in step.batch.map.items()}


def test_batched_stream_wire_format(rpcenv, address):
    """polybeast_env --envs_per_stream 3: one Step.batch of [3, ...] arrays per step, int64
    actions [3] in, and the same environments a VectorEnv with that seed steps."""
    import argparse

    import polybeast_env
    from beast import vector_envs

    flags = polybeast_env.make_parser().parse_args(
        ["--env", "CartPole-v1", "--envs_per_stream", "3", "--seed", "5"])
    factory = polybeast_env.EnvFactory(flags, server_index=1)
    server = ServerThread(factory, address)
    client = Client(rpcenv, address)
    # The reference: the first stream's VectorEnv, built the way EnvFactory builds it.
    seed = int(np.random.SeedSequence([5, 1, 0]).generate_state(1)[0]) % 2**31
    reference = vector_envs.create_vector_env(
        argparse.Namespace(env="CartPole-v1", env_backend="gymnasium", episodic_life=False),
        3, seed)
    try:
        first = client.first()
        assert not first.HasField("observation") and first.HasField("batch")
        batch = batch_of(first)
        assert sorted(batch) == sorted(f.name for f in reference.fields)
        assert first.HasField("env_errors") and first.env_errors == 0
        assert batch["frame"].shape == (3, 4) and batch["frame"].dtype == np.float32
        assert batch["done"].tolist() == [True] * 3
        expected = reference.initial()
        np.testing.assert_array_equal(batch["frame"], expected["frame"])
        rng = np.random.default_rng(0)
        for _ in range(60):
            actions = rng.integers(0, 2, 3)
            request = client.pb2.Action()
            request.nest_action.array.dtype = np.dtype(np.int64).num
            request.nest_action.array.shape.append(3)
            request.nest_action.array.data = actions.astype(np.int64).tobytes()
            client.actions.put(request)
            batch = batch_of(next(client.steps))
            expected = reference.step(actions)
            for key in expected:
                np.testing.assert_array_equal(batch[key], expected[key], err_msg=key)
            assert batch["last_action"].tolist() == actions.tolist()
    finally:
        client.close()
        server.stop()
        reference.close()


def extras_of(step):
    """Step.extras as {name: array}."""
    return {key: array_of(nest.array) for key, nest in step.extras.map.items()}


def test_extra_keys_travel_in_extras_and_env_errors_counts_restarts(rpcenv, address):
    """Keys of the adapter's dict without a fixed Step field arrive in Step.extras under their
    names (last_action does not: the actor knows it); env_errors counts the restarts."""
    factory = Factory(fail_at_step=3, extras=True)
    server = ServerThread(factory, address)
    client = Client(rpcenv, address)
    try:
        first = client.first()
        extras = extras_of(first)
        assert sorted(extras) == ["aux", "lives"]
        assert extras["lives"].dtype == np.int32 and extras["lives"].shape == ()
        assert extras["lives"] == 4
        assert extras["aux"].dtype == np.float32 and extras["aux"].tolist() == [0, 0]
        assert first.HasField("env_errors") and first.env_errors == 0
        step = client.step(2)
        assert extras_of(step)["aux"].tolist() == [1, 2] and step.env_errors == 0
        assert client.step(1).env_errors == 0
        restarted = client.step(1)  # env 1 raises; env 2 sends its initial step
        assert restarted.done and restarted.env_errors == 1
        assert extras_of(restarted)["lives"] == 5
        for t in range(1, 4):
            step = client.step(2)
            assert step.env_errors == 1, "a restart was counted twice"
            assert extras_of(step)["aux"].tolist() == [t, 2]
    finally:
        client.close()
        server.stop()


class RestartingVectorEnv:
    """A batched adapter that restarts one of its environments itself at its step 2 (counted
    in `restarts`, as beast.vector_envs.GymnasiumVectorEnv does) and raises at step 4 if
    told to."""

    num_envs = 2

    def __init__(self, fails):
        self.fails = fails
        self.steps = 0
        self.restarts = 0

    def initial(self):
        return dict(frame=np.zeros((2, 1), np.float32), steps=np.full(2, self.steps))

    def step(self, actions):
        self.steps += 1
        if self.steps == 2:
            self.restarts += 1
        if self.steps == 4 and self.fails:
            raise RuntimeError("the vector env crashed")
        return self.initial()


def test_batched_env_errors_add_the_adapters_own_restarts(rpcenv, address):
    """env_errors = adapters replaced after raising + the restarts they counted themselves,
    never going down when a replacement starts counting from 0."""
    adapters = []

    def factory():
        adapters.append(RestartingVectorEnv(fails=not adapters))
        return adapters[-1]

    server = ServerThread(factory, address)
    client = Client(rpcenv, address)
    try:
        first = client.first()
        assert first.HasField("batch") and first.env_errors == 0
        # Steps 1-3 of adapter 1; step 4 raises (1 + its own 1), then adapter 2's steps 1-3.
        errors = [client.step_batch([0, 1]).env_errors for _ in range(7)]
        assert errors == [0, 1, 1, 2, 2, 3, 3]
    finally:
        client.close()
        server.stop()
    assert len(adapters) == 2


# ActorPool against a server that behaves as TorchBeast's does (tests/torchbeast_server.py).

ENV_KEYS = ("frame", "reward", "done", "game_over", "episode_return", "episode_step",
            "last_action")


def run_pool_against(server_address, unroll_length, num_rollouts, connect_timeout_s=10.0,
                     envs_per_stream=0, stream_timeout_s=30.0, tls=None, env_keys=ENV_KEYS,
                     choose=None):
    """Runs an ActorPool (action = frame[0] % 3, or choose(env_outputs)) on one server until
    num_rollouts arrive, or run() fails. Returns (rollouts, pool, the error run() raised or
    None). tls: the pool's (test_tls.py)."""
    learner_queue = libpolybeast.BatchingQueue(batch_dim=1, maximum_batch_size=1,
                                               maximum_queue_size=num_rollouts)
    batcher = libpolybeast.DynamicBatcher(batch_dim=1, timeout_ms=5)
    pool = libpolybeast.ActorPool(
        unroll_length=unroll_length, learner_queue=learner_queue, inference_batcher=batcher,
        env_server_addresses=[server_address], initial_agent_state=(), env_keys=env_keys,
        connect_timeout_s=connect_timeout_s, envs_per_stream=envs_per_stream,
        stream_timeout_s=stream_timeout_s, tls=tls)
    run_errors = []

    def inference():
        for batch in batcher:
            env_outputs, state = batch.get_inputs()
            if choose is None:
                action = env_outputs["frame"][..., 0].astype(np.int64) % 3
            else:
                action = choose(env_outputs)
            batch.set_outputs((dict(action=action), state))

    def run():
        try:
            pool.run()
        except Exception as error:  # noqa: BLE001 - returned to the test
            run_errors.append(error)

    threads = [threading.Thread(target=f, daemon=True) for f in (inference, run)]
    for thread in threads:
        thread.start()
    rollouts = []
    try:
        for rollout, _ in learner_queue:  # ends when run() fails and closes the queue
            rollouts.append(rollout)
            if len(rollouts) == num_rollouts:
                break
    finally:
        learner_queue.close()
        batcher.close()
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
            assert not thread.is_alive()
    return rollouts, pool, run_errors[0] if run_errors else None


@pytest.mark.parametrize("envs_per_stream", [0, 32], ids=["asks_nothing", "asks_32"])
def test_actor_pool_trains_through_a_torchbeast_server(rpcenv, address, envs_per_stream):
    """TorchBeast's server reads only nest_action (int() of a numpy array), sends no
    game_over, extras or env_errors, and ends an episode at each of 3 lost lives (7 steps
    each): the rollouts carry game_over == done, the episode counters TorchBeast sends, and
    the actions the inference chose, as the env saw them. It ignores the envs-per-stream
    metadata: a pool that asks for 32 environments still gets one, in TorchBeast's format."""
    server = TorchBeastServer(rpcenv, address)
    unroll_length, num_rollouts = 5, 10  # 50 steps: more than two games of 21
    try:
        rollouts, pool, error = run_pool_against(address, unroll_length, num_rollouts,
                                                 envs_per_stream=envs_per_stream)
    finally:
        server.stop()
    assert error is None, error
    assert len(rollouts) == num_rollouts
    assert pool.env_errors() == 0
    assert len(server.envs) == 1, "the stream was broken and reconnected"
    T, L = unroll_length, LivesEnv.LIFE_STEPS
    for k, rollout in enumerate(rollouts):
        assert sorted(rollout) == sorted(ENV_KEYS + ("action", "truncated"))
        # TorchBeast's server never sends it: a time limit stays the episode's end.
        assert not rollout["truncated"].any()
        assert rollout["frame"].shape == (T + 1, 1, 4) and rollout["frame"].dtype == np.int64
        t = np.arange(T * k, T * k + T + 1)  # the env's step count at each rollout step
        frame = rollout["frame"][:, 0]
        np.testing.assert_array_equal(frame[:, 0], t)
        done = t % L == 0
        np.testing.assert_array_equal(rollout["done"][:, 0], done)
        np.testing.assert_array_equal(rollout["game_over"], rollout["done"])
        # Lives and games go on across the end-of-life episodes.
        np.testing.assert_array_equal(frame[:, 1], t // (LivesEnv.LIVES * L))
        np.testing.assert_array_equal(frame[:, 2], LivesEnv.LIVES - (t // L) % LivesEnv.LIVES)
        np.testing.assert_array_equal(frame[:, 3], t % L)  # a done step shows reset()'s frame
        # obs[t] -> action[t] -> reward[t+1], last_action[t+1]; counters reset at each done.
        action = rollout["action"][:, 0]
        np.testing.assert_array_equal(action, t % 3)
        np.testing.assert_array_equal(rollout["last_action"][1:, 0], action[:-1])
        np.testing.assert_array_equal(rollout["reward"][1:, 0], action[:-1] + 1)
        episode_step = np.where(t == 0, 0, (t - 1) % L + 1)
        np.testing.assert_array_equal(rollout["episode_step"][:, 0], episode_step)
        expected_return = [sum((u - 1) % 3 + 1 for u in range(s - n + 1, s + 1))
                           for s, n in zip(t, episode_step)]
        np.testing.assert_array_equal(rollout["episode_return"][:, 0], expected_return)
    # What the environment got: 0-d int64 arrays, the actions the inference chose.
    received = server.envs[0].received
    assert len(received) >= num_rollouts * T
    for t, action in enumerate(received[:num_rollouts * T]):
        assert isinstance(action, np.ndarray) and action.shape == () and action.dtype == np.int64
        assert int(action) == t % 3


class FlatCountingEnv(CountingEnv):
    """A CountingEnv whose frame is flat, [steps, episode step, env id, action], as the
    inference of run_pool_against expects."""

    def frame(self, action):
        return super().frame(action).reshape(-1)


class RecordingFactory:
    """Records the arguments of each call: () when the server called it without one, (N,)
    when the client asked for N environments per stream. Returns one environment either way
    (a server may answer with another number than the one asked for)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)
        return FlatCountingEnv(len(self.calls))


@pytest.mark.parametrize("envs_per_stream", [0, 1, 7, 4096], ids=lambda n: f"asks_{n}")
def test_the_factory_gets_the_envs_per_stream_the_actor_pool_asks_for(address, envs_per_stream):
    """ActorPool(envs_per_stream=N) sends N as metadata and the server calls env_factory(N);
    a pool created without it (0, as TorchBeast's actors) asks nothing: env_factory()."""
    factory = RecordingFactory()
    server = ServerThread(factory, address)
    try:
        rollouts, _, error = run_pool_against(address, 5, 2, envs_per_stream=envs_per_stream)
    finally:
        server.stop()
    assert error is None, error
    assert len(rollouts) == 2
    assert factory.calls == [(envs_per_stream,) if envs_per_stream else ()]


@pytest.mark.parametrize("value", ["0", "4097", "-1", "abc", "3.5", "", " 32",
                                   "99999999999999999999"])
def test_a_bad_envs_per_stream_request_is_refused_with_invalid_argument(rpcenv, address, value):
    """Not an integer in [1, MAX_ENVS_PER_STREAM]: the stream ends with INVALID_ARGUMENT and a
    message, the factory is never called, and the server goes on serving good requests."""
    import grpc

    assert libpolybeast.MAX_ENVS_PER_STREAM == 4096
    factory = RecordingFactory()
    server = ServerThread(factory, address)
    try:
        bad = Client(rpcenv, address, metadata=[("envs-per-stream", value)])
        with pytest.raises(grpc.RpcError) as error:
            bad.first()
        bad.close()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "envs-per-stream" in error.value.details()
        assert "[1, 4096]" in error.value.details()
        assert factory.calls == []
        good = Client(rpcenv, address, metadata=[("envs-per-stream", "3")])
        assert good.first().done
        good.close()
    finally:
        server.stop()
    assert factory.calls == [(3,)]


def test_actor_pool_refuses_an_envs_per_stream_out_of_range():
    learner_queue = libpolybeast.BatchingQueue()
    batcher = libpolybeast.DynamicBatcher()
    for bad in (-1, libpolybeast.MAX_ENVS_PER_STREAM + 1):
        with pytest.raises(ValueError, match="envs_per_stream"):
            libpolybeast.ActorPool(
                unroll_length=5, learner_queue=learner_queue, inference_batcher=batcher,
                env_server_addresses=["unix:/nonexistent"], initial_agent_state=(),
                env_keys=ENV_KEYS, envs_per_stream=bad)


def test_torchbeast_server_refuses_an_action_without_nest_action(rpcenv, address):
    """The check above is only as good as this server's strictness: an Action with only the
    `action` field (what our actors sent before) ends its stream with UNKNOWN."""
    import grpc

    server = TorchBeastServer(rpcenv, address)
    client = Client(rpcenv, address)
    try:
        first = client.first()
        assert first.done and not first.HasField("game_over")
        assert not first.HasField("env_errors") and not first.HasField("extras")
        with pytest.raises(grpc.RpcError) as error:
            client.step(1)
        assert error.value.code() == grpc.StatusCode.UNKNOWN
    finally:
        client.close()
        server.stop()


class ClashingExtrasServer(TorchBeastServer):
    """A server that adds Step.extras['reward'], which clashes with Step.reward."""

    def step_proto(self, *args):
        step = super().step_proto(*args)
        put_array(step.extras.map["reward"], np.float32(1))
        return step


def test_actor_pool_refuses_an_extra_that_clashes_with_a_step_field(rpcenv, address):
    server = ClashingExtrasServer(rpcenv, address)
    try:
        rollouts, _, error = run_pool_against(address, unroll_length=3, num_rollouts=1)
    finally:
        server.stop()
    assert rollouts == []
    assert isinstance(error, RuntimeError)
    assert "env.sock" in str(error) and "extras entry 'reward' clashes" in str(error)


# Servers from before a field, and servers that send what no learner should take.

def alternate(env_outputs):
    """CartPole's actions 0, 1, 0, ... by episode step."""
    return (env_outputs["episode_step"] % 2).astype(np.int64)


def test_actor_pool_takes_batched_steps_without_truncated_or_game_over(rpcenv, address):
    """A batched server from before the truncated and game_over fields
    (tests/old_batched_server.py) serves today's learner: as in the single-environment
    format, a step without truncated was not cut short, and one without game_over ends the
    game at done."""
    from old_batched_server import OldBatchedServer

    server = OldBatchedServer(rpcenv, address, num_envs=3)
    try:
        rollouts, _, error = run_pool_against(
            address, unroll_length=20, num_rollouts=30, envs_per_stream=3,
            env_keys=ENV_KEYS + ("truncated",), choose=alternate)
    finally:
        server.stop()
    assert error is None, error
    assert len(rollouts) == 30
    for rollout in rollouts:
        assert rollout["truncated"].dtype == np.bool_ and rollout["truncated"].shape == (21, 1)
        assert not rollout["truncated"].any()
        assert rollout["game_over"].dtype == np.bool_
        assert (rollout["game_over"] == rollout["done"]).all()
    assert sum(int(r["done"][1:].sum()) for r in rollouts) > 0  # episodes did end


class NaNRewardLives(LivesEnv):
    """TorchBeast's single-environment format, with a NaN reward at the 3rd step."""

    def step(self, action):
        observation, reward, done, info = super().step(action)
        return observation, (math.nan if self.total == 3 else reward), done, info


@pytest.mark.parametrize("case", ["single-reward", "batched-reward", "batched-return"])
def test_actor_pool_refuses_a_step_with_nan_naming_the_server_and_the_field(rpcenv, address,
                                                                           case):
    """A NaN reward would make NaN logits (the model takes the reward) and a NaN
    episode_return a NaN mean return: the first one ends the run with BadStep, naming the
    server, the field and the environment of the stream."""
    from old_batched_server import OldBatchedServer

    if case == "single-reward":
        server = TorchBeastServer(rpcenv, address, env_factory=NaNRewardLives)
        field, where = "reward", "environment 0 of 1"
    else:
        server = OldBatchedServer(rpcenv, address, num_envs=3,
                                  fault="nan-reward" if case == "batched-reward" else "nan-return")
        field = "reward" if case == "batched-reward" else "episode_return"
        where = "environment 2 of 3"
    try:
        rollouts, _, error = run_pool_against(address, unroll_length=5, num_rollouts=10,
                                              envs_per_stream=3, choose=alternate)
    finally:
        server.stop()
    assert rollouts == []
    assert isinstance(error, libpolybeast.BadStep) and isinstance(error, RuntimeError)
    message = str(error)
    assert address in message and f"sent a '{field}' with NaN or inf" in message, message
    assert f"({where} on the stream: nan)" in message, message


# An address in use is refused, and the server already there keeps serving.

@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_second_server_on_an_address_in_use_is_refused(rpcenv, tmp_path, kind):
    address = (f"127.0.0.1:{free_port()}" if kind == "tcp" else f"unix:{tmp_path}/env.sock")
    first = ServerThread(Factory(), address)
    client = Client(rpcenv, address)
    try:
        assert frame_of(client.first()).tolist() == [[0, 0], [1, 0]]
        second = ServerThread(Factory(), address)
        second.thread.join(JOIN_TIMEOUT_S)
        if second.thread.is_alive():
            second.server.stop()
            second.thread.join(JOIN_TIMEOUT_S)
            pytest.fail("a second server listened on an address in use")
        message = (f"address in use: {address}; another env server listens there? stop it or "
                   "pick another address")
        assert len(second.errors) == 1 and message in str(second.errors[0]), second.errors
        # The first server still answers the stream it had, and new ones.
        assert frame_of(client.step(2)).tolist() == [[1, 1], [1, 2]]
        other = Client(rpcenv, address)
        try:
            assert frame_of(other.first()).tolist() == [[0, 0], [2, 0]]
            assert frame_of(other.step(1)).tolist() == [[1, 1], [2, 1]]
        finally:
            other.close()
    finally:
        client.close()
        first.stop()


def test_stale_unix_socket_is_replaced(rpcenv, tmp_path):
    """A socket file that nobody listens on (a server killed with SIGKILL) is taken over."""
    path = tmp_path / "env.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays; nobody listens
    assert path.exists()
    address = f"unix:{path}"
    server = ServerThread(Factory(), address)
    client = Client(rpcenv, address)
    try:
        assert frame_of(client.first()).tolist() == [[0, 0], [1, 0]]
    finally:
        client.close()
        server.stop()


class BlackHoleProxy:
    """A TCP proxy on 127.0.0.1 that forwards both ways until cut(), then swallows every byte
    and closes nothing: a client that dropped off the network without a FIN or RST."""

    def __init__(self, target_port):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut_off = threading.Event()
        self.sockets = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = self._connect_upstream()
            self.sockets += [downstream, upstream]
            for source, sink in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _connect_upstream(self):
        """A connection to the target; the server's thread may not be listening yet when the
        client's first connection comes, so a refusal is tried again until JOIN_TIMEOUT_S."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            try:
                return socket.create_connection(("127.0.0.1", self.target_port))
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _pump(self, source, sink):
        try:
            while data := source.recv(65536):
                if not self.cut_off.is_set():
                    sink.sendall(data)
        except OSError:
            pass

    def cut(self):
        self.cut_off.set()

    def close(self):
        self.listener.close()
        for sock in self.sockets:
            sock.close()


@pytest.mark.slow
def test_a_client_that_drops_off_the_network_is_dropped(rpcenv):
    """Keepalive: a client that answers pings may take its time; one that stops answering is
    dropped within about 2 * keepalive_s, and its environment closed."""
    import time

    factory = Factory()
    port = free_port()
    server = ServerThread(factory, f"127.0.0.1:{port}", keepalive_s=0.3)
    proxy = BlackHoleProxy(port)
    client = Client(rpcenv, f"127.0.0.1:{proxy.port}")
    try:
        client.first()
        time.sleep(1.5)  # a live client, idle for 5 keepalive periods, is waited for
        assert factory.closed == []
        assert frame_of(client.step(1))[0, 0] == 1
        proxy.cut()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while factory.closed == [] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert factory.closed == [1], "the stream of a silent peer was not ended"
    finally:
        proxy.close()
        client.close()
        server.stop()


@pytest.mark.slow
def test_polybeast_env_refuses_an_address_in_use_and_leaves_the_first_server_alone(tmp_path):
    """A second `python -m polybeast_env` on the same unix socket exits with the message, and
    the first server's socket stays there (it used to be removed on the way out)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [sys.executable, "-m", "polybeast_env", "--env", "CartPole-v1", "--num_servers", "1",
            "--pipes_basename", f"unix:{tmp_path}/env"]
    first = subprocess.Popen(args, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(tmp_path / "env.0") and time.monotonic() < deadline:
            time.sleep(0.05)
        second = subprocess.run(args, cwd=repo, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "address in use" in second.stderr
        assert os.path.exists(tmp_path / "env.0") and first.poll() is None
    finally:
        first.terminate()
        first.wait(30)


@pytest.mark.slow  # a polybeast_env process each
@pytest.mark.parametrize("case", ["no-directory", "unix-in-use", "tcp-in-use"])
def test_polybeast_env_that_cannot_listen_says_why_in_one_line(tmp_path, case):
    """A socket directory that does not exist, or an address where another server listens:
    polybeast_env exits 2 with one line that names the address and what to change, without
    saying first that it serves there, and without gRPC's log."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if case == "no-directory":
        where = ["--pipes_basename", f"unix:{tmp_path}/missing/env"]
        message = (f"cannot listen at unix:{tmp_path}/missing/env.0: the directory "
                   f"{tmp_path}/missing does not exist; create it or pick another "
                   "--pipes_basename.")
        taken = None
    elif case == "unix-in-use":
        where = ["--pipes_basename", f"unix:{tmp_path}/env"]
        message = (f"address in use: unix:{tmp_path}/env.0; another env server listens there? "
                   "stop it or pick another --pipes_basename.")
        taken = ServerThread(Factory(), f"unix:{tmp_path}/env.0")
    else:
        port = free_port()
        where = ["--address", f"127.0.0.1:{port}"]
        message = (f"address in use: 127.0.0.1:{port}; another env server listens there? stop "
                   "it or pick another --address.")
        taken = ServerThread(Factory(), f"127.0.0.1:{port}")
    try:
        if taken is not None:
            wait_until = time.monotonic() + JOIN_TIMEOUT_S
            target = f"{tmp_path}/env.0" if case == "unix-in-use" else ("127.0.0.1", port)
            family = socket.AF_UNIX if case == "unix-in-use" else socket.AF_INET
            while time.monotonic() < wait_until:
                with socket.socket(family) as probe:
                    if probe.connect_ex(target) == 0:
                        break
                time.sleep(0.05)
        result = subprocess.run(
            [sys.executable, "-m", "polybeast_env", "--env", "CartPole-v1", "--num_servers",
             "2", *where], cwd=repo, capture_output=True, text=True, timeout=60)
    finally:
        if taken is not None:
            taken.stop()
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"polybeast_env: error: {message}\n"
    assert "serving" not in result.stdout


def test_watched_adapter_marks_its_steps_in_a_shared_slot():
    """polybeast_env times every step of a stream's adapter in a slot of a shared array, so
    that it can tell a hung environment from outside the server process."""
    import time

    import polybeast_env

    class Slow:
        num_envs = 2  # the server asks for it: a batched adapter
        closed = False

        def __init__(self, slots):
            self.slots, self.seen = slots, []

        def initial(self):
            return "first"

        def step(self, action):
            self.seen.append(list(self.slots))  # what polybeast_env sees during the step
            return action * 2

        def close(self):
            self.closed = True

    slots = [0.0, 0.0]
    free = [1, 0]
    env = Slow(slots)
    watched = polybeast_env.Watched(env, slots, free)
    assert watched.slot == 0 and free == [1]
    before = time.monotonic()
    assert watched.initial() == "first" and watched.step(21) == 42
    assert before <= env.seen[0][0] <= time.monotonic() and env.seen[0][1] == 0.0
    assert slots == [0.0, 0.0], "no step in progress after it returned"
    assert watched.num_envs == 2 and hasattr(watched, "num_envs")
    assert not hasattr(polybeast_env.Watched(object(), [0.0], [0]), "num_envs")
    watched.close()
    assert env.closed and sorted(free) == [0, 1], "a closed stream gives its slot back"
