"""The simulated S3 store passes the conformance suite every backend passes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from storage_backends.testing import StoreConformance
from tests.doubles.simulated import SimulatedStore


class TestSimulatedStore(StoreConformance):
    @pytest.fixture
    def store(self) -> Iterator[SimulatedStore]:
        # Small pages so that every listing in the suite spans several of them.
        with SimulatedStore(page_size=3) as s:
            yield s
