"""A TCP proxy that adds a round-trip time: what a far link does to a stream, without netem.

    python -m bench.delay_proxy --listen 127.0.0.1:5000 --to 10.0.0.1:4000 --rtt_ms 50
    python -m bench.delay_proxy --listen 127.0.0.1:5000,127.0.0.1:5001 \
        --to 10.0.0.1:4000,10.0.0.1:4001 --rtt_ms 10

Each --listen address forwards to the --to address at the same place in its list. Every chunk
of bytes is held for half of --rtt_ms in its direction and then passed on in order, so a
request and its answer take --rtt_ms more in all; the bandwidth is not limited. Prints
"listening" once every address listens; stops on SIGTERM or Ctrl-C.
"""

import argparse
import asyncio
import signal


def host_port(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


async def pump(reader, writer, delay_s):
    """Copies reader to writer, each chunk delay_s after it arrived."""
    loop = asyncio.get_running_loop()
    chunks = asyncio.Queue()

    async def read():
        while data := await reader.read(1 << 16):
            chunks.put_nowait((loop.time() + delay_s, data))
        chunks.put_nowait((loop.time() + delay_s, b""))

    async def write():
        while True:
            due, data = await chunks.get()
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    try:
        await asyncio.gather(read(), write())
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def forwarder(target, delay_s):
    async def forward(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(*target)
        except OSError:
            client_writer.close()  # the far side refuses: so does the proxy
            return
        await asyncio.gather(pump(client_reader, server_writer, delay_s),
                             pump(server_reader, client_writer, delay_s))
    return forward


async def serve(listen, targets, rtt_ms):
    servers = [await asyncio.start_server(forwarder(target, rtt_ms / 2000), *host_port(address))
               for address, target in zip(listen, targets)]
    print("listening", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True,
                        help="Comma-separated HOST:PORT addresses to listen on.")
    parser.add_argument("--to", required=True,
                        help="Comma-separated HOST:PORT addresses, one for each of --listen.")
    parser.add_argument("--rtt_ms", type=float, default=0.0,
                        help="The round-trip time added, half of it in each direction.")
    args = parser.parse_args(argv)
    listen, targets = args.listen.split(","), [host_port(t) for t in args.to.split(",")]
    if len(listen) != len(targets):
        parser.error(f"--listen has {len(listen)} addresses and --to {len(targets)}: give "
                     "one target for each listening address")
    if args.rtt_ms < 0:
        parser.error("--rtt_ms must be 0 or more")
    asyncio.run(serve(listen, targets, args.rtt_ms))


if __name__ == "__main__":
    main()
