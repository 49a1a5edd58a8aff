"""Starting and joining test threads, every join bounded by a timeout."""

import threading

JOIN_TIMEOUT_S = 30


def start(target, *args):
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def join(*threads):
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
        assert not thread.is_alive(), f"{thread.name} did not finish"
