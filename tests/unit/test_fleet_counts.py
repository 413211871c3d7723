"""bench/fleet_counts.py: what the fleet bench counts per session (link opens, warm-runner starts, ControlMasters)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

import fleet_counts  # noqa: E402

A = "0b6f8a52-4c1e-4d7a-9a51-3c2f0e9d1a11"
B = "7d1c2e3f-aaaa-4bbb-8ccc-123456789abc"
LOG = """\
2026-12-05 18:00:00,001 INFO session fleet-000 (%(a)s): link 1 open
2026-12-05 18:00:00,101 INFO session fleet-000 (%(a)s): warm runner for /usr/bin/python3 started in the guest (python 3.11, pid 7)
2026-12-05 18:00:00,201 INFO session fleet-001 (%(b)s): link 1 open
2026-12-05 18:01:10,001 INFO session fleet-000 (%(a)s): link 2 open
2026-12-05 18:01:10,101 INFO session fleet-000 (%(a)s): warm runner for /bin/py started in the guest on the api road (python 3.11, pid 9)
2026-12-05 18:01:11,000 INFO session fleet-001 (%(b)s): link 1 opened elsewhere, not an open
""" % {"a": A, "b": B}


def test_log_lines_count_per_session_id():
    counts = fleet_counts.count_log_lines(LOG.splitlines(True))
    assert counts["link_opens"] == {A: 2, B: 1}
    assert counts["runner_starts"] == {A: 2}


def test_mux_logs_of_every_process_dir_are_read(tmp_path):
    lines = LOG.splitlines(True)
    for name, part in (("mux-0-1-x", lines[:3]), ("mux-0-2-x", lines[3:])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mux.log").write_text("".join(part))
    assert fleet_counts.mux_log_counts(str(tmp_path))["link_opens"] == {A: 2, B: 1}


def test_a_runs_count_is_after_minus_before_and_the_spread_names_outliers():
    run = fleet_counts.per_key({A: 1}, {A: 3, B: 1}, [A, B, "never-seen"])
    assert run == {A: 2, B: 1, "never-seen": 0}
    spread = fleet_counts.spread(run)
    assert (spread["min"], spread["median"], spread["max"]) == (0, 1, 2)
    assert (spread["more_than_1"], spread["none"], spread["total"], spread["keys"]) == (1, 1, 3, 3)


def test_ssh_masters_are_the_mux_titles_under_the_control_dir():
    procs = {
        10: (1, "ssh", "ssh: /w/ssh/cp-h000 [mux]" + " " * 40),           # a master: its title, padded
        11: (1, "ssh", "ssh: /other/ssh/cp-h000 [mux]"),                 # another bench's master
        12: (5, "ssh", "ssh -o ControlPath=/w/ssh/cp-h001 root@127.0.0.1"),  # a client of the run
    }
    assert fleet_counts.ssh_masters(procs, "/w/ssh") == {10: "/w/ssh/cp-h000"}
