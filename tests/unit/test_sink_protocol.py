"""Both sinks a ``Checkpointer`` can use implement the one ``Sink`` contract, method by method
(names and parameters), so neither grows a call that the other lacks."""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor

import pytest

from storage_backends import open_store
from trainer_hooks.daemon_sink import DaemonSink
from trainer_hooks.sink import Sink
from trainer_hooks.writer import BackgroundWriter

CONTRACT = [n for n in ("stager", "submit", "idle", "shutdown") if n in vars(Sink)]


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("cls", [BackgroundWriter, DaemonSink])
def test_sinks_implement_the_contract(cls):
    assert CONTRACT == ["stager", "submit", "idle", "shutdown"]
    for name in CONTRACT:
        assert _params(getattr(cls, name)) == _params(getattr(Sink, name)), (cls.__name__, name)


def test_the_in_process_writer_is_a_sink(tmp_path):
    with ThreadPoolExecutor(1) as io:
        w = BackgroundWriter(open_store(str(tmp_path)), io, keep_last=None, commit_timeout=10, writer="test-writer")
        try:
            assert isinstance(w, Sink)
            w.idle()
        finally:
            w.shutdown()
