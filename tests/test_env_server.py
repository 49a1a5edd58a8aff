"""libpolybeast.EnvServer, talked to by a Python gRPC client built from csrc/rpcenv.proto: the wire
format, episode boundaries, and recovery from an environment that raises."""

import importlib
import pathlib
import queue
import sys
import threading

import numpy as np
import pytest

import libpolybeast

PROTO_DIR = pathlib.Path(__file__).resolve().parent.parent / "csrc"
JOIN_TIMEOUT_S = 30
EPISODE_LENGTH = 5
NUMPY_TYPES = {np.dtype(t).num: np.dtype(t) for t in
               (np.bool_, np.uint8, np.int16, np.int32, np.int64, np.float32, np.float64)}


@pytest.fixture(scope="module")
def rpcenv(tmp_path_factory):
    """The Python protobuf/gRPC modules generated from csrc/rpcenv.proto."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("rpcenv_stubs")
    status = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={out}",
                          f"--grpc_python_out={out}", str(PROTO_DIR / "rpcenv.proto")])
    assert status == 0, "grpc_tools.protoc failed on csrc/rpcenv.proto"
    sys.path.insert(0, str(out))
    try:
        pb2 = importlib.import_module("rpcenv_pb2")
        pb2_grpc = importlib.import_module("rpcenv_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    return pb2, pb2_grpc


class CountingEnv:
    """Deterministic adapter: the frame encodes (steps since creation, episode step, env id,
    last action); episodes last EPISODE_LENGTH steps; reward = action / 2."""

    def __init__(self, env_id, fail_at_step=None, closed=None):
        self.env_id = env_id
        self.fail_at_step = fail_at_step
        self.closed = closed if closed is not None else []
        self.total = 0
        self.episode_step = 0
        self.episode_return = 0.0

    def frame(self, action):
        return np.array([[self.total, self.episode_step], [self.env_id, action]], np.int32)

    def initial(self):
        return dict(frame=self.frame(0), reward=0.0, done=True, game_over=False,
                    episode_return=0.0, episode_step=0, last_action=0)

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
        return result

    def close(self):
        self.closed.append(self.env_id)


class Factory:
    def __init__(self, fail_at_step=None):
        self.created = 0
        self.closed = []
        self.fail_at_step = fail_at_step

    def __call__(self):
        self.created += 1
        # Only the first env fails, so that the replacement runs normally.
        fail = self.fail_at_step if self.created == 1 else None
        return CountingEnv(self.created, fail, self.closed)


class ServerThread:
    def __init__(self, factory, address):
        self.server = libpolybeast.EnvServer(factory, address)
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

    def __init__(self, rpcenv, address):
        import grpc

        pb2, pb2_grpc = rpcenv
        self.pb2 = pb2
        self.channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
        grpc.channel_ready_future(self.channel).result(timeout=JOIN_TIMEOUT_S)
        self.actions = queue.Queue()
        self.steps = pb2_grpc.RPCEnvServerStub(self.channel).StreamingEnv(self._requests())

    def _requests(self):
        while (action := self.actions.get()) is not None:
            yield action

    def first(self):
        return next(self.steps)

    def step(self, action):
        self.actions.put(self.pb2.Action(action=action))
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


def test_tcp_address(rpcenv):
    import socket

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    server = ServerThread(Factory(), address)
    client = Client(rpcenv, address)
    try:
        assert frame_of(client.first()).tolist() == [[0, 0], [1, 0]]
        assert frame_of(client.step(2)).tolist() == [[1, 1], [1, 2]]
    finally:
        client.close()
        server.stop()


def test_stop_before_run_and_bad_address(tmp_path):
    server = libpolybeast.EnvServer(Factory(), f"unix:{tmp_path}/early.sock")
    server.stop()
    server.run()  # returns at once
    bad = libpolybeast.EnvServer(Factory(), f"unix:{tmp_path}/no/such/dir/env.sock")
    with pytest.raises(RuntimeError, match="could not listen"):
        bad.run()


def test_stop_ends_open_streams(rpcenv, address):
    server = ServerThread(Factory(), address)
    client = Client(rpcenv, address)
    client.first()
    server.stop()  # the client never ends its stream; run() must return all the same
    client.close()


def test_polybeast_env_serves_and_stops_cleanly_on_sigterm(rpcenv, tmp_path):
    import signal
    import subprocess

    base = f"unix:{tmp_path}/pb"
    process = subprocess.Popen(
        [sys.executable, "-m", "polybeast_env", "--env", "CartPole-v1", "--num_servers", "2",
         "--pipes_basename", base, "--seed", "3"],
        cwd=PROTO_DIR.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
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
    assert "serving CartPole-v1" in out
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


def array_of(proto):
    return np.frombuffer(proto.data, NUMPY_TYPES[proto.dtype]).reshape(tuple(proto.shape))


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
    seed = int(np.random.SeedSequence([5, 1, 0]).generate_state(1)[0]) % 2**40
    reference = vector_envs.create_vector_env(
        argparse.Namespace(env="CartPole-v1", env_backend="gymnasium", episodic_life=False),
        3, seed)
    try:
        first = client.first()
        assert not first.HasField("observation") and first.HasField("batch")
        batch = batch_of(first)
        assert sorted(batch) == sorted(["frame", *vector_envs.SCALAR_FIELDS])
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
