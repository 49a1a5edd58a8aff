"""The raw: transport (csrc/raw_socket.h): rpcenv.proto's Step and Action messages framed by
hand on a unix socket, without gRPC. Both ends are tested against a Python implementation of
the framing written from the header's description: a client for libpolybeast.EnvServer and a
server for libpolybeast.ActorPool. Also: refusals, stop(), an address in use, a stale socket
file, a silent server and a server's error message."""

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import libpolybeast
import test_env_server
from test_env_server import ENV_KEYS, run_pool_against
from torchbeast_server import LivesEnv, array_of, put_array, rpcenv_modules

JOIN_TIMEOUT_S = 30
HEADER = struct.Struct("=IB3x")  # payload length, kind, padding; host byte order
MESSAGE, HELLO, ERROR = 0, 1, 2


@pytest.fixture(scope="module")
def pb2(tmp_path_factory):
    return rpcenv_modules(tmp_path_factory.mktemp("rpcenv_stubs"))[0]


def send_frame(sock, kind, payload=b""):
    sock.sendall(HEADER.pack(len(payload), kind) + payload)


def recv_exactly(sock, size):
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def recv_frame(sock):
    """(kind, payload), or None at the end of the stream."""
    header = recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    length, kind = HEADER.unpack(header)
    payload = recv_exactly(sock, length)
    return None if payload is None else (kind, payload)


def accepts(path):
    """Whether something listens at the socket file `path` (which may exist, stale)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(path) == 0


def connect(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(JOIN_TIMEOUT_S)
    sock.connect(path)
    return sock


class CountingAdapter:
    """One environment: frame = [steps so far, last action]; reward = action; episodes of 3."""

    def __init__(self):
        self.steps = 0

    def result(self, action):
        return dict(frame=np.array([self.steps, action], np.int64), reward=float(action),
                    done=self.steps % 3 == 0, episode_return=0.0, episode_step=self.steps % 3)

    def initial(self):
        return self.result(0)

    def step(self, action):
        self.steps += 1
        return self.result(int(action))


class CountingBatch:
    """num_envs environments stepped together: frame [N, 2] = [steps so far, action]."""

    def __init__(self, num_envs):
        self.num_envs = num_envs
        self.steps = 0

    def result(self, actions):
        n = self.num_envs
        return dict(frame=np.stack([np.full(n, self.steps), actions], 1).astype(np.int64),
                    reward=np.asarray(actions, np.float32), done=np.zeros(n, bool),
                    episode_return=np.zeros(n, np.float32), episode_step=np.zeros(n, np.int32),
                    last_action=np.asarray(actions, np.int64))

    def initial(self):
        return self.result(np.zeros(self.num_envs, np.int64))

    def step(self, actions):
        self.steps += 1
        return self.result(actions)


def factory(num_envs=None):
    return CountingAdapter() if num_envs is None else CountingBatch(num_envs)


class ServerThread(test_env_server.ServerThread):
    """test_env_server's server thread at a raw: address, once it accepts connections."""

    def __init__(self, address, env_factory=factory):
        super().__init__(env_factory, address)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not self.errors and not accepts(address[len("raw:"):]):
            assert time.monotonic() < deadline, "the server did not listen"
            time.sleep(0.01)


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "env.sock")


def step_message(pb2, kind_and_payload):
    kind, payload = kind_and_payload
    assert kind == MESSAGE, payload
    step = pb2.Step()
    step.ParseFromString(payload)
    return step


def test_env_server_speaks_the_framing_single_and_batched(pb2, path):
    server = ServerThread(f"raw:{path}")
    try:
        with connect(path) as sock:  # no request: one environment, Step's own fields
            send_frame(sock, HELLO)
            first = step_message(pb2, recv_frame(sock))
            assert first.done and list(array_of(first.observation.array)) == [0, 0]
            for t, action in enumerate([2, 1, 1], start=1):
                send_frame(sock, MESSAGE, pb2.Action(action=action).SerializeToString())
                step = step_message(pb2, recv_frame(sock))
                assert list(array_of(step.observation.array)) == [t, action]
                assert step.reward == action and step.done == (t % 3 == 0)
        with connect(path) as sock:  # 3 environments: Step.batch, actions as nest_action
            send_frame(sock, HELLO, b"3")
            first = step_message(pb2, recv_frame(sock))
            assert array_of(first.batch.map["frame"].array).shape == (3, 2)
            action = pb2.Action()
            put_array(action.nest_action, np.array([4, 5, 6], np.int64))
            send_frame(sock, MESSAGE, action.SerializeToString())
            step = step_message(pb2, recv_frame(sock))
            np.testing.assert_array_equal(array_of(step.batch.map["frame"].array),
                                          [[1, 4], [1, 5], [1, 6]])
            np.testing.assert_array_equal(array_of(step.batch.map["reward"].array), [4, 5, 6])
    finally:
        server.stop()
    assert server.errors == []
    assert not os.path.exists(path), "the server left its socket file behind"


@pytest.mark.parametrize("first_frame, message", [
    ((HELLO, b"0"), "must be an integer in [1, 4096], got '0'"),
    ((HELLO, b"12abc"), "must be an integer in [1, 4096], got '12abc'"),
    ((MESSAGE, b""), "must open with a hello frame"),
], ids=["zero", "not-a-number", "no-hello"])
def test_env_server_refuses_a_bad_opening_with_an_error_frame(path, first_frame, message):
    server = ServerThread(f"raw:{path}")
    try:
        with connect(path) as sock:
            send_frame(sock, *first_frame)
            kind, payload = recv_frame(sock)
            assert kind == ERROR and message in payload.decode(), payload
            assert recv_frame(sock) is None, "the stream stays open after a refusal"
    finally:
        server.stop()


def test_stop_ends_open_streams(pb2, path):
    server = ServerThread(f"raw:{path}")
    with connect(path) as sock:
        send_frame(sock, HELLO)
        step_message(pb2, recv_frame(sock))
        server.stop()  # returns although a client is connected and waits
        assert recv_frame(sock) is None
    assert not os.path.exists(path)


def test_an_address_in_use_is_refused_and_a_stale_socket_replaced(path):
    first = ServerThread(f"raw:{path}")
    try:
        with pytest.raises(RuntimeError, match="address in use"):
            libpolybeast.EnvServer(factory, f"raw:{path}").run()
    finally:
        first.stop()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a socket file nobody listens at, as a killed server leaves
    stale.close()
    assert os.path.exists(path)
    second = ServerThread(f"raw:{path}")
    try:
        with connect(path) as sock:
            send_frame(sock, HELLO)
            assert recv_frame(sock)[0] == MESSAGE
    finally:
        second.stop()
    assert second.errors == []


def test_bad_raw_addresses_are_refused_at_once():
    for address in ["raw:", "raw:/" + "x" * 200]:
        with pytest.raises(ValueError, match="raw:PATH"):
            libpolybeast.ActorPool(
                unroll_length=1, learner_queue=libpolybeast.BatchingQueue(),
                inference_batcher=libpolybeast.DynamicBatcher(),
                env_server_addresses=[address], initial_agent_state=(), env_keys=["frame"])
        with pytest.raises(ValueError, match="raw:PATH"):
            libpolybeast.EnvServer(factory, address).run()


class PythonRawServer:
    """A raw server in Python serving LivesEnv (TorchBeast's episode counters, no game_over),
    reading only nest_action. hellos: what each stream asked for. With error, every stream
    gets that error frame instead; with steps_per_stream, streams go silent after that many
    Steps."""

    def __init__(self, pb2, path, error=None, steps_per_stream=None):
        self.pb2, self.error, self.steps_per_stream = pb2, error, steps_per_stream
        self.hellos, self.envs = [], []
        self.stopping = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen()
        self.listener.settimeout(0.05)
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self):
        while not self.stopping.is_set():
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _step(self, observation, reward, done, episode_step, episode_return):
        step = self.pb2.Step(reward=reward, done=done, episode_step=episode_step,
                             episode_return=episode_return)
        put_array(step.observation, observation)
        return step.SerializeToString()

    def _serve(self, sock):
        with sock:
            kind, payload = recv_frame(sock)
            assert kind == HELLO
            self.hellos.append(payload)
            if self.error is not None:
                send_frame(sock, ERROR, self.error.encode())
                return
            env = LivesEnv()
            self.envs.append(env)
            step = self._step(env.reset(), 0.0, True, 0, 0.0)
            episode_step, episode_return, sent = 0, 0.0, 0
            while self.steps_per_stream is None or sent < self.steps_per_stream:
                send_frame(sock, MESSAGE, step)
                sent += 1
                frame = recv_frame(sock)
                if frame is None or self.stopping.is_set():
                    return
                action = self.pb2.Action()
                action.ParseFromString(frame[1])
                observation, reward, done, _ = env.step(array_of(action.nest_action.array))
                episode_step += 1
                episode_return += reward
                if done:
                    observation = env.reset()
                step = self._step(observation, reward, done, episode_step, episode_return)
                if done:
                    episode_step, episode_return = 0, 0.0
            self.stopping.wait()  # silent, until the test ends

    def stop(self):
        self.stopping.set()
        self.threads[0].join(JOIN_TIMEOUT_S)  # accepts no more
        self.listener.close()
        for thread in self.threads:
            thread.join(JOIN_TIMEOUT_S)


@pytest.mark.parametrize("envs_per_stream", [0, 5], ids=["asks_nothing", "asks_5"])
def test_actor_pool_steps_a_python_raw_server(pb2, path, envs_per_stream):
    """The actor pool against a raw server that is not ours: the hello carries the request
    (empty when it asks for nothing), and the rollouts carry the server's steps and the
    actions the inference chose (action = frame[0] % 3, reward = action + 1)."""
    server = PythonRawServer(pb2, path)
    unroll_length, num_rollouts = 5, 6
    try:
        rollouts, pool, error = run_pool_against(f"raw:{path}", unroll_length, num_rollouts,
                                                 envs_per_stream=envs_per_stream)
    finally:
        server.stop()
    assert error is None, error
    assert server.hellos == [str(envs_per_stream).encode() if envs_per_stream else b""]
    assert len(rollouts) == num_rollouts
    for k, rollout in enumerate(rollouts):
        assert sorted(rollout) == sorted(ENV_KEYS + ("action", "truncated"))
        t = np.arange(unroll_length * k, unroll_length * (k + 1) + 1)
        np.testing.assert_array_equal(rollout["frame"][:, 0, 0], t)
        action = rollout["action"][:, 0]
        np.testing.assert_array_equal(action, t % 3)
        np.testing.assert_array_equal(rollout["reward"][1:, 0], action[:-1] + 1)
        np.testing.assert_array_equal(rollout["done"][:, 0], t % LivesEnv.LIFE_STEPS == 0)


def test_a_raw_servers_error_reaches_the_run_error(pb2, path):
    server = PythonRawServer(pb2, path, error="no environment called Pongg-v5")
    try:
        rollouts, _, error = run_pool_against(f"raw:{path}", 2, 1, connect_timeout_s=1.0)
    finally:
        server.stop()
    assert rollouts == [] and error is not None
    assert f"raw:{path}" in str(error) and "no environment called Pongg-v5" in str(error), error


def test_a_silent_raw_server_is_cancelled_after_the_stream_timeout(pb2, path, capfd):
    """Streams that go silent after 3 Steps: each is cancelled after stream_timeout_s, and the
    actor reconnects and goes on (one rollout of 2 steps per stream)."""
    server = PythonRawServer(pb2, path, steps_per_stream=3)
    try:
        rollouts, _, error = run_pool_against(f"raw:{path}", 2, 3, stream_timeout_s=0.3)
    finally:
        server.stop()
    assert error is None, error
    assert len(server.envs) >= 3
    for rollout in rollouts:  # a fresh environment each time
        np.testing.assert_array_equal(rollout["frame"][:, 0, 0], [0, 1, 2])
    assert "more than stream_timeout_s 0.3 s; cancelled the stream" in capfd.readouterr().err
