"""Env server addresses (beast/poly/addresses.py): the formats, loopback, socket paths."""

import re

import pytest

from beast.poly import addresses



@pytest.mark.parametrize("address, expected", [
    ("localhost:4000", ("localhost", 4000)),
    ("tcp:10.0.0.2:4001", ("10.0.0.2", 4001)),
    ("[::1]:5", ("[::1]", 5)),
    ("tcp:[fe80::1]:65535", ("[fe80::1]", 65535)),
])
def test_split_host_port(address, expected):
    assert addresses.split_host_port(address) == expected


@pytest.mark.parametrize("address", [
    "nohost", "host:", ":4000", "host:port", "host:-1", "host:65536", "unix:/tmp/x", "tcp:", "",
])
def test_split_host_port_rejects(address):
    with pytest.raises(ValueError, match="HOST:PORT"):
        addresses.split_host_port(address)


@pytest.mark.parametrize("address, loopback", [
    ("unix:/tmp/x", True), ("raw:/tmp/x", True), ("localhost:4000", True), ("127.0.0.1:4000", True),
    ("127.8.9.1:4000", True), ("[::1]:4000", True), ("tcp:127.0.0.1:4000", True),
    ("0.0.0.0:4000", False), ("tcp:10.0.0.2:4000", False), ("example.com:80", False),
])
def test_is_loopback(address, loopback):
    assert addresses.is_loopback(address) is loopback


def test_is_loopback_rejects_a_bad_address():
    with pytest.raises(ValueError):
        addresses.is_loopback("nohost")


def test_parse_address_list():
    assert addresses.parse_address_list(
        " unix:/tmp/a.0, localhost:4000,tcp:10.0.0.2:4001,[::1]:9 ,") == [
        "unix:/tmp/a.0", "localhost:4000", "10.0.0.2:4001", "[::1]:9"]
    assert addresses.parse_address_list("unix:/tmp/a") == ["unix:/tmp/a"]
    assert addresses.parse_address_list("raw:/tmp/a.0,raw:/tmp/a.1") == [
        "raw:/tmp/a.0", "raw:/tmp/a.1"]


@pytest.mark.parametrize("text, named", [
    ("unix:/tmp/a,nohost", "'nohost'"),
    ("localhost:4000,localhost:x", "'localhost:x'"),
    ("unix:", "'unix:'"),
    ("raw:/tmp/a,raw:", "'raw:'"),
    ("/tmp/socket", "'/tmp/socket'"),
    ("", "no address"),
    (" , ,", "no address"),
])
def test_parse_address_list_names_the_bad_entry(text, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        addresses.parse_address_list(text)


@pytest.mark.parametrize("scheme", ["unix:", "raw:"])
def test_a_socket_path_too_long_for_a_unix_socket_is_refused_with_its_length(scheme):
    longest = "/tmp/" + "d" * (addresses.MAX_SOCKET_PATH_BYTES - len("/tmp/"))
    assert addresses.socket_path_problem(scheme + longest) is None
    assert addresses.parse_address_list(scheme + longest) == [scheme + longest]
    problem = addresses.socket_path_problem(scheme + longest + "d")
    assert f"is {addresses.MAX_SOCKET_PATH_BYTES + 1} bytes" in problem
    assert "shorter directory" in problem
    with pytest.raises(ValueError, match="shorter directory"):
        addresses.parse_address_list(f"{scheme}/tmp/a,{scheme}{longest}d")
    # Bytes, not characters: the kernel counts the encoded path.
    assert addresses.socket_path_problem(scheme + "/tmp/" + "é" * 60) is not None
    assert addresses.socket_path_problem("localhost:4000") is None
