"""What a hostile guest sends the mux is bounded in memory and work: the helpers' capped collector (_mux/capped.py)
and the warm runner's frame reader (_mux/module_runners.py). The real stack: tests/integration/test_hostile_mux.py."""
import queue
import tracemalloc

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import module_runner as wr
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import capped
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import module_runners
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp

LIMIT = capped.HELPER_OUTPUT_LIMIT
MIB = 1024 * 1024


def flood(total, chunk, rc=0):
    """A helper's events: `total` bytes on each stream in `chunk`-byte pieces (one shared piece: no allocation)."""
    piece = b"x" * chunk
    for _dummy in range(total // chunk):
        yield "stdout", piece
        yield "stderr", piece
    yield "exit", ac.ExecResult(rc)


def test_the_collector_keeps_a_few_kib_and_drains_the_rest_without_holding_it():
    tracemalloc.start()
    try:
        result = capped.collect_exec(flood(32 * MIB, 64 * 1024, rc=1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (len(result.stdout), len(result.stderr), result.truncated) == (LIMIT, LIMIT, True)
    assert peak < 512 * 1024, "collecting 64 MiB of output held %d KiB" % (peak // 1024)
    assert capped.message(result).endswith("(output cut at 8 KiB)")


def test_output_within_the_limit_is_whole_and_not_marked():
    result = capped.collect_exec(iter([("stdout", b"a\nb\n"), ("stderr", b"oops"), ("exit", ac.ExecResult(2))]))
    assert (result.stdout, result.stderr, result.truncated) == (b"a\nb\n", b"oops", False)
    assert capped.message(result) == "oops" and capped.complete_lines(result) == ["a", "b"]
    exactly = capped.collect_exec(iter([("stdout", b"y" * LIMIT), ("exit", ac.ExecResult(0))]))
    assert not exactly.truncated


def test_a_cut_listing_loses_only_its_partial_last_line():
    names = b"".join(b"run.tag-%05d-1\n" % i for i in range(2000))  # 30 KB of names
    result = capped.collect_exec(iter([("stdout", names), ("exit", ac.ExecResult(0))]))
    lines = capped.complete_lines(result)
    assert result.truncated and 0 < len(lines) < 2000
    assert all(line == "run.tag-%05d-1" % i for i, line in enumerate(lines))


def frames(count, body_size):
    body = b"o" * body_size
    return b"".join(wr.HEADER.pack(len(body), i, wr.OUT) + body for i in range(1, count + 1))


@pytest.mark.parametrize("chunk", [1, 7, 4096, 64 * 1024])
def test_the_frame_reader_is_linear_whatever_the_chunking(chunk):
    """32 MiB of frames (64 KiB each, as the runner sends a module's output) fed in chunks of 64 KiB down to 1 byte:
    every frame comes out whole, and the bytes moved stay within 3x the bytes fed (the old `buf += data` moved each
    pending byte again on every chunk: about 2 GiB for one 1 MiB frame in 1 KiB chunks)."""
    total = 32 * MIB if chunk >= 4096 else 256 * 1024  # a 1-byte chunk costs a Python call: fewer bytes, same bound
    body_size = 64 * 1024 if chunk >= 4096 else 60 * 1024
    stream = frames(total // (body_size + wr.HEADER.size), body_size)
    reader = module_runners.FrameReader()
    got = []
    view = memoryview(stream)
    for at in range(0, len(stream), chunk):
        got += reader.feed(view[at:at + chunk])
    assert [rid for rid, _kind, _body in got] == list(range(1, len(got) + 1))
    assert len(got) == len(stream) // (body_size + wr.HEADER.size)
    assert all(len(body) == body_size for _rid, _kind, body in got)
    assert reader.copied <= 3 * len(stream), (reader.copied, len(stream))
    assert len(reader.buf) - reader.pos == 0


def test_one_big_frame_in_small_chunks_is_linear():
    body = b"b" * module_runners.FRAME_MAX
    stream = wr.HEADER.pack(len(body), 1, wr.OUT) + body
    reader = module_runners.FrameReader()
    out = []
    for at in range(0, len(stream), 1024):
        out += reader.feed(stream[at:at + 1024])
    assert out == [(1, wr.OUT, body)] and reader.copied <= 3 * len(stream)


def test_an_oversized_header_is_refused_before_its_body():
    reader = module_runners.FrameReader()
    assert reader.feed(wr.HEADER.pack(2, 0, wr.READY) + b"{}") == [(0, wr.READY, b"{}")]
    with pytest.raises(mp.ProtocolError, match="past the 1048576 bytes .*warm_runner"):
        reader.feed(wr.HEADER.pack(0xFFFFFFF0, 1, wr.OUT)[:wr.HEADER.size])
    assert len(reader.buf) <= wr.HEADER.size


class FakeCall:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class FakeClient:
    """A road client whose one exec stream is `chunks` of the runner's stdout; it never ends by itself."""

    label = "box"

    def __init__(self, chunks):
        self.chunks = chunks

    def iter_exec(self, call, feed):
        for chunk in self.chunks:
            yield "stdout", chunk
        yield "stderr", b"e" * 100000


def broken_runner(chunks):
    r = module_runners.ModuleRunner(FakeClient(chunks), "/usr/bin/python3")
    r.call, r.feed, r.alive = FakeCall(), queue.Queue(), True
    waiting = queue.Queue()
    r.pending[1] = waiting
    return r, waiting


@pytest.mark.parametrize("chunks,said", [
    ([wr.HEADER.pack(1 << 31, 1, wr.OUT), b"z" * 65536], "past the 1048576 bytes"),
    ([wr.HEADER.pack(3, 1, wr.EXIT) + b"{no"], "malformed frame"),
    ([wr.HEADER.pack(0, 1, wr.MISS)], "malformed frame"),  # a MISS for a request it never got
])
def test_a_runner_breaking_its_protocol_is_cut_and_its_task_told(chunks, said):
    r, waiting = broken_runner(chunks)
    r._read()
    kind, why = waiting.get_nowait()
    assert kind == "dead" and said in why, why
    assert r.call.cancelled and not r.alive
    assert len(why) < 1500  # the runner's stderr tail, not all of it


def test_a_runner_that_ends_keeps_only_the_tail_of_its_stderr():
    r, waiting = broken_runner([])
    r.client.iter_exec = lambda call, feed: iter([("stderr", b"a" * 10000 + b"TAIL"), ("exit", ac.ExecResult(1))])
    r._read()
    kind, why = waiting.get_nowait()
    assert kind == "dead" and why.endswith("TAIL") and "code 1" in why and not r.call.cancelled


def test_a_lagging_worker_holds_back_the_runner_not_the_mux_and_a_gone_one_frees_it():
    """A task's events wait in the mux at most EVENTS_QUEUED_MAX deep: the runner's stream waits while its worker lags;
    once the worker is gone (abandon) the rest is dropped and the runner goes on."""
    import threading
    out = [wr.HEADER.pack(65536, 1, wr.OUT) + b"o" * 65536 for _dummy in range(200)]  # 12.5 MiB of one task's output
    r, _unused = broken_runner(out + [wr.HEADER.pack(8, 1, wr.EXIT) + b'{"rc":0}'])
    _rid, events = r._new_request()  # request 1 is the runner's first: a real queue, bounded
    r.feed = queue.Queue()
    reader = threading.Thread(target=r._read, daemon=True)
    reader.start()
    reader.join(1.0)
    assert reader.is_alive() and events.qsize() == module_runners.EVENTS_QUEUED_MAX  # held back, not buffered
    assert [events.get_nowait()[0] for _dummy in range(3)] == ["stdout"] * 3  # a worker that reads gets it in order
    r.abandon(1)  # the worker went away
    reader.join(10.0)
    assert not reader.is_alive() and not r.abandoned
    assert [events.get_nowait() for _dummy in range(events.qsize())] == [("exit", 0)]  # its end still reaches the task
