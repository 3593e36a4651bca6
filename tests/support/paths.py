"""Where things are, wherever a test module sits under tests/."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
#: The scripts the tests launch by path.
WORKERS = SUPPORT / "workers"
