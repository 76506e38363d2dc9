"""Where the tests' shared files are, for test modules in any of tests/unit, tests/e2e and
tests/structure (a test never builds these from its own location, which depends on its folder)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
DATA = TESTS / "data"
