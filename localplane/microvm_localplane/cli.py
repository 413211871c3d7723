"""`python -m microvm_localplane serve | up | down | status`: run, start in the background, stop, list.

The running server writes DIR/plane.json (url and pid, no token) once it
answers; `up` and `down` and the pytest fixture find it there. The token lives
in DIR/token, mode 0600.
"""
import argparse
import asyncio
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from . import contract
from .store import write_json_atomic

DEFAULT_LISTEN = "127.0.0.1:8787"
START_TIMEOUT = 60
STOP_TIMEOUT = 60


def info_path(state_dir):
    return os.path.join(state_dir, "plane.json")


def token_path(state_dir):
    return os.path.join(state_dir, "token")


def load_or_make_token(state_dir, given=None):
    path = token_path(state_dir)
    if given:
        token = given
    elif os.path.exists(path):
        with open(path) as f:
            token = f.read().strip()
    else:
        token = contract.new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def parse_listen(text):
    host, sep, port = text.rpartition(":")
    if not sep:
        raise SystemExit("--listen must be HOST:PORT, got %r" % text)
    host = host.strip("[]") or "127.0.0.1"
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit("--listen %s: the local control plane only listens on loopback (127.0.0.1 or ::1)" % text)
    try:
        return host, int(port)
    except ValueError as e:
        raise SystemExit("--listen port must be a number, got %r" % port) from e


def read_info(state_dir):
    try:
        with open(info_path(state_dir)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child is not alive.
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def answers(url, token, timeout=2.0):
    req = urllib.request.Request(url + contract.PREFIXES[0] + "/sessions?page_size=1",
                                 headers={"Authorization": "Bearer " + token})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# -- serve --------------------------------------------------------------------------
async def serve_forever(args):
    from aiohttp import web

    from .server import Plane, make_app

    state_dir = os.path.abspath(args.state_dir)
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    lock = open(os.path.join(state_dir, "plane.lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        raise SystemExit("another local control plane is already serving %s (see %s)" % (state_dir, info_path(state_dir))) from e
    host, port = parse_listen(args.listen)
    token = load_or_make_token(state_dir, args.token)
    plane = Plane(state_dir, token, archive_limits=archive_limits(args), disk_reserve=args.disk_reserve,
                  warm_pool=warm_pool_settings(args))
    app = make_app(plane)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = runner.addresses[0][1]
    url = "http://%s:%d" % ("[%s]" % host if ":" in host else host, bound)
    write_json_atomic(info_path(state_dir), {"url": url, "pid": os.getpid(), "state_dir": state_dir})
    print("microvm local control plane listening on %s (state %s)" % (url, state_dir), flush=True)
    if args.print_token:
        print("%s=%s\n%s=%s" % (contract.API_URL_ENV, url, contract.API_TOKEN_ENV, token), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("microvm_localplane").info("stopping: closing connections and stopping guests")
    with contextlib.suppress(OSError):
        os.unlink(info_path(state_dir))
    await site.stop()  # no new connections; open port-forwards are closed with 4001 by plane.stop
    await plane.stop(stop_guests=True)
    await runner.cleanup()
    lock.close()


def cmd_serve(args):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve_forever(args))
    return 0


# -- up -------------------------------------------------------------------------------
def port_free(host, port):
    """Can serve bind host:port? With SO_REUSEADDR, as serve binds: a crashed plane's TIME-WAIT leftovers don't count."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def write_env_file(path, url, token):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("export %s=%s\nexport %s=%s\n" % (contract.API_URL_ENV, url, contract.API_TOKEN_ENV, token))
    os.chmod(path, 0o600)


def running_plane(state_dir):
    """(url, token) of a plane already serving this state dir, or None."""
    info = read_info(state_dir)
    if not info or not pid_alive(info.get("pid", -1)):
        return None
    try:
        with open(token_path(state_dir)) as f:
            token = f.read().strip()
    except OSError:
        return None
    return (info["url"], token) if answers(info["url"], token) else None


def cmd_up(args):
    state_dir = os.path.abspath(args.state_dir)
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    found = running_plane(state_dir)
    if found:
        url, token = found
        print("reusing the local control plane already running at %s" % url)
    else:
        with contextlib.suppress(OSError):
            os.unlink(info_path(state_dir))
        token = load_or_make_token(state_dir, args.token)
        host, port = parse_listen(args.listen or DEFAULT_LISTEN)
        if port and not port_free(host, port):
            if args.listen:
                # Surviving multiplexers and sourced env files name this port: never move it.
                print("--listen %s: port %d is in use by another process; stop it or name another port "
                      "(a port given with --listen is never replaced)" % (args.listen, port))
                return 1
            print("port %d is busy; using a free port instead" % port)
            port = 0
        listen = "%s:%d" % (host, port)
        log_path = os.path.join(state_dir, "plane.log")
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
            child = subprocess.Popen(
                [sys.executable, "-m", "microvm_localplane", "serve", "--listen", listen, "--state-dir", state_dir,
                 "--no-print-token"] + archive_limit_argv(args) + disk_reserve_argv(args) + warm_pool_argv(args),
                stdin=devnull, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, close_fds=True)
        deadline = time.time() + START_TIMEOUT
        url = None
        while time.time() < deadline:
            if child.poll() is not None:
                print("the local control plane exited with code %s; last lines of %s:" % (child.returncode, log_path))
                with open(log_path, "rb") as f:
                    sys.stdout.write(f.read()[-3000:].decode("utf-8", "replace"))
                return 1
            info = read_info(state_dir)
            if info and info.get("pid") == child.pid and answers(info["url"], token):
                url = info["url"]
                break
            time.sleep(0.1)
        if url is None:
            print("the local control plane did not answer within %ds; see %s" % (START_TIMEOUT, log_path))
            return 1
        print("started the local control plane at %s (pid %d, log %s)" % (url, child.pid, log_path))
        from .baseimage import pending_note
        from .sessions import guest_state_dir
        note = pending_note(guest_state_dir(state_dir))
        if note:
            print("note: %s" % note.replace("before this session boots", "when the first session on it boots"))
    if args.env_file:
        write_env_file(args.env_file, url, token)
        print("wrote %s: source it to point the collection at the local plane" % args.env_file)
    return 0


# -- down -----------------------------------------------------------------------------
def wait_gone(pid, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return not pid_alive(pid)


def stop_plane_process(pid, timeout=STOP_TIMEOUT):
    """SIGTERM (the server stops every guest), then SIGKILL its process group if it hangs.

    Returns "stopped", "killed" or "stuck".
    """
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if wait_gone(pid, timeout):
        return "stopped"
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return "killed" if wait_gone(pid, 5) else "stuck"


def stop_orphan_guests(state_dir):
    """After a hard kill, stop the guests the state still knows, from their persistent state."""
    from .guests import GuestManager
    from .sessions import guest_state_dir
    from .store import Store

    async def run():
        guests = GuestManager(guest_state_dir(state_dir))
        for sid in list(Store(state_dir).sessions):
            with contextlib.suppress(Exception):
                await guests.stop(sid)
        await guests.shutdown(True)

    asyncio.run(run())


def cmd_down(args):
    state_dir = os.path.abspath(args.state_dir)
    info = read_info(state_dir)
    if not info or not pid_alive(info.get("pid", -1)):
        print("no local control plane is running for %s" % state_dir)
        with contextlib.suppress(OSError):
            os.unlink(info_path(state_dir))
        return 0
    pid = info["pid"]
    outcome = stop_plane_process(pid)
    if outcome == "stuck":
        print("the local control plane (pid %d) did not stop" % pid)
        return 1
    if outcome == "killed":
        print("the local control plane (pid %d) hung and was killed; stopping its guests" % pid)
        stop_orphan_guests(state_dir)
    with contextlib.suppress(OSError):
        os.unlink(info_path(state_dir))
    print("stopped the local control plane (pid %d) and its guests" % pid)
    return 0


# -- status ---------------------------------------------------------------------------
def _records(directory: str) -> list:
    """The JSON records of a state dir, read only (the running plane owns them: nothing is removed here)."""
    out = []
    with contextlib.suppress(OSError):
        for entry in sorted(os.listdir(directory)):
            if entry.endswith(".json") and not entry.startswith("."):
                with contextlib.suppress(OSError, ValueError), open(os.path.join(directory, entry)) as f:
                    out.append(json.load(f))
    return out


def _mounts_under(prefixes: list) -> list:
    """Mount points (from /proc/self/mountinfo) at or under any of these directories."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")  # \040 and friends
            if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
                found.append(point)
    return found


def plane_status(state_dir: str) -> dict:
    """Everything of this state dir's plane on the host: process, sessions, guests, containers, mounts, /run dirs."""
    from .guests import RUNC
    from .rootfs import SessionLayout
    from .sessions import guest_state_dir

    state_dir = os.path.abspath(state_dir)
    info = read_info(state_dir)
    running = bool(info and pid_alive(info.get("pid", -1)))
    guests_dir = guest_state_dir(state_dir)
    mount_scope = os.path.dirname(SessionLayout(guests_dir, "x").mount_dir)
    containers = []
    runc_root = os.path.join(guests_dir, "runc")
    if os.path.isdir(runc_root):
        proc = subprocess.run([RUNC, "--root", runc_root, "list", "--format", "json"], capture_output=True,
                              text=True, check=False)
        with contextlib.suppress(ValueError):
            containers = [{"id": c.get("id"), "status": c.get("status"), "pid": c.get("pid")}
                          for c in json.loads(proc.stdout or "null") or []]
    guest_dirs = []
    with contextlib.suppress(OSError):
        guest_dirs = sorted(d for d in os.listdir(os.path.join(guests_dir, "sessions")) if not d.startswith("."))
    sessions = [{"session_id": r.get("session_id"), "name": r.get("name"), "status": r.get("status")}
                for r in _records(os.path.join(state_dir, "sessions"))]
    return {
        "state_dir": state_dir,
        "plane": {"running": running, "pid": info.get("pid") if running else None,
                  "url": info.get("url") if running else None},
        "sessions": sessions,
        "live_sessions": [s for s in sessions if str(s.get("status")).rsplit("_", 1)[-1] not in ("DESTROYED",)],
        "guests": guest_dirs,
        "containers": containers,
        "mounts": _mounts_under([state_dir, mount_scope]),
        "run_dirs": [mount_scope] if os.path.isdir(mount_scope) else [],
    }


def cmd_status(args: argparse.Namespace) -> int:
    status = plane_status(args.state_dir)
    if args.json:
        print(json.dumps(status, indent=1, sort_keys=True))
        return 0
    plane = status["plane"]
    print("plane: %s" % ("running at %s (pid %d)" % (plane["url"], plane["pid"]) if plane["running"] else "not running"))
    print("sessions: %d live of %d recorded" % (len(status["live_sessions"]), len(status["sessions"])))
    for s in status["live_sessions"]:
        print("  %s  %s  %s" % (s["session_id"], s["name"], s["status"]))
    print("guests (state dirs): %d" % len(status["guests"]))
    for g in status["guests"]:
        print("  %s" % g)
    print("containers: %d" % len(status["containers"]))
    for c in status["containers"]:
        print("  %s  %s  pid %s" % (c["id"], c["status"], c["pid"]))
    print("mounts: %d" % len(status["mounts"]))
    for m in status["mounts"]:
        print("  %s" % m)
    for d in status["run_dirs"]:
        print("run dir: %s" % d)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import sweep
    done = sweep(stopped_too=args.stopped_too, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(done, indent=1, sort_keys=True))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print("%s what %d plane(s) no longer running left: %d guest process(es) %s, %d mount(s), %d loop device(s)" % (
        verb, len(done["scopes"]), len(done["pids"]), "to stop" if args.dry_run else "stopped",
        len(done["mounts"]), len(done["loops"])))
    return 0


# The bounds of one archive upload, handed to every guest's agent (agentarchive.DEFAULT_LIMITS when unset).
ARCHIVE_LIMITS = (("archive_max_members", "--archive-max-members", "MICROVM_LOCALPLANE_ARCHIVE_MAX_MEMBERS",
                   "most members one uploaded archive may have"),
                  ("archive_max_bytes", "--archive-max-bytes", "MICROVM_LOCALPLANE_ARCHIVE_MAX_BYTES",
                   "most bytes the regular files of one uploaded archive may expand to"))


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError("must be a whole number above 0, got %r" % text)
    return value


def add_archive_limit_options(p):
    from .agentarchive import DEFAULT_LIMITS
    for key, flag, env, what in ARCHIVE_LIMITS:
        p.add_argument(flag, dest=key, type=positive_int, default=os.environ.get(env),
                       help="%s (default %d, or env %s); more is refused whole, nothing written"
                            % (what, DEFAULT_LIMITS[key], env))


def archive_limits(args):
    return {key: positive_int(str(getattr(args, key))) for key, _f, _e, _w in ARCHIVE_LIMITS
            if getattr(args, key, None) is not None}


def archive_limit_argv(args):
    argv = []
    for key, flag, _env, _what in ARCHIVE_LIMITS:
        if getattr(args, key, None) is not None:
            argv += [flag, str(getattr(args, key))]
    return argv


DISK_RESERVE_ENV = "MICROVM_LOCALPLANE_DISK_RESERVE"


def non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError("must be a whole number of bytes, 0 or more, got %r" % text)
    return value


def add_disk_reserve_option(p):
    from .disk import DEFAULT_RESERVE
    p.add_argument("--disk-reserve", type=non_negative_int, default=os.environ.get(DISK_RESERVE_ENV),
                   help="bytes of the state dir's file system that a new session's whole disk must leave free, or its "
                        "create (or fork) is refused with 409 (default %d, or env %s)" % (DEFAULT_RESERVE, DISK_RESERVE_ENV))


def disk_reserve_argv(args):
    return [] if args.disk_reserve is None else ["--disk-reserve", str(args.disk_reserve)]


# The warm pool (warmpool.py): guests kept booted ahead for keep_warm creates.
WARM_POOL_OPTIONS = (("warm_pool_size", "--warm-pool-size", "MICROVM_LOCALPLANE_WARM_POOL_SIZE", "size",
                      "guests kept booted ahead per template and size that a keep_warm create asked for (0 = no pool)"),
                     ("warm_pool_max", "--warm-pool-max", "MICROVM_LOCALPLANE_WARM_POOL_MAX", "max_total",
                      "guests kept booted ahead in all"))


def add_warm_pool_options(p):
    from . import warmpool
    defaults = {"size": warmpool.DEFAULT_SIZE, "max_total": warmpool.DEFAULT_MAX_TOTAL}
    for key, flag, env, setting, what in WARM_POOL_OPTIONS:
        p.add_argument(flag, dest=key, type=non_negative_int, default=os.environ.get(env),
                       help="%s (default %d, or env %s)" % (what, defaults[setting], env))


def warm_pool_settings(args):
    return {setting: non_negative_int(str(getattr(args, key))) for key, _f, _e, setting, _w in WARM_POOL_OPTIONS
            if getattr(args, key, None) is not None}


def warm_pool_argv(args):
    argv = []
    for key, flag, _env, _setting, _what in WARM_POOL_OPTIONS:
        if getattr(args, key, None) is not None:
            argv += [flag, str(getattr(args, key))]
    return argv


def main(argv=None):
    parser = argparse.ArgumentParser(prog="microvm-localplane",
                                     description="The local control plane of the microvm.sandbox collection.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run in the foreground")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT on loopback (port 0 = any free port)")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--token", default=os.environ.get("MICROVM_LOCALPLANE_TOKEN"),
                   help="bearer token (default: the one in STATE_DIR/token, else a new random one)")
    p.add_argument("--no-print-token", dest="print_token", action="store_false",
                   help="do not print the token (used by `up`, whose output goes to a log)")
    add_archive_limit_options(p)
    add_disk_reserve_option(p)
    add_warm_pool_options(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("up", help="start in the background (or reuse the running one) and write an env file")
    p.add_argument("--listen", default=None,
                   help="HOST:PORT on loopback; a port named here is used or `up` fails (default %s, or a free port "
                        "when that one is taken)" % DEFAULT_LISTEN)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--env-file")
    p.add_argument("--token", default=None)
    add_archive_limit_options(p)
    add_disk_reserve_option(p)
    add_warm_pool_options(p)
    p.set_defaults(func=cmd_up)
    p = sub.add_parser("down", help="stop the background plane and every guest")
    p.add_argument("--state-dir", required=True)
    p.set_defaults(func=cmd_down)
    p = sub.add_parser("sweep", help="stop the guests of planes no longer running and remove their mounts and loop "
                                     "devices (state dirs that still exist are kept for a plane started there again)")
    p.add_argument("--stopped-too", action="store_true",
                   help="also sweep planes whose state dir still exists (their sessions boot afresh when it is up again)")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("status", help="list the plane's process, sessions, guests, containers and mounts on this host")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--json", action="store_true", help="print one JSON object (what a script checks)")
    p.set_defaults(func=cmd_status)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe would be reported after main returned
    except BrokenPipeError:
        return quiet_broken_pipe()
    return code


def quiet_broken_pipe() -> int:
    """The reader of our output went away (`status | head -1`): stop quietly, as a tool killed by SIGPIPE would.

    SIGPIPE keeps Python's default (ignored) rather than SIG_DFL, which would kill `serve` whenever a client of its
    sockets hangs up. Standard output goes to /dev/null so that the final flush at exit fails no more.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE
