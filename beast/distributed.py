"""Several learner ranks on torch.distributed: data-parallel IMPALA.

    torchrun --nnodes N --nproc_per_node G -m polybeast ...

starts N x G learner ranks. Each rank has its own actor pool over its share of
the environment servers (the ones it starts, or its slice of
--server_addresses) and its own inference; after every backward pass the
ranks average their gradients (one all-reduce over a flat buffer; gloo on the
CPU, NCCL on GPUs), so every rank applies the same update and the weights stay
identical. Rank 0 alone writes logs, checkpoints and evaluations.

Without torchrun (no WORLD_SIZE in the environment) there is one learner and
nothing here touches torch.distributed.

Liveness: every rank's main thread writes a heartbeat counter into the
rendezvous store (the TCPStore at MASTER_ADDR:MASTER_PORT that torchrun, or
rank 0, serves) and watches the others'. A rank that ends with an error writes
its message there, so the others stop with a message that names it; one that
is killed stops writing, and the others notice within --dist_timeout_s (and
usually at once, when the all-reduce finds its connection closed).
"""

import datetime
import fcntl
import io
import ipaddress
import os
import socket
import struct
import time

import numpy as np
import torch
import torch.distributed as dist

# torchrun sets these; a launcher of its own must set them too.
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
HEARTBEAT_INTERVAL_S = 1.0


class DistributedError(RuntimeError):
    """Another rank failed or cannot be reached; the message names it."""


class Single:
    """One learner, no torch.distributed: every method is a no-op."""

    rank, world_size, local_rank, is_main, is_distributed = 0, 1, 0, True, False

    def __init__(self):
        self.hosts = (socket.gethostname(),)

    def share(self, obj):
        return obj

    def average_gradients(self, parameters):
        pass

    def heartbeat(self):
        pass

    def ended(self, message):
        pass

    def close(self):
        pass


class Ranks:
    """This process's place among the learner ranks, and what they do together."""

    is_distributed = True

    def __init__(self, rank, world_size, local_rank, backend, timeout_s):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.is_main = rank == 0
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        # Our own connection to the rendezvous store, for heartbeats and last words.
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   is_master=False, timeout=timeout)
        self.beats = 0
        self.peer_seen = {}  # rank -> (last heartbeat value, local time it changed)
        self.last_beat = 0.0
        # Through the store, as text: nothing crosses the network pickled.
        self.store.set(f"beast/host/{rank}", socket.gethostname())
        self.hosts = tuple(self.store.get(f"beast/host/{r}").decode() for r in range(world_size))
        # NCCL moves only GPU tensors; gloo CPU ones.
        self.device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                       else torch.device("cpu"))

    def name(self, rank):
        return f"learner rank {rank} (host {self.hosts[rank]})"

    def share(self, obj):
        """Rank 0's `obj`, on every rank (a resume's checkpoint and saved flags, the weights).

        obj holds tensors and plain types only (str, numbers, None, lists, tuples, dicts). It
        travels in torch.save's format and is read back with torch.load(weights_only=True),
        which rebuilds nothing else: not pickle's arbitrary objects (dist.broadcast_object_list
        would unpickle whatever rank 0 sent).
        """
        data = None
        if self.is_main:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64,
                            device=self.device)
        self._collective(dist.broadcast, size, src=0)
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        else:
            data = data.to(self.device)
        self._collective(dist.broadcast, data, src=0)
        received = io.BytesIO(data.cpu().numpy().tobytes())
        return torch.load(received, map_location="cpu", weights_only=True)

    def average_gradients(self, parameters):
        """Replaces every gradient with its mean over the ranks: one all-reduce over a
        flat buffer. A parameter without a gradient counts as a zero gradient, so every
        rank reduces the same buffer."""
        parameters = [p for p in parameters if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        self._collective(dist.all_reduce, flat)
        flat /= self.world_size
        offset = 0
        for p in parameters:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
            offset += n

    def _collective(self, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except RuntimeError as e:  # gloo's and NCCL's errors (DistBackendError) among them
            raise DistributedError(f"{self.peers_report()} ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''})") from None

    def heartbeat(self):
        """Called often by the main thread: writes ours, checks the others'. Raises
        DistributedError when another rank ended with an error or went silent."""
        now = time.monotonic()
        if now - self.last_beat < HEARTBEAT_INTERVAL_S:
            return
        self.last_beat = now
        self.beats += 1
        try:
            self.store.set(f"beast/alive/{self.rank}", str(self.beats))
            for rank in self._peers():
                self._check_peer(rank, now)
        except DistributedError:
            raise
        except RuntimeError as e:  # DistStoreError among them
            raise DistributedError(
                f"lost the rendezvous store at {os.environ['MASTER_ADDR']}:"
                f"{os.environ['MASTER_PORT']} ({e}); the host of learner rank 0 or of "
                "torchrun's rendezvous has gone.") from None

    def _peers(self):
        return [r for r in range(self.world_size) if r != self.rank]

    def _check_peer(self, rank, now):
        if self.store.check([f"beast/ended/{rank}"]):
            message = self.store.get(f"beast/ended/{rank}").decode()
            raise DistributedError(f"{self.name(rank)} stopped: {message}")
        key = f"beast/alive/{rank}"
        value = self.store.get(key).decode() if self.store.check([key]) else None
        seen, since = self.peer_seen.get(rank, (None, now))
        if value != seen:
            self.peer_seen[rank] = (value, now)
        elif now - since > self.timeout_s:
            raise DistributedError(f"{self.name(rank)} sent no heartbeat for "
                                   f"{now - since:.0f} s (--dist_timeout_s); it hangs or died.")

    def peers_report(self):
        """Which rank went quiet, as far as the store tells; for errors of a collective."""
        now, quiet = time.monotonic(), []
        for rank in self._peers():
            try:
                if self.store.check([f"beast/ended/{rank}"]):
                    return (f"{self.name(rank)} stopped: "
                            f"{self.store.get(f'beast/ended/{rank}').decode()}")
            except RuntimeError:
                return "lost the rendezvous store; learner rank 0's host has gone"
            seen, since = self.peer_seen.get(rank, (None, now))
            quiet.append((now - since, rank))
        age, rank = max(quiet)
        if len(quiet) == 1:
            return f"{self.name(rank)} died or was killed (a collective with it failed)"
        return (f"a collective with the other learner ranks failed; the quietest is "
                f"{self.name(rank)}, last heard {age:.0f} s ago: it died or was killed")

    def ended(self, message):
        """This rank's last word, for the others' heartbeat check."""
        try:
            self.store.set(f"beast/ended/{self.rank}", message)
        except RuntimeError:
            pass  # the store is gone: the others find out by themselves

    def close(self):
        if dist.is_initialized():
            dist.destroy_process_group()


def from_environment(flags):
    """Single() without torchrun, else this process's Ranks (the process group joined)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Single()
    missing = [v for v in ENV_VARS if v not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE is {world_size} but {', '.join(missing)} is not set: "
                         "start the learner ranks with torchrun.")
    problem = restarts_problem(os.environ)
    if problem:
        raise ValueError(problem)
    backend = "gloo"
    # gloo binds to the address the hostname resolves to, often 127.0.1.1 or 127.0.0.1:
    # then ranks on other hosts cannot reach it. The interface that routes to the
    # rendezvous is the one the other hosts can reach us on.
    interface = interface_towards(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    if torch.cuda.is_available() and not flags.disable_cuda:
        backend = "nccl"
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per local rank
    return Ranks(int(os.environ["RANK"]), world_size, int(os.environ["LOCAL_RANK"]),
                 backend, flags.dist_timeout_s)


def restarts_problem(environ):
    """Why this group cannot be restarted by torchrun (--max_restarts), or None.

    A restarted group must not share torchrun's rendezvous store with the group before it:
    the new ranks can read the old ones' addresses and last words there and fail at once
    or hang (pytorch/pytorch#135712). torchrun's c10d rendezvous gives each group a fresh
    store when TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; its static one (--master_addr and
    --master_port without --rdzv_backend) never does."""
    if int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) <= 0:
        return None
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return ("torchrun --max_restarts restarts the learner ranks, and a restarted group must "
            "have a rendezvous store of its own: run torchrun with --rdzv_backend c10d "
            "--rdzv_endpoint HOST:PORT and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
            "environment (docs/polybeast.md, 'Restarts'), or without --max_restarts.")


def interface_towards(address, port):
    """The name of the network interface this host uses to reach address:port, or None for
    loopback or when it cannot be told (then gloo's own choice stands)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(address), port))  # UDP: nothing is sent
            local_ip = probe.getsockname()[0]
        if ipaddress.ip_address(local_ip).is_loopback:
            return None
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    request = struct.pack("256s", name[:15].encode())
                    packed = fcntl.ioctl(s.fileno(), 0x8915, request)
                except OSError:
                    continue  # no IPv4 address on it
            if socket.inet_ntoa(packed[20:24]) == local_ip:
                return name
    except OSError:
        pass
    return None


def env_rank():
    """(rank, world_size) as torchrun set them; (0, 1) without torchrun. Flags that depend on
    the rank (its share of the servers) are resolved before the process group is joined."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rank_seed(seed, rank):
    """The seed of rank `rank`'s environments and action sampling: rank 0 keeps --seed
    (one learner runs exactly as before), the others get independent streams."""
    if rank == 0:
        return seed
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0] % 2**31)


def shard(addresses, rank, world_size):
    """Rank `rank`'s share of the env servers: every world_size-th address."""
    return addresses[rank::world_size]
