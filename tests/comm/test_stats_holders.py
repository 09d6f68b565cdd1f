"""sdpq.stats.of finds a target's counters through the holders integrations register, not
through attribute names it knows (sdpq.stats names no integration)."""

import pytest

import sdpq.stats
from sdpq.comm.stats import CommStats, holder_stats, register_holder


class _Engine:
    """A framework object that keeps its counters where only its own finder knows."""

    def __init__(self):
        self.counters = CommStats()


def _find(target):
    return target.counters if isinstance(target, _Engine) else None


def test_a_registered_holder_is_found_and_others_are_refused():
    engine = _Engine()
    with pytest.raises(TypeError, match="_Engine has no sdpq statistics"):
        sdpq.stats.of(engine)
    register_holder(_find)
    register_holder(_find)  # once is kept
    assert sdpq.stats.of(engine) is engine.counters is holder_stats(engine)
    engine.counters.record("weights", "inter", bytes=100, elements=50)
    assert sdpq.stats.summary(engine)[1]["weights"]["inter"]["bytes"] == 100
    sdpq.stats.reset(engine)
    assert sdpq.stats.summary(engine)[1] == {}
    assert holder_stats(object()) is None
    with pytest.raises(TypeError, match="object has no sdpq statistics"):
        sdpq.stats.of(object())


def test_the_integrations_register_their_holders():
    pytest.importorskip("deepspeed")
    import sdpq.integrations._ds_adapter as ds
    import sdpq.integrations._fsdp_hooks as fsdp
    from sdpq.comm import stats

    assert fsdp._model_stats in stats._HOLDERS and ds._engine_stats in stats._HOLDERS
