"""The Slurm test harness on a controller that does not answer in time, for real: ``slurmctld``
stopped (SIGSTOP) for longer than a client waits for it (20 s here: twice ``MessageTimeout``),
as a loaded machine leaves it unscheduled. The clients then fail with "Socket timed out on send/recv operation";
``SlurmCluster.run`` must retry such a query (with a WARNING line) and answer once the controller
runs again, instead of failing the test that asked.
"""

from __future__ import annotations

import logging
import signal
import threading

import pytest

from tests.systems.slurm import SlurmCluster, missing_binaries

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # idle: the cluster starts in ~10 s, the stall lasts 30 s
    pytest.mark.skipif(bool(missing_binaries()), reason=f"Slurm/munge not installed: {missing_binaries()}"),
]

STALL_S = 30  # a query started with the stall times out after 20 s; its retry is answered


def test_a_query_during_a_controller_stall_is_retried_and_answers(tmp_path, caplog):
    cluster = SlurmCluster(tmp_path / "slurm", cpus=2)
    try:
        cluster.start()
        job = cluster.sbatch(["--output=/dev/null", "--wrap", "sleep 300"])
        ctld = cluster.procs["slurmctld"]
        ctld.send_signal(signal.SIGSTOP)
        resume = threading.Timer(STALL_S, ctld.send_signal, (signal.SIGCONT,))
        resume.start()
        try:
            with caplog.at_level(logging.WARNING, logger="tests.load"):
                info = cluster.job(job)
        finally:
            resume.join()
        assert info["JobId"] == str(job)
        retried = [r.getMessage() for r in caplog.records if r.name == "tests.load"]
        assert retried and "transient failure" in retried[0], retried
    finally:
        if "slurmctld" in cluster.procs:
            cluster.procs["slurmctld"].send_signal(signal.SIGCONT)
        cluster.stop()
