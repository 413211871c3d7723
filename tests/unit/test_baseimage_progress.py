# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The base image build says what it does as it goes: a stage line on stderr as each stage starts (issue 42).

debootstrap and chroot are stand-ins on PATH: the stand-in debootstrap prints debootstrap's own "I:" lines and
holds in its download stage until the test lets it go, so the lines are proven to arrive before the build ends.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from microvm_localplane import baseimage

FAKE_DEBOOTSTRAP = r"""#!/bin/sh
for target; do :; done
echo "I: Retrieving InRelease"
echo "I: Validating Packages"
echo "I: Retrieving libc6 2.36"
while [ ! -e "$FAKE_RELEASE" ]; do sleep 0.05; done
echo "I: Resolving dependencies of required packages..."
echo "I: Extracting base-files..."
echo "I: Installing core packages..."
echo "I: Unpacking required packages..."
echo "I: Configuring required packages..."
for d in usr/bin usr/lib/python3.11/ensurepip etc/ssl/certs etc/sudoers.d tmp var/tmp var/cache/apt/archives \
         var/lib/apt/lists; do mkdir -p "$target/$d"; done
touch "$target/usr/bin/python3.11" "$target/usr/lib/python3.11/ensurepip/__init__.py" "$target/usr/bin/git" \
      "$target/etc/ssl/certs/ca-certificates.crt"
echo "I: Base system installed successfully."
"""


def stub_bin(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("debootstrap", FAKE_DEBOOTSTRAP), ("chroot", "#!/bin/sh\nexit 0\n")):
        path = bindir / name
        path.write_text(text)
        path.chmod(0o755)
    return bindir


def read_line(stream, proc, timeout=120.0):
    """The next stderr line, waiting at most `timeout` (a hung build fails the test instead of hanging it; generous:
    a loaded machine starts Python and the plane package slowly)."""
    import select
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _w, _x = select.select([stream], [], [], 0.2)
        if ready:
            return stream.readline()
    pytest.fail("no progress line within %ss (process exit %r)" % (timeout, proc.poll()))


def test_stage_lines_arrive_in_order_while_the_build_runs(tmp_path, monkeypatch):
    monkeypatch.setenv(baseimage.CACHE_ENV, str(tmp_path / "cache"))
    release = tmp_path / "release"
    env = dict(os.environ, PATH="%s:%s" % (stub_bin(tmp_path), os.environ["PATH"]), FAKE_RELEASE=str(release),
               PYTHONUNBUFFERED="1")
    env[baseimage.CACHE_ENV] = str(tmp_path / "cache")
    proc = subprocess.Popen([sys.executable, "-m", "microvm_localplane.baseimage", "--state-dir", str(tmp_path / "st")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        early = []
        while not early or "debootstrap: download" not in early[-1]:
            line = read_line(proc.stderr, proc)
            assert line, "stderr ended early: %r" % early
            early.append(line.rstrip("\n"))
        # The build is held in its download stage: these lines came while it runs, not at the end.
        assert proc.poll() is None
        assert early[-2].startswith("base image: debootstrap: start (")
        assert early[-1].startswith("base image: debootstrap: download (")
        state = baseimage.progress_path(str(tmp_path / "st"))
        # the current stage is on record for a plane that tells a waiting session about it
        assert "now at: debootstrap: download" in (baseimage.pending_note(str(tmp_path / "st")) or "")
        release.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the stand-in debootstrap too: it would wait for `release` forever
            proc.wait()
    assert proc.returncode == 0, err
    stages = [line.rsplit(" (", 1)[0].replace("base image: ", "") for line in err.splitlines() if line.startswith("base image: ")]
    # a slow machine may add the held stage's heartbeat ("..., still") after it was read: not a stage of its own
    stages = [stage for stage in stages if not stage.endswith(", still")]
    assert stages == [
        "debootstrap: resolve dependencies", "debootstrap: extract", "debootstrap: install core packages",
        "debootstrap: unpack", "debootstrap: configure", "debootstrap: base system installed",
        "finish (sandbox user, sudo)", "done"]
    assert "base template built in" in err
    assert out.strip().endswith("/rootfs")
    assert not os.path.exists(state)   # no stale stage once the build ended

    # Built: a second run is quiet on stderr (nothing to wait for), the path on stdout as before.
    again = subprocess.run([sys.executable, "-m", "microvm_localplane.baseimage", "--state-dir", str(tmp_path / "st")],
                           capture_output=True, text=True, env=env, timeout=60, check=True)
    assert again.stderr == "" and again.stdout.strip() == out.strip()


@pytest.mark.parametrize("line, stage", [
    ("I: Retrieving InRelease", "debootstrap: download"),
    ("I: Validating Packages", "debootstrap: download"),
    ("I: Extracting libc6...", "debootstrap: extract"),
    ("I: Configuring the base system...", "debootstrap: configure"),
    ("I: Something new", None),
    ("W: Retrieving", None),
    ("I: ", None),
    ("", None),
])
def test_debootstrap_stage(line, stage):
    assert baseimage.debootstrap_stage(line) == stage


def test_progress_line():
    assert baseimage.progress_line("debootstrap: download", 12.4) == "base image: debootstrap: download (12 s)"


def test_heartbeat_while_a_stage_lasts(tmp_path, monkeypatch):
    monkeypatch.setenv(baseimage.CACHE_ENV, str(tmp_path / "cache"))
    os.makedirs(os.path.dirname(baseimage.progress_path(str(tmp_path))))
    heard = []
    clock = [100.0]
    monkeypatch.setattr(baseimage.time, "monotonic", lambda: clock[0])
    stages = baseimage._Stages(str(tmp_path), lambda stage, elapsed: heard.append((stage, elapsed)))
    stages("debootstrap: download")
    clock[0] += 10
    stages.beat()
    stages("debootstrap: download")       # the same stage again: no new line before the heartbeat is due
    clock[0] += baseimage.HEARTBEAT
    stages.beat()
    stages("debootstrap: extract")
    assert heard == [("debootstrap: download", 0.0), ("debootstrap: download, still", 10 + baseimage.HEARTBEAT),
                     ("debootstrap: extract", 10 + baseimage.HEARTBEAT)]
