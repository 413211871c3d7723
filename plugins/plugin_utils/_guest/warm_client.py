# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The api road's way into a warm module runner: a small client run by each task's buffered exec, in the guest.

`<python> -I -S -c <this file's source> <socket> <job dir> <slice> <inline> <marker> [<seconds to wait for
the socket>]`, its stdin the mux's frames (module_runner.py's protocol). It connects to the runner's socket
(module_runner.py, socket mode), sends them, and reads the runner's frames until every request in them has
its last frame (and READY came). It answers like the job script (_guest/api_job.sh), so the road follows it
with the same code (api_exec.Jobs):

- everything within the slice and under `inline` bytes: the frames base64 on stdout, and on stderr the
  marker's `done 0 <bytes> 0 0`: one exec, no job dir left, no other process;
- else it hands over: a forked keeper goes on reading the socket into <job dir>/out and writes <job dir>/rc
  at the end, and the answer is `running 0 0`; the road then polls, downloads or kills it with the job
  script as any job. The client leads its own process group (its pid in <job dir>/pid from the start), the
  keeper in it: the road's kill stops either, which closes the connection, and the runner kills the modules
  it started.

No runner at the socket: exit code 3 and a message (with the end of the runner's log when it was just started
and exited), nothing sent (the road runs the task cold).
Stdlib only, no site (-I -S): it starts in a few ms. Python 3.6+.
"""

import base64
import os
import select
import socket
import struct
import sys
import time

HEADER = struct.Struct("!IIB")
ASKS = (1, 3, 4)             # RUN, RUNREF, TMP: requests that get a last frame
READY = 10
LAST = (14, 15, 16, 17)      # EXIT, REFUSE, MISS, DONE
NO_RUNNER = 3
RUNNER_PID_ENV = "MICROVM_WARM_RUNNER_PID"  # set by the road's launch: the runner it just started (this client's child)


class Frames:
    """What the runner has sent: the bytes, and which requests still wait for their last frame."""

    def __init__(self, waiting: "set") -> None:
        self.data = bytearray()
        self.pos = 0
        self.waiting = waiting
        self.ready = False

    def feed(self, chunk: bytes) -> None:
        self.data += chunk
        while len(self.data) - self.pos >= HEADER.size:
            length, rid, kind = HEADER.unpack_from(self.data, self.pos)
            if len(self.data) - self.pos < HEADER.size + length:
                break
            self.pos += HEADER.size + length
            if kind == READY:
                self.ready = True
            elif kind in LAST:
                self.waiting.discard(rid)

    def over(self) -> bool:
        return self.ready and not self.waiting


def asks(frames: bytes) -> "set":
    waiting, pos = set(), 0
    while len(frames) - pos >= HEADER.size:
        length, rid, kind = HEADER.unpack_from(frames, pos)
        pos += HEADER.size + length
        if kind in ASKS:
            waiting.add(rid)
    return waiting


def connect(path: str, wait: float, job: str) -> socket.socket:
    """A connection to the runner; waiting up to `wait` s for one just started (its pid in RUNNER_PID_ENV, our child)."""
    deadline = time.monotonic() + wait
    starting = int(os.environ.get(RUNNER_PID_ENV) or 0)
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except OSError as e:
            conn.close()
            ended = False
            if starting:
                try:
                    ended = os.waitpid(starting, os.WNOHANG)[0] != 0
                except OSError:
                    ended = True
            if ended or time.monotonic() >= deadline:
                drop(job)
                sys.stderr.write("microvm warm client: no warm runner at %s (%s)%s\n"
                                 % (path, "it exited" if ended else e, log_tail(os.path.join(os.path.dirname(path), "log"))))
                sys.exit(NO_RUNNER)
            time.sleep(0.02)


def log_tail(path: str) -> str:
    """The end of the runner's stderr (its log), for the message when it could not start."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 500))
            text = f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return "; its stderr: " + text if text else ""


def keep(conn: socket.socket, frames: Frames, job: str) -> None:
    """The keeper: the rest of the runner's answer into the job dir, as the job script's jobs leave theirs."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)  # the exec's answer ends with the client, not with the keeper
    rc = 1  # the answer ended before every request had its last frame: the road says the runner was lost
    with open(os.path.join(job, "out"), "ab") as out:
        out.write(frames.data)
        out.flush()
        while not frames.over():
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            frames.feed(chunk)
            out.write(chunk)
            out.flush()
        else:
            rc = 0
    with open(os.path.join(job, "rc.t"), "w") as f:
        f.write("%d\n" % rc)
    os.rename(os.path.join(job, "rc.t"), os.path.join(job, "rc"))


def main() -> None:
    path, job, slice_s, inline, marker = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    wait = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    request = sys.stdin.buffer.read()
    frames = Frames(asks(request))
    try:
        os.setsid()  # its own process group, which the road's kill stops (the keeper's too, after a hand-over)
    except OSError:
        pass  # already a group leader
    os.makedirs(job)
    with open(os.path.join(job, "pid"), "w") as f:
        f.write("%d\n" % os.getpid())
    conn = connect(path, wait, job)
    conn.sendall(request)
    deadline = time.monotonic() + slice_s
    ended = False  # the runner hung up: its requests without a last frame are lost (the road says so)
    while not frames.over() and len(frames.data) <= inline:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([conn], [], [], left)[0]:
            break
        chunk = conn.recv(1 << 16)
        if not chunk:
            ended = True
            break
        frames.feed(chunk)
    if len(frames.data) <= inline and (frames.over() or ended):
        drop(job)
        sys.stdout.write(base64.b64encode(bytes(frames.data)).decode("ascii"))
        sys.stderr.write("\n%s done 0 %d 0 0\n" % (marker, len(frames.data)))
        return
    for name in ("out", "err"):
        open(os.path.join(job, name), "wb").close()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:
        try:
            keep(conn, frames, job)
        finally:
            os._exit(0)
    conn.close()
    sys.stderr.write("\n%s running 0 0\n" % marker)


def drop(job: str) -> None:
    for name in ("pid", ""):
        try:
            os.rmdir(job) if not name else os.unlink(os.path.join(job, name))
        except OSError:
            pass  # the road's kill got there first: its drop removes the rest


if __name__ == "__main__":
    main()
