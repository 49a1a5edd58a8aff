"""Env server addresses: "unix:PATH" and "raw:PATH" (unix sockets, this machine only),
"HOST:PORT" or "tcp:HOST:PORT" (TCP), and where a run's own sockets go. Env servers import
it: it imports neither torch nor anything that does."""

import os
import tempfile

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def split_host_port(address):
    """"tcp:HOST:PORT" or "HOST:PORT" -> (HOST, PORT as int); an IPv6 HOST is written [::1].
    Raises ValueError for anything else, unix:PATH included."""
    text = address[len("tcp:"):] if address.startswith("tcp:") else address
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected a TCP address HOST:PORT, got {address!r}")
    return host, int(port)


# Env server addresses that are a unix socket file: "unix:" is gRPC over it, "raw:" our
# framing without gRPC (csrc/raw_socket.h), which only our servers and learner speak.
SOCKET_SCHEMES = ("unix:", "raw:")


# A unix socket's path is held in sockaddr_un.sun_path: 108 bytes on Linux, one of them the
# final NUL. A longer path fails deep in gRPC or the raw transport; we say so up front.
MAX_SOCKET_PATH_BYTES = 107


def socket_path(address):
    """The socket file of a unix:PATH or raw:PATH address; None for any other address."""
    for scheme in SOCKET_SCHEMES:
        if address.startswith(scheme):
            return address[len(scheme):]
    return None


def socket_path_problem(address):
    """What makes a unix:PATH or raw:PATH address unusable (no path, or one longer than a unix
    socket can hold), as a sentence; None when it is fine or not a socket address."""
    path = socket_path(address)
    if path is None:
        return None
    if not path:
        return f"{address!r} names no socket path: give {address}PATH"
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        return (f"the socket path of {address!r} is {size} bytes, and a unix socket's path "
                f"holds at most {MAX_SOCKET_PATH_BYTES}: choose a shorter directory")
    return None


def is_loopback(address):
    """Whether only this machine can reach `address` (unix:PATH, raw:PATH, or a loopback
    HOST:PORT). Raises ValueError for an address that is none of these."""
    if socket_path(address) is not None:
        return True
    host, _ = split_host_port(address)
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def parse_address_list(text):
    """A comma-separated --server_addresses value -> a list of addresses: "unix:PATH" and
    "raw:PATH" as given, "HOST:PORT" with a "tcp:" prefix dropped. Blank entries (a trailing
    comma) are skipped. Raises ValueError naming the first bad entry, or for a list with no
    address."""
    addresses = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if socket_path(entry) is not None:
            problem = socket_path_problem(entry)
            if problem:
                raise ValueError(problem)
            addresses.append(entry)
            continue
        try:
            host, port = split_host_port(entry)
        except ValueError:
            raise ValueError(f"{entry!r} is neither unix:PATH, raw:PATH nor HOST:PORT") from None
        addresses.append(f"{host}:{port}")
    if not addresses:
        raise ValueError(f"no address in {text!r}: give unix:PATH or HOST:PORT, comma-separated")
    return addresses


def rank_basename(pipes_basename, rank, world_size):
    """The --pipes_basename of this rank's own servers: learner ranks on one host must not
    share sockets, so each of several gets its own suffix."""
    return f"{pipes_basename}-rank{rank}" if world_size > 1 else pipes_basename


def socket_dir(num_servers):
    """Where a run's own server sockets go: the temporary directory ($TMPDIR), unless its
    path is too long for a unix socket (a cluster's per-job scratch can be), then /tmp."""
    longest = os.path.join(tempfile.gettempdir(), f"polybeast-{os.getpid()}-xxxxxxxx",
                           f"env.{num_servers - 1}")
    if len(os.fsencode(longest)) > MAX_SOCKET_PATH_BYTES:
        return "/tmp"
    return None
