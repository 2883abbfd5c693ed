"""Fixtures for the backend tests; the S3 server fixtures live in the top-level conftest."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from storage_backends import memory


@pytest.fixture(autouse=True)
def _fresh_memory_namespaces() -> Iterator[None]:
    """memory:// namespaces are process-global: start and end every test without any."""
    memory.reset()
    yield
    memory.reset()
