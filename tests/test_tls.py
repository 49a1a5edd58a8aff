"""TLS between actors and env servers (csrc/tls.h, beast/tls.py), each side tested against an
independent implementation (grpcio in Python): our ActorPool against grpcio's TLS server, our
EnvServer against grpcio's TLS client, with and without client certificates; then the two
command lines end to end, and the flags that are refused. The certificates come from
python -m beast.tls (the openssl command line), made here for the test."""

import os
import shutil
import subprocess

import numpy as np
import pytest

import libpolybeast
import polybeast_env
from beast import tls
from test_env_server import (Client, Factory, ServerThread, free_port, frame_of,
                             run_pool_against, rpcenv)  # noqa: F401 - rpcenv is a fixture
from test_polybeast import checkpoint_step, output, polybeast_args, run, start
from torchbeast_server import TorchBeastServer

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="needs the openssl command to make certificates")

FAIL_S = 3  # how long a connection that must fail is given


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two CAs; a server certificate for localhost and 127.0.0.1, one for the name envhost
    only, one from the other CA; a learner's certificate (python -m beast.tls's functions)."""
    d = tmp_path_factory.mktemp("pki")
    tls.make_ca(d)
    tls.make_ca(d, "other_ca")
    tls.make_cert(d, "server", hosts=["localhost", "127.0.0.1"])
    tls.make_cert(d, "named", hosts=["envhost"])
    tls.make_cert(d, "stranger", ca="other_ca", hosts=["localhost", "127.0.0.1"])
    tls.make_cert(d, "learner")
    return d


def pem(pki, name):
    return (pki / name).read_text()


def server_tls(pki, cert="server", client_ca=None):
    config = {"cert_chain": pem(pki, f"{cert}.pem"), "private_key": pem(pki, f"{cert}.key")}
    if client_ca:
        config["root_certs"] = pem(pki, f"{client_ca}.pem")
    return config


def learner_tls(pki, ca="ca", cert=None, target_name=None):
    config = {"root_certs": pem(pki, f"{ca}.pem")}
    if cert:
        config.update(cert_chain=pem(pki, f"{cert}.pem"), private_key=pem(pki, f"{cert}.key"))
    if target_name:
        config["target_name"] = target_name
    return config


def grpc_server_credentials(pki, cert="server", client_ca=None):
    import grpc

    return grpc.ssl_server_credentials(
        [(pem(pki, f"{cert}.key").encode(), pem(pki, f"{cert}.pem").encode())],
        root_certificates=pem(pki, f"{client_ca}.pem").encode() if client_ca else None,
        require_client_auth=client_ca is not None)


def grpc_channel_credentials(pki, cert=None):
    import grpc

    if cert is None:
        return grpc.ssl_channel_credentials(pem(pki, "ca.pem").encode())
    return grpc.ssl_channel_credentials(pem(pki, "ca.pem").encode(),
                                        pem(pki, f"{cert}.key").encode(),
                                        pem(pki, f"{cert}.pem").encode())


def local_address():
    return f"127.0.0.1:{free_port()}"


# ----------------------------------------------------------------------------
# Our actors against grpcio's TLS server (TorchBeast's wire format, tests/torchbeast_server.py).

@pytest.mark.slow
def test_actor_pool_streams_over_tls_from_an_independent_server(rpcenv, pki):
    address = local_address()
    server = TorchBeastServer(rpcenv, address, credentials=grpc_server_credentials(pki))
    try:
        rollouts, _, error = run_pool_against(address, unroll_length=5, num_rollouts=4,
                                              tls=learner_tls(pki))
    finally:
        server.stop()
    assert error is None, error
    assert len(rollouts) == 4
    # The steps went both ways: the server stepped with the actions the pool chose.
    assert len(server.envs[0].received) >= 4 * 5
    np.testing.assert_array_equal(rollouts[1]["frame"][:, 0, 0], np.arange(5, 11))


@pytest.mark.parametrize("case", ["plain client", "other CA", "wrong name",
                                  "no client certificate"])
@pytest.mark.slow
def test_actor_pool_refuses_or_is_refused_when_tls_does_not_fit(rpcenv, pki, case):
    """Each mismatch ends the pool's run with its 'could not reach' error, no stream opened:
    a pool without TLS, a server whose certificate another CA signed, a certificate made out
    to another host, and a server that requires a client certificate the pool lacks."""
    cert, pool_tls, client_ca = "server", learner_tls(pki), None
    if case == "plain client":
        pool_tls = None
    elif case == "other CA":
        cert = "stranger"
    elif case == "wrong name":
        cert = "named"  # made out to envhost; the pool dials 127.0.0.1
    else:
        client_ca = "ca"
    address = local_address()
    server = TorchBeastServer(rpcenv, address,
                              credentials=grpc_server_credentials(pki, cert, client_ca))
    try:
        rollouts, _, error = run_pool_against(address, unroll_length=5, num_rollouts=1,
                                              connect_timeout_s=FAIL_S, tls=pool_tls)
    finally:
        server.stop()
    assert rollouts == [] and server.envs == []
    assert isinstance(error, RuntimeError) and "could not reach the env server" in str(error)


@pytest.mark.parametrize("case", ["target name", "client certificate"])
def test_actor_pool_target_name_and_client_certificate(rpcenv, pki, case):
    """What fixes the last two mismatches above: target_name for a certificate made out to
    another name than the address's host, the learner's certificate for a server that asks."""
    if case == "target name":
        credentials = grpc_server_credentials(pki, "named")
        pool_tls = learner_tls(pki, target_name="envhost")
    else:
        credentials = grpc_server_credentials(pki, client_ca="ca")
        pool_tls = learner_tls(pki, cert="learner")
    address = local_address()
    server = TorchBeastServer(rpcenv, address, credentials=credentials)
    try:
        rollouts, _, error = run_pool_against(address, unroll_length=5, num_rollouts=2,
                                              tls=pool_tls)
    finally:
        server.stop()
    assert error is None, error
    assert len(rollouts) == 2


# ----------------------------------------------------------------------------
# Our EnvServer against grpcio's TLS client.

@pytest.mark.slow
def test_env_server_serves_tls_to_an_independent_client(rpcenv, pki):
    import grpc

    address = local_address()
    server = ServerThread(Factory(), address, tls=server_tls(pki))
    try:
        client = Client(rpcenv, address, credentials=grpc_channel_credentials(pki))
        try:
            assert frame_of(client.first()).tolist() == [[0, 0], [1, 0]]
            assert frame_of(client.step(2)).tolist() == [[1, 1], [1, 2]]
        finally:
            client.close()
        # A client that speaks plain gRPC to it gets no connection.
        with pytest.raises(grpc.FutureTimeoutError):
            Client(rpcenv, address, ready_timeout_s=FAIL_S)
    finally:
        server.stop()


@pytest.mark.slow
def test_env_server_with_a_client_ca_admits_only_certified_clients(rpcenv, pki):
    import grpc

    address = local_address()
    server = ServerThread(Factory(), address, tls=server_tls(pki, client_ca="ca"))
    try:
        # gRPC's client may connect before the server checks it, so the stream is what fails.
        with pytest.raises((grpc.FutureTimeoutError, grpc.RpcError)):
            client = Client(rpcenv, address, credentials=grpc_channel_credentials(pki),
                            ready_timeout_s=FAIL_S)
            client.first()
        client = Client(rpcenv, address, credentials=grpc_channel_credentials(pki, "learner"))
        try:
            assert frame_of(client.first()).tolist() == [[0, 0], [1, 0]]
        finally:
            client.close()
    finally:
        server.stop()


@pytest.mark.slow
def test_env_server_and_actor_pool_refuse_tls_configurations_that_cannot_work(pki, tmp_path):
    with pytest.raises(ValueError, match="cert_chain and private_key go together"):
        libpolybeast.EnvServer(Factory(), local_address(),
                               tls={"cert_chain": pem(pki, "server.pem")})
    with pytest.raises(ValueError, match="is a unix socket on this machine"):
        libpolybeast.EnvServer(Factory(), f"raw:{tmp_path}/env", tls=server_tls(pki))
    with pytest.raises(ValueError, match="unknown key 'ca'"):
        libpolybeast.EnvServer(Factory(), local_address(), tls={"ca": "x"})
    queue = libpolybeast.BatchingQueue()
    batcher = libpolybeast.DynamicBatcher()
    with pytest.raises(ValueError, match="root_certs, the CA of its servers"):
        libpolybeast.ActorPool(unroll_length=2, learner_queue=queue, inference_batcher=batcher,
                               env_server_addresses=[local_address()], initial_agent_state=(),
                               env_keys=[], tls={"cert_chain": "x", "private_key": "y"})
    with pytest.raises(ValueError, match="is a unix socket on this machine"):
        libpolybeast.ActorPool(unroll_length=2, learner_queue=queue, inference_batcher=batcher,
                               env_server_addresses=[f"raw:{tmp_path}/env"],
                               initial_agent_state=(), env_keys=[], tls=learner_tls(pki))


def test_env_server_with_a_key_that_does_not_match_its_certificate_says_so(pki):
    server = libpolybeast.EnvServer(
        Factory(), local_address(),
        tls={"cert_chain": pem(pki, "server.pem"), "private_key": pem(pki, "learner.key")})
    with pytest.raises(RuntimeError, match="TLS certificate and key"):
        server.run()


# ----------------------------------------------------------------------------
# The command lines.

@pytest.mark.slow
def test_a_learner_trains_on_tls_servers_and_a_plain_one_is_told_why_it_cannot(pki, tmp_path):
    """polybeast_env --tls_cert/--tls_key/--tls_client_ca and polybeast --tls_ca/--tls_cert/
    --tls_key train CartPole together; a learner without --tls_ca gets a message that names
    it."""
    port = free_port()
    servers = start(tmp_path, "servers", "polybeast_env", "--env", "CartPole-v1",
                    "--num_servers", "2", "--address", f"127.0.0.1:{port}",
                    "--tls_cert", str(pki / "server.pem"), "--tls_key", str(pki / "server.key"),
                    "--tls_client_ca", str(pki / "ca.pem"))
    try:
        addresses = f"127.0.0.1:{port},localhost:{port + 1}"
        result = run(tmp_path, *polybeast_args(
            tmp_path, "--env", "CartPole-v1", "--server_addresses", addresses,
            "--tls_ca", str(pki / "ca.pem"), "--tls_cert", str(pki / "learner.pem"),
            "--tls_key", str(pki / "learner.key"), "--total_steps", "4000"))
        assert result.returncode == 0, result.stderr[-3000:]
        assert checkpoint_step(tmp_path / "runs" / "run") >= 4000
        assert "neither authenticated nor encrypted" not in result.stderr
        result = run(tmp_path, *polybeast_args(
            tmp_path, "--env", "CartPole-v1", "--server_addresses", addresses,
            "--connect_timeout_s", str(FAIL_S), "--total_steps", "20000", xpid="plain"))
        assert result.returncode != 0
        assert "could not reach the env server" in result.stderr, result.stderr[-3000:]
        assert "Servers started with --tls_cert need --tls_ca here." in result.stderr
        assert "Traceback" not in result.stderr
    finally:
        servers.terminate()
        assert servers.wait(timeout=30) == 0, output(tmp_path, "servers")
    assert "serving CartPole-v1" in output(tmp_path, "servers")


def test_polybeast_env_exposed_tls_server_warns_about_what_is_left_open(pki, capsys):
    """The warning of a server other machines can reach says what TLS leaves open."""
    polybeast_env._warn_exposed("0.0.0.0:4000", None)
    assert "neither authenticated nor encrypted" in capsys.readouterr().err
    polybeast_env._warn_exposed("0.0.0.0:4000", server_tls(pki))
    assert "any client may connect; --tls_client_ca" in capsys.readouterr().err
    polybeast_env._warn_exposed("0.0.0.0:4000", server_tls(pki, client_ca="ca"))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("args, message", [
    (["--tls_cert", "{pki}/server.pem"], "--tls_cert and --tls_key go together"),
    (["--tls_client_ca", "{pki}/ca.pem"], "--tls_client_ca needs --tls_cert and --tls_key"),
    (["--tls_cert", "{pki}/server.key", "--tls_key", "{pki}/server.key"],
     "server.key holds no PEM certificate"),
    (["--tls_cert", "{pki}/server.pem", "--tls_key", "{pki}/nothing.key"],
     "--tls_key: cannot read"),
    (["--tls_cert", "{pki}/server.pem", "--tls_key", "{pki}/server.key", "--pipes_basename",
      "unix:/tmp/x"], "give --address HOST:PORT"),
])
def test_polybeast_env_refuses_bad_tls_flags(pki, args, message, capsys):
    args = [a.format(pki=pki) for a in args]
    if "--pipes_basename" not in args:
        args += ["--address", "127.0.0.1:4000"]
    with pytest.raises(SystemExit) as exit_info:
        polybeast_env.main(["--env", "CartPole-v1", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--tls_ca", "{pki}/ca.pem"], "--tls_ca is for env servers started elsewhere"),
    (["--server_addresses", "127.0.0.1:4000", "--tls_cert", "{pki}/learner.pem",
      "--tls_key", "{pki}/learner.key"], "--tls_cert, --tls_key need --tls_ca"),
    (["--server_addresses", "unix:/tmp/x.0", "--tls_ca", "{pki}/ca.pem"],
     "unix:/tmp/x.0 is a unix socket"),
    (["--server_addresses", "127.0.0.1:4000", "--tls_ca", "{pki}/ca.key"],
     "--tls_ca: "),
])
@pytest.mark.slow
def test_polybeast_refuses_bad_tls_flags(pki, tmp_path, args, message):
    args = [a.format(pki=pki) for a in args]
    result = run(tmp_path, *polybeast_args(tmp_path, "--env", "CartPole-v1", *args))
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs" / "run" / "flags.json").exists()


def test_read_pem_says_what_is_wrong(pki, tmp_path):
    assert tls.read_pem("--tls_ca", pki / "ca.pem", "certificate").startswith("-----BEGIN")
    assert "PRIVATE KEY" in tls.read_pem("--tls_key", pki / "server.key", "key")
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", pki / "server.key", "-aes256", "-passout",
                    "pass:secret", "-out", encrypted], check=True, capture_output=True)
    with pytest.raises(ValueError, match="--tls_key: .* is an encrypted key"):
        tls.read_pem("--tls_key", encrypted, "key")
    with pytest.raises(ValueError, match="holds no PEM key"):
        tls.read_pem("--tls_key", pki / "ca.pem", "key")


def test_beast_tls_makes_certificates_and_keeps_an_existing_ca(tmp_path, capsys):
    out = tmp_path / "certs"
    assert tls.main(["--out", str(out), "--server_hosts", "envhost, 10.0.0.5"]) == 0
    assert "--tls_ca" in capsys.readouterr().out
    for name in ("ca", "server", "learner"):
        assert tls.read_pem("--tls_cert", out / f"{name}.pem", "certificate")
        assert tls.read_pem("--tls_key", out / f"{name}.key", "key")
        assert os.stat(out / f"{name}.key").st_mode & 0o077 == 0  # private
    text = subprocess.run(["openssl", "x509", "-in", out / "server.pem", "-noout", "-text"],
                          check=True, capture_output=True, text=True).stdout
    assert "DNS:envhost" in text and "IP Address:10.0.0.5" in text
    assert sorted(os.listdir(out)) == sorted(f"{n}.{e}" for n in ("ca", "server", "learner")
                                             for e in ("pem", "key"))
    ca = (out / "ca.pem").read_text()
    with pytest.raises(SystemExit):
        tls.main(["--out", str(out), "--server_hosts", "envhost"])
    assert (out / "ca.pem").read_text() == ca
