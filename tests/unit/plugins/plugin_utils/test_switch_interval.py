"""The mux's GIL switch interval rule (_mux/switch_interval.py) on its own: counts, hold, fixed values."""
import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import switch_interval as si


def make(fixed=None):
    now, seen = [0.0], []
    return si.SwitchInterval(fixed, setter=seen.append, clock=lambda: now[0]), now, seen


def test_one_request_at_a_time_keeps_the_long_interval():
    rule, now, seen = make()
    for _dummy in range(5):
        rule.enter()
        now[0] += 0.05
        rule.leave()
    assert seen == [si.LONG]


def test_two_in_flight_short_then_long_after_the_hold():
    rule, now, seen = make()
    rule.enter()
    rule.enter()
    assert seen[-1] == si.SHORT
    rule.leave()
    rule.leave()
    now[0] += si.HOLD - 0.1
    rule.enter()  # within the hold: a neighbour's next command still gets the short interval
    assert seen[-1] == si.SHORT
    rule.leave()
    now[0] += si.HOLD + 0.1
    rule.enter()
    assert seen[-1] == si.LONG and seen.count(si.SHORT) == 1
    rule.leave()
    assert rule.in_flight == 0


def test_a_fixed_interval_is_set_once_and_never_changed():
    rule, _now, seen = make(fixed=0.0005)
    rule.enter()
    rule.enter()
    rule.leave()
    rule.leave()
    assert seen == [0.0005]


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), ("adaptive", None), ("0.005", 0.005),
                                             ("0.0005", 0.0005), ("fast", None), ("0", None), ("5", None)])
def test_the_environment_switch(value, expected):
    assert si.fixed_interval(value) == expected
