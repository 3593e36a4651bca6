import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # the support package, `support.x`: what test modules share (no test imports another)

from support.faults import FAULTS  # noqa: E402
from support.env import scoped_environ  # noqa: E402
from support.launches import LAUNCHES  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    LAUNCHES.stop()


def pytest_terminal_summary(terminalreporter):
    if FAULTS:
        survived = sum(FAULTS.values())
        terminalreporter.write_line(f"fault injection: {len(FAULTS)} faults tried, {survived} survived"
                                    + ("" if survived == len(FAULTS) else
                                       f" (not survived: {sorted(k for k, v in FAULTS.items() if not v)})"))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS) on loopback for the whole session, started on first use; the standard AWS
    environment points at it while it runs (so launched workers inherit it)."""
    from support.s3_server import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("weed")).start()
    try:
        with scoped_environ(server.environment()):
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_session_bucket(s3_server):
    return s3_server.make_bucket("hfuc-tests")


@pytest.fixture
def s3_bucket(s3_session_bucket):
    """A fresh, empty prefix in the session's bucket on the real S3 server, as an `s3://bucket/prefix` URL."""
    import uuid

    return f"{s3_session_bucket}/t-{uuid.uuid4().hex[:12]}"


def pytest_collection_finish(session):
    """Freeze the imported training stack out of the garbage collector's walks (`support.env.freeze_imports`) in
    this process too: tests run many Trainer runs in it."""
    from support.env import freeze_imports

    freeze_imports()
