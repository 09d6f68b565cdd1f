"""sdpq.comm.traffic: every member's share, summed over the group, is the collective's closed form
(least cross-node traffic and NCCL's node-ordered ring), on even and uneven layouts."""

from __future__ import annotations

import itertools

import pytest

from sdpq.comm import traffic

# (nodes, ranks per node): the layouts the meter is checked on too.
LAYOUTS = [(2, 2), (4, 1), (1, 4), (3, 2), (2, 4)]


def _total(fn, nodes, *args) -> traffic.Traffic:
    return sum((fn(nodes, me, *args) for me in range(len(nodes))), traffic.Traffic())


@pytest.mark.parametrize("n,L", LAYOUTS)
def test_even_groups_match_the_closed_forms(n, L):
    k = n * L
    nodes = traffic.member_nodes(range(k), L)
    piece = 12
    M = k * piece  # the full tensor
    ring_hops = n if n > 1 else 0  # a node-ordered ring crosses every node boundary once
    ag = _total(traffic.all_gather, nodes, piece)
    assert ag.inter == (n - 1) * M
    assert ag.ring == ring_hops * (k - 1) * piece
    assert _total(traffic.reduce_scatter, nodes, piece) == ag  # the same traffic, reversed
    ar = _total(traffic.all_reduce, nodes, M)
    assert (ar.inter, ar.ring) == (2 * (n - 1) * M, 2 * ring_hops * (k - 1) * piece)
    for root in range(k):
        bc = _total(traffic.broadcast, nodes, root, 40)
        assert bc.inter == bc.ring == (n - 1) * 40
        assert bc.inter + bc.intra == (k - 1) * 40  # a chain: k - 1 hops
        assert _total(traffic.reduce, nodes, root, 40) == bc
    # Uneven all-to-all: member i sends i + j + 1 bytes to member j.
    a2a = _total(lambda nd, me: traffic.all_to_all(nd, me, [me + j + 1 for j in range(k)]), nodes)
    foreign = sum(i + j + 1 for i, j in itertools.product(range(k), range(k)) if i // L != j // L)
    assert a2a.inter == a2a.ring == foreign
    # Per node, as sdpq plan counts it.
    for kind, total in (("all_gather", ag), ("all_reduce", ar)):
        closed = traffic.per_node(kind, M, n, L)
        assert closed["least"] * n == pytest.approx(total.inter)
        assert closed["ring"] * n == pytest.approx(total.ring)


def test_ring_over_least_at_the_published_layouts():
    for (n, L), ratio in (((2, 2), 1.5), ((2, 8), 1.875), ((8, 8), 1.125)):
        c = traffic.per_node("all_gather", 1.0, n, L)
        assert c["ring"] / c["least"] == pytest.approx(ratio)


def test_subgroups_and_uneven_membership():
    # One member per node (sdpq's inter-node groups): flat, ring and least agree.
    nodes = traffic.member_nodes([1, 3, 5], 2)
    ag = _total(traffic.all_gather, nodes, 10)
    assert ag.inter == ag.ring == 3 * 2 * 10 and ag.intra == 0
    # A group inside one node never crosses.
    assert _total(traffic.all_gather, traffic.member_nodes([4, 5, 6, 7], 4), 10).inter == 0
    # Three members on two nodes (2 + 1), uneven pieces: each piece enters the other node once.
    nodes = traffic.member_nodes([0, 1, 2], 2)
    ag = _total(traffic.all_gather, nodes, [5, 7, 11])
    assert ag.inter == 5 + 7 + 11
    assert ag.ring == (7 + 11) + (5 + 7)  # hops 1 -> 2 and 2 -> 0 cross, each without the receiver's piece
    rs = _total(traffic.reduce_scatter, nodes, [5, 7, 11])
    assert rs.inter == 5 + 7 + 11


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match="member 3 is not in a group of 2"):
        traffic.all_gather((0, 1), 3, 4)
    with pytest.raises(ValueError, match="3 piece sizes for a group of 2"):
        traffic.all_gather((0, 1), 0, [1, 2, 3])
    with pytest.raises(ValueError, match="kind 'flat'"):
        traffic.per_node("flat", 1, 2, 2)


def test_one_model_serves_the_meter_the_statistics_and_the_plan():
    import sdpq.comm.link_bytes as meter
    import sdpq.comm.stats as stats
    import sdpq.plan.traffic as plan

    for module in (meter, stats, plan):
        assert module.traffic is traffic, module.__name__
