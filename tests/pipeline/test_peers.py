"""The ops the ranks of a run share: members of one enum, each with its follower's part."""

import pytest

from honing.backends import torchrun
from honing.pipeline.peers import Alone, Op


def test_every_op_has_its_followers_part():
    """An op the leader can announce that no follower runs would leave the ranks waiting."""
    assert set(torchrun.FOLLOWERS) == set(Op)
    assert set(Op) == torchrun.SHARDED_OPS and torchrun.REPLICATED_OPS < torchrun.SHARDED_OPS


def test_an_op_named_by_a_string_is_refused_where_it_is_written():
    with pytest.raises(TypeError, match="members of Op"), Alone().together("updaet", None):
        pass
    with Alone().together(Op.UPDATE, None):  # a member runs its body
        ran = True
    assert ran


def test_the_leader_refuses_a_string_op_before_it_sends_anything():
    leader = torchrun.Leader.__new__(torchrun.Leader)  # no group: nothing may be sent
    leader.shared = torchrun.SHARDED_OPS
    with pytest.raises(TypeError, match="members of Op"), leader.together("update", None):
        pass
