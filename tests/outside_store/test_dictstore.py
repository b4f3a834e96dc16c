"""idempo's store contract, run on a store written outside idempo (dictstore.py)."""

import pytest
from dictstore import AsyncDictStore, DictStore

from idempo.testing import StoreContract


class TestDictStore(StoreContract):
    @pytest.fixture(params=["sync", "async"])
    def store(self, request: pytest.FixtureRequest) -> DictStore | AsyncDictStore:
        return DictStore() if request.param == "sync" else AsyncDictStore()
