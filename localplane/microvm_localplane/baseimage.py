"""The built-in `base` template: a Debian bookworm root filesystem of its own, built once and cached.

`debootstrap --variant=minbase --include=<PACKAGES> bookworm DIR` with
Debian's configured sources (no mirror argument), then a few settings a guest
needs (see _finish). PACKAGES is what a CI job expects of a minimal Debian
image: Python with venv and pip (`python3 -m venv` needs ensurepip, which
Debian ships in python3-venv), CA certificates (pip and git over TLS) and git. Built under a lock in the cache dir, so that concurrent
planes (tests, several engineers) build it once; the result is renamed into
place only when complete.

Cache dir: $MICROVM_LOCALPLANE_CACHE, else <state dir>/cache. The repo's
Makefile and test fixtures point it at the machine's shared cache
(~/.cache/microvm-sandbox/localplane) so every clone and every plane builds it
once. The rootfs dir is named by a digest of its recipe (recipe_digest: the
suite, the packages, VERSION, _finish's source and the constants it uses): a
changed recipe builds anew, beside the old one.
"""
import fcntl
import hashlib
import inspect
import os
import select
import shutil
import subprocess
import sys
import time
from typing import Callable, IO

SUITE = "bookworm"
PACKAGES = ("python3", "sudo", "python3-venv", "python3-pip", "ca-certificates", "git")
VERSION = "3"                     # part of the recipe digest (recipe_digest), for a change the digest cannot see
# (2: root's home is /workspace/home; 3: venv, pip, CA certificates, git). ready() also checks READY_FILES:
# a build without them is never taken for this one.
CACHE_ENV = "MICROVM_LOCALPLANE_CACHE"
BUILD_TIMEOUT = 1800
# The unprivileged user a guest's commands can switch to, with a password: `become` with sudo and su.
GUEST_USER = "sandbox"
GUEST_UID = 1000
ROOT_HOME = "/workspace/home"     # the agent's HOME (agent.HOME): root's passwd entry says the same
# The session variables (secrets, or env) that give that user and root a password at every boot (the agent sets
# them), so that become with sudo (the user's own password) and su (root's) can be answered. Without them a
# password stays as the template has it: this one's are locked. (Decision: the platform documents no such user.)
ACCOUNT_PASSWORD_VARS = (("SANDBOX_USER_PASSWORD", GUEST_USER), ("SANDBOX_ROOT_PASSWORD", "root"))


class BaseImageError(Exception):
    pass


def cache_dir(state_dir):
    return os.path.abspath(os.environ.get(CACHE_ENV) or os.path.join(state_dir, "cache"))


_digests = {}


def recipe_digest():
    """12 hex of a sha256 over what makes the rootfs: SUITE, PACKAGES, VERSION, _finish's source, its constants."""
    recipe = (SUITE, tuple(PACKAGES), VERSION, _finish, ROOT_HOME, GUEST_USER, GUEST_UID)
    if recipe not in _digests:
        try:
            finish = inspect.getsource(_finish)
        except (OSError, TypeError):   # no source at hand: its byte code and constants
            finish = repr((_finish.__code__.co_code, _finish.__code__.co_consts))
        h = hashlib.sha256()
        for part in (SUITE, "\0".join(PACKAGES), VERSION, finish, ROOT_HOME, GUEST_USER, str(GUEST_UID)):
            data = part.encode()
            h.update(b"%d:" % len(data) + data)
        _digests[recipe] = h.hexdigest()[:12]
    return _digests[recipe]


def rootfs_path(state_dir):
    return os.path.join(cache_dir(state_dir), "base-%s-%s" % (SUITE, recipe_digest()), "rootfs")


# Files that prove a complete build of this recipe (the build is renamed into place only when complete).
READY_FILES = (("usr", "bin", "python3.11"), ("usr", "lib", "python3.11", "ensurepip", "__init__.py"),
               ("usr", "bin", "git"), ("etc", "ssl", "certs", "ca-certificates.crt"))


def ready(state_dir):
    root = rootfs_path(state_dir)
    return all(os.path.isfile(os.path.join(root, *parts)) for parts in READY_FILES)


def build_log_path(state_dir: str) -> str:
    """debootstrap's output while the base rootfs is built."""
    return os.path.join(os.path.dirname(rootfs_path(state_dir)), "build.log")


def pending_note(state_dir: str) -> str | None:
    """What a user waiting on the first `base` session should read, or None once the rootfs is built."""
    if ready(state_dir):
        return None
    stage = current_stage(state_dir)
    return ("the local control plane builds the `base` template's Debian %s root filesystem before this session "
            "boots (once per cache dir, about a minute%s); debootstrap's log: %s"
            % (SUITE, "; now at: %s" % stage if stage else "", build_log_path(state_dir)))


# Progress of a build: a line per stage, and one every HEARTBEAT seconds while a stage goes on (a silent
# two-minute step looks hung). debootstrap's own "I: <Verb> ..." lines name its stages; the verbs map to a few
# coarse ones, since it alternates Retrieving/Validating per package.
HEARTBEAT = 30.0
DEBOOTSTRAP_STAGES = {
    "Retrieving": "download", "Validating": "download", "Checking": "download", "Valid": "download",
    "Found": "download", "Resolving": "resolve dependencies", "Extracting": "extract",
    "Installing": "install core packages", "Unpacking": "unpack", "Configuring": "configure",
    "Base": "base system installed",
}
Progress = Callable[[str, float], None]   # (stage, seconds since the build started)


def progress_line(stage: str, elapsed: float) -> str:
    """The line the CLI prints for a stage: `base image: <stage> (<n> s)`."""
    return "base image: %s (%.0f s)" % (stage, elapsed)


def debootstrap_stage(line: str) -> str | None:
    """The coarse stage an "I: <Verb> ..." line of debootstrap starts, or None (other lines, unknown verbs)."""
    if not line.startswith("I: "):
        return None
    words = line[3:].split(None, 1)
    stage = DEBOOTSTRAP_STAGES.get(words[0]) if words else None
    return "debootstrap: %s" % stage if stage else None


def progress_path(state_dir: str) -> str:
    """The stage a build is at, for pending_note (a plane that builds on demand, or another one waiting)."""
    return os.path.join(os.path.dirname(rootfs_path(state_dir)), "progress")


def current_stage(state_dir: str) -> str | None:
    try:
        with open(progress_path(state_dir)) as f:
            return f.read().strip() or None
    except OSError:
        return None


class _Stages:
    """Reports each new stage (and a heartbeat while one lasts) to `progress`, and records it in the progress file."""

    def __init__(self, state_dir: str, progress: Progress | None) -> None:
        self.path = progress_path(state_dir)
        self.progress = progress
        self.started = time.monotonic()
        self.stage: str | None = None
        self.said = self.started

    def __call__(self, stage: str) -> None:
        if stage == self.stage:
            if time.monotonic() - self.said >= HEARTBEAT:
                self._say(stage + ", still")
            return
        self.stage = stage
        # Recorded before it is said: whoever sees the line finds the same stage on record.
        try:
            with open(self.path + ".new", "w") as f:   # renamed over: a reader never sees it half written
                f.write("%s since %.0f s into the build\n" % (stage, self.elapsed()))
            os.replace(self.path + ".new", self.path)
        except OSError:
            pass   # the record is a courtesy to other readers; the build goes on
        self._say(stage)

    def beat(self) -> None:
        if self.stage is not None:
            self(self.stage)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _say(self, text: str) -> None:
        self.said = time.monotonic()
        if self.progress is not None:
            self.progress(text, self.elapsed())

    def done(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


def ensure(state_dir, log=lambda msg: None, progress: Progress | None = None):
    """-> the base rootfs dir, building it first if needed (minutes, once per cache dir).

    `progress(stage, elapsed)` hears of every stage of a build (nothing when the rootfs is ready).
    """
    path = rootfs_path(state_dir)
    if ready(state_dir):
        return path
    top = os.path.dirname(path)
    os.makedirs(top, exist_ok=True)
    stages = _Stages(state_dir, progress)
    with open(os.path.join(top, ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # another plane (or make) is building it: say so, then wait for that one
            stages("waiting for another build (%s)" % (current_stage(state_dir) or "stage unknown"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        if ready(state_dir):
            if stages.stage is not None:
                stages("built by the other build")
            return path
        build = os.path.join(top, "build")
        shutil.rmtree(build, ignore_errors=True)
        if not shutil.which("debootstrap"):
            raise BaseImageError("the `base` template needs debootstrap: apt-get install debootstrap "
                                 "(or `make system-deps`)")
        log("building the base template's Debian %s root filesystem (once; a few minutes); log: %s"
            % (SUITE, build_log_path(state_dir)))
        try:
            _build(state_dir, build, path, stages)
        finally:
            stages.done()   # no stale stage for pending_note once this build ended, either way
        log("base template built in %.0f s" % stages.elapsed())
    return path


def _build(state_dir: str, build: str, path: str, stages: _Stages) -> None:
    """debootstrap into `build`, finish it, rename it to `path`; each stage told to `stages`."""
    stages("debootstrap: start")
    argv = ["debootstrap", "--variant=minbase", "--include=" + ",".join(PACKAGES), SUITE, build]
    with open(build_log_path(state_dir), "wb") as out:
        code = _run_debootstrap(argv, out, stages)
    if code != 0:
        raise BaseImageError("debootstrap failed (exit %d); see %s"
                             % (code, build_log_path(state_dir)))
    stages("finish (sandbox user, sudo)")
    _finish(build)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(build, path)
    stages("done")


def _run_debootstrap(argv: list[str], out: IO[bytes], stages: _Stages) -> int:
    """Run debootstrap, its output to `out`, its stages to `stages` as they start. -> its exit code."""
    deadline = time.monotonic() + BUILD_TIMEOUT
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    pending = b""
    try:
        while True:
            if time.monotonic() >= deadline:
                raise BaseImageError("debootstrap took more than %d s; see %s" % (BUILD_TIMEOUT, out.name))
            # a timeout, so that a stage that prints nothing for long still gets its heartbeat
            readable, _w, _x = select.select([proc.stdout], [], [], 1.0)
            if not readable:
                stages.beat()
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out.write(chunk)
            out.flush()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                stage = debootstrap_stage(line.decode("utf-8", "replace"))
                if stage:
                    stages(stage)
                else:
                    stages.beat()
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _finish(root):
    """What a guest needs beyond minbase: an empty /tmp, no host resolver, the sandbox user, sudo for it."""
    for d in ("tmp", "var/tmp"):
        p = os.path.join(root, d)
        shutil.rmtree(p, ignore_errors=True)
        os.mkdir(p)
        os.chmod(p, 0o1777)
    for leftover in ("etc/resolv.conf", "etc/hostname"):
        try:
            os.unlink(os.path.join(root, leftover))
        except FileNotFoundError:
            pass
    for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in os.listdir(os.path.join(root, d)):
            p = os.path.join(root, d, entry)
            if os.path.isfile(p) and not entry.startswith("lock"):
                os.unlink(p)
    # root's home is the platform's HOME (the agent's, /workspace/home), as in the images the template_image role
    # builds: `~`, HOME, sudo's and su's HOME and ansible_user_dir then name one directory.
    subprocess.run(["chroot", root, "usermod", "--home", ROOT_HOME, "root"], check=True, capture_output=True)
    subprocess.run(["chroot", root, "useradd", "--create-home", "--uid", str(GUEST_UID), "--user-group",
                    "--shell", "/bin/bash", GUEST_USER], check=True, capture_output=True)
    # The sandbox user may sudo, with its password (locked here; a session sets it: ACCOUNT_PASSWORD_VARS).
    with open(os.path.join(root, "etc", "sudoers.d", GUEST_USER), "w") as f:
        f.write("%s ALL=(ALL:ALL) ALL\n" % GUEST_USER)
    os.chmod(os.path.join(root, "etc", "sudoers.d", GUEST_USER), 0o440)


def main(argv=None):
    """`python -m microvm_localplane.baseimage [--state-dir DIR]`: build the base rootfs now (setup does)."""
    import argparse

    parser = argparse.ArgumentParser(description="build the base template's Debian rootfs once")
    parser.add_argument("--state-dir", default=os.path.join(os.getcwd(), ".local", "plane"),
                        help="used for the cache dir when MICROVM_LOCALPLANE_CACHE is not set")
    args = parser.parse_args(argv)

    # Progress on stderr, flushed per line (make and a terminal show it as it comes); stdout keeps only the path.
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        print(ensure(args.state_dir, log=say, progress=lambda stage, elapsed: say(progress_line(stage, elapsed))))
    except BaseImageError as e:
        raise SystemExit("base template: %s" % e) from e


if __name__ == "__main__":
    main()
