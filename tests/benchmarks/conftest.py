import signal

import pytest


@pytest.fixture(autouse=True)
def _keep_the_sigterm_handler():
    """benchmarks/peers.py's main installs its SIGTERM handler in this process (and the tests of its child
    handling install it themselves): pytest's own is put back after each test."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)
