"""Fixtures that several test files share."""

import signal

import pytest
import torch


@pytest.fixture
def keep_process_state():
    """train() installs signal handlers and sets torch's thread count: put them back."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    threads = torch.get_num_threads()
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    torch.set_num_threads(threads)
