"""Fixtures for the Python client's tests: the real server binary ($ATTNSERVE_BINARY, which
run_tests.py sets), one server for the session, a Client on it, seeded random inputs."""
import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # servers.py, reference.py, fakes.py

from servers import Server  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--attnserve", default=os.environ.get("ATTNSERVE_BINARY"),
                     help="the attnserve server binary (default: $ATTNSERVE_BINARY)")


@pytest.fixture(scope="session")
def binary(request):
    path = request.config.getoption("--attnserve")
    if not path:
        pytest.fail("no server binary: pass --attnserve=BUILD/server/attnserve or set "
                    "ATTNSERVE_BINARY (ctest -R python does)")
    return path


@pytest.fixture(scope="session")
def server(binary):
    s = Server(binary)
    yield s
    assert s.stop() == 0, "the server did not exit cleanly on SIGTERM"


@pytest.fixture(scope="session")
def slow_server(binary):
    """A server that holds every request for a 1.5 s batch window: deadlines shorter than that
    expire for certain (a tiny timeout alone does not: gRPC rounds deadlines up to the
    millisecond, and a loopback call can finish within it)."""
    s = Server(binary, "--max_queue_delay=1500ms", "--max_batch_requests=64")
    yield s
    assert s.stop() == 0, "the server did not exit cleanly on SIGTERM"


@pytest.fixture
def client(server):
    import attnserve
    with attnserve.Client(server.target, timeout=60) as c:
        yield c


@pytest.fixture
def rng(request):
    # Fresh inputs per test, reproducible from the test's name.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
