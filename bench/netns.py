"""Two hosts on one machine: network namespaces joined by a veth pair.

    with Hosts() as hosts:            # hosts.address[0] = 10.213.N.1, hosts.address[1] = .2
        hosts.popen(0, [...])         # a process inside host 0's namespace
        hosts.link(1, up=False)       # a partition, until hosts.link(1, up=True)

Each namespace has its own loopback and one link to the other; nothing in them reaches the
machine's real network. The namespaces (and with them the veth pair and every process
still inside) are removed on exit, whatever happened. Needs root and iproute2; reason()
says why not, for a test to skip with.
"""

import os
import shutil
import signal
import subprocess
import time

PREFIX = "beastt"


def reason():
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need the ip command (Debian's iproute2)"
    name = f"{PREFIX}{os.getpid()}p"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Two namespaces, "hosts" 0 and 1, on the subnet 10.213.N.0/24 (N from our pid, so
    concurrent test runs do not collide)."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.names = [f"{PREFIX}{tag}a", f"{PREFIX}{tag}b"]
        self.links = [f"vb{tag}a", f"vb{tag}b"]  # at most 15 characters
        subnet = 1 + os.getpid() % 250
        self.address = [f"10.213.{subnet}.1", f"10.213.{subnet}.2"]
        self.processes = []

    def __enter__(self):
        try:
            for name in self.names:
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
            _ip("link", "add", self.links[0], "netns", self.names[0], "type", "veth",
                "peer", "name", self.links[1], "netns", self.names[1])
            for name, link, address in zip(self.names, self.links, self.address):
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                _ip("-n", name, "link", "set", link, "up")
        except BaseException:
            self.remove()
            raise
        return self

    def popen(self, host, command, **kwargs):
        """Starts `command` inside host `host`'s namespace, in its own session."""
        process = subprocess.Popen(["ip", "netns", "exec", self.names[host], *command],
                                   start_new_session=True, **kwargs)
        self.processes.append(process)
        return process

    def link(self, host, up):
        """Sets host `host`'s end of the veth pair up or down: down is a partition, packets
        between the hosts are dropped (no reset reaches either side) until it is up again."""
        _ip("-n", self.names[host], "link", "set", self.links[host], "up" if up else "down")

    def pids(self, host):
        """The processes still running inside host `host`'s namespace."""
        found = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True,
                               text=True)
        return [int(p) for p in found.stdout.split()]

    def remove(self):
        """Kills what runs inside the namespaces and deletes them; idempotent."""
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for host, name in enumerate(self.names):
            for pid in self.pids(host):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.1)
        for name in self.names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)

    def __exit__(self, *exc):
        self.remove()
