"""A warm runner whose stream ends while no module runs in it (its session deleted) warns of no lost command."""
import logging
import queue

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import module_runners
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.errors import CommandLost


class GoneAgent(object):
    label = "ci-1 (sess-1)"

    def iter_exec(self, call, feed):
        raise CommandLost("lost the command on session ci-1: Socket closed (UNAVAILABLE); it may have partly run "
                          "and is not re-run")
        yield  # a generator, as the real one  # pylint: disable=unreachable


def ended(caplog, pending):
    r = module_runners.ModuleRunner(client=GoneAgent(), interpreter="/usr/bin/python3")
    r.feed = queue.Queue()
    r.alive = True
    events = queue.Queue()
    if pending:
        r.pending[7] = events
    with caplog.at_level(logging.INFO, logger="microvm.mux"):
        r._read()
    assert r.alive is False
    return [(rec.levelno, rec.getMessage()) for rec in caplog.records], events


def test_idle_runner_ending_is_no_warning_and_names_no_lost_command(caplog):
    records, _events = ended(caplog, pending=False)
    assert [level for level, _msg in records] == [logging.INFO]
    assert "lost" not in records[0][1] and "partly run" not in records[0][1]
    assert "ended while no module ran in it" in records[0][1]


def test_a_runner_ending_under_a_module_still_warns_and_fails_it(caplog):
    records, events = ended(caplog, pending=True)
    assert records[0][0] == logging.WARNING and "may have partly run" in records[0][1]
    assert events.get_nowait()[0] == "dead"
