"""The memory-only step campaign's CI subset (issue 37 item 6): fixed kill points of each fault
of ``tests.faults.tier_campaign`` (a node lost, every daemon lost, a daemon restarted with and
without ``--spill-dir`` and then its peer lost), each right after a step's acknowledgement, so
the kill lands in the next step's hand-off or in a push held in flight by the test double.
Every kill: no wrong restore, no hang, and the mode's goal (a single node lost: at most 1 step
once the first K are acknowledged; every daemon's memory lost: the newest persisted step).

The long campaign, with kill times drawn uniformly, is ``python -m benchmarks.tier_campaign``."""

from __future__ import annotations

import pytest

from tests.faults.tier_campaign import EVERY, TierCampaign

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# mode -> (after_step, push_step): kill once every rank acknowledged after_step; push_step's
# pushes held in flight 1 s longer (None: none). One point per mode keeps CI's share bounded
# (about a minute each on an idle machine); the long campaign draws the kill times.
POINTS = {
    "node": [(EVERY + 2, EVERY + 2)],
    "all": [(2 * EVERY, None)],
    "restart": [(2 * EVERY + 1, None)],
    "restart-spill": [(EVERY + 2, EVERY + 2)],
}


@pytest.mark.parametrize("mode", list(POINTS))
def test_fixed_kill_points(tmp_path, mode):
    camp = TierCampaign(tmp_path / "work", keep=True)
    for after, push in POINTS[mode]:
        r = camp.event(mode, after, 0.0, push)
        assert not r.error, r.line()
        assert not r.wrong and not r.hang, r.line()
        assert r.acked >= after and len(r.restored) == 2, r.line()
        assert r.met is not False, r.line()
