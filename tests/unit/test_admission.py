"""learner.admission: the staleness bound's three checks, with values worked out by hand, and
the one Admission that the coordinator and the replay queue share."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from learner.admission import Admission
from tests.unit.test_coordinator import make, make_buffer, make_group


def test_lease_capacity_counts_from_the_older_of_learner_and_actor_weights() -> None:
    adm = Admission(num_groups_per_step=4, max_staleness_steps=2)
    assert adm.lease_capacity(version=0, weight_version=0, used_slots=0) == 12  # (0 + 2 + 1) * 4
    assert adm.lease_capacity(version=5, weight_version=5, used_slots=20) == 12  # (5 + 3) * 4 - 20
    assert adm.lease_capacity(version=5, weight_version=3, used_slots=20) == 4  # (3 + 3) * 4 - 20
    assert adm.lease_capacity(version=3, weight_version=5, used_slots=20) == 4  # ahead: still min = 3
    assert adm.lease_capacity(version=0, weight_version=0, used_slots=13) == -1


@pytest.mark.parametrize("weight_version,usable", [(2, False), (3, True), (5, True), (6, True), (7, False)])
def test_weights_usable_from_version_minus_k_to_the_newest(weight_version: int, usable: bool) -> None:
    adm = Admission(num_groups_per_step=1, max_staleness_steps=2)
    assert adm.weights_usable(weight_version, version=5, newest_version=6) is usable


def test_fresh_at_consumption_allows_exactly_k_versions() -> None:
    adm = Admission(num_groups_per_step=1, max_staleness_steps=1)
    assert adm.fresh_at_consumption(min_version=3, version=4)
    assert not adm.fresh_at_consumption(min_version=3, version=5)
    assert Admission(1, 0).fresh_at_consumption(min_version=5, version=5)


def test_a_version_change_past_the_newest_version_is_from_the_future() -> None:
    coord = make(N=2, k=1)
    actor = coord.register("a")
    grant = coord.lease(actor, 1, 0).leases[0]
    adm = coord.admission
    group = make_group(coord, grant, actor, version=1)
    assert not adm.from_the_future(group, newest_version=1) and adm.from_the_future(group, newest_version=0)
    # Tokens sampled with 0, weights switched to 2 mid-generation (row: sample, token, new version).
    changed = dataclasses.replace(group, versions=np.zeros(2, np.int64),
                                  version_changes=np.array([[0, 1, 2]], np.int64))
    assert adm.from_the_future(changed, newest_version=1) and not adm.from_the_future(changed, newest_version=2)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="N >= 1 and k >= 0"):
        Admission(num_groups_per_step=0, max_staleness_steps=0)
    with pytest.raises(ValueError, match="k = -1"):
        Admission(num_groups_per_step=1, max_staleness_steps=-1)


def test_the_coordinator_and_the_replay_queue_share_one_admission() -> None:
    coord = make(N=3, k=2)
    buf = make_buffer(coord)
    assert buf.admission is coord.admission
    assert (coord.admission.num_groups_per_step, coord.admission.max_staleness_steps) == (3, 2)
    assert not hasattr(buf, "max_staleness_steps") and not hasattr(buf, "num_groups_per_batch")
