"""A guest's filesystem: per-session state layout, template lower layers and their mounts.

Root filesystem = overlayfs: read-only lower layers from the template, one
writable upper dir per session (the "root changes" a checkpoint captures).

- kind "base": the built-in template, a Debian rootfs of its own (baseimage.py).
- kind "dir": an unpacked OCI image.
("host", the host's own userland, is gone: a saved "host" record means "base".)

Each template gets a small skeleton layer on top that only adds the mount
points the plane binds into guests (/workspace, the agent's private dir), so
that runc never creates them in the session's upper dir.

Ids: the lower layers hold canonical ids (0 = the guest's root) and are bound
idmapped into the guest's own host id range (idmap.py); the session's upper
dir and workspace hold that range's ids directly. The mounts live in a
host-only directory under /run (mount_dir) that runc's root filesystem points
at, and survive a plane restart like the guest does.
"""
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile

from . import idmap
from .hostpaths import CodePaths, scope_of
from .portdial import BRIDGE_NAME

GUEST_RUN_DIR = "/run/localplane"
WORKSPACE = "/workspace"
MOUNT_ROOT = "/run/microvm-localplane/guests"
BAD_PATH_CHARS = set(",:\n\\")


class RootfsError(Exception):
    pass


class SessionLayout:
    """state_dir/sessions/<id>/{workspace, rootfs/<layer>/{upper,work}, run, host}, and its mounts
    under MOUNT_ROOT/<scope>/<id>/{root, lower<i>}."""

    def __init__(self, state_dir, session_id):
        self.session_id = session_id
        self.root = os.path.join(state_dir, "sessions", session_id)
        self.workspace = os.path.join(self.root, "workspace")
        self.rootfs = os.path.join(self.root, "rootfs")
        self.run = os.path.join(self.root, "run")          # bound into the guest at /run/localplane
        self.host = os.path.join(self.root, "host")        # host-side only: meta, logs, bundle
        self.bundle = os.path.join(self.host, "bundle")    # runc's bundle: config.json
        self.disk_image = os.path.join(self.root, "disk.img")  # workspace + rootfs + run live in it (disk.py)
        self.disk = os.path.join(self.root, "disk")
        self.meta_file = os.path.join(self.host, "meta.json")
        self.ids_file = os.path.join(self.host, "ids.json")
        self.pid_file = os.path.join(self.host, "init.pid")
        self.log_file = os.path.join(self.host, "plane.log")  # the plane's own notes about this guest
        self.console_name = "console.log"                  # in run/ (the guest's disk): PID 1's stdout and stderr
        self.bridge_name = BRIDGE_NAME                     # in host/: the guest cannot see or replace it
        self.mount_dir = os.path.join(MOUNT_ROOT, scope_of(state_dir), session_id)
        self.merged = os.path.join(self.mount_dir, "root")

    def upper(self, layer):
        return os.path.join(self.rootfs, layer, "upper")

    def work(self, layer):
        return os.path.join(self.rootfs, layer, "work")

    def layers(self):
        try:
            return sorted(d for d in os.listdir(self.rootfs) if os.path.isdir(self.upper(d)))
        except FileNotFoundError:
            return []

    def exists(self):
        return os.path.isdir(self.root)

    def create(self, layers, ids):
        """The session's dirs; what the guest writes to belongs to its own ids."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        for d in (self.host, self.bundle):
            os.makedirs(d, mode=0o700, exist_ok=True)
        os.chmod(self.host, 0o700)
        for d in (self.workspace, self.run):
            if not os.path.isdir(d):
                os.mkdir(d, 0o755)
                os.chown(d, ids.uid, ids.gid)
        for layer in layers:
            if not os.path.isdir(self.upper(layer)):
                os.makedirs(self.upper(layer))
                os.chown(self.upper(layer), ids.uid, ids.gid)
            # overlayfs needs an empty work dir; a stale one (crash, restore) is recreated.
            shutil.rmtree(self.work(layer), ignore_errors=True)
            os.makedirs(self.work(layer))
        home = os.path.join(self.workspace, "home")
        if not os.path.lexists(home):  # whatever the guest left there is its own business
            os.mkdir(home)
            os.chown(home, ids.uid, ids.gid)
        for stale in ("agent.pid", "agent.fallback"):
            try:
                os.unlink(os.path.join(self.run, stale))
            except FileNotFoundError:
                pass
        try:
            os.unlink(self.pid_file)
        except FileNotFoundError:
            pass

    def read_meta(self):
        try:
            with open(self.meta_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def write_meta(self, meta):
        tmp = self.meta_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, self.meta_file)


def check_mount_path(path):
    if BAD_PATH_CHARS & set(path):
        raise RootfsError("path cannot be used in an overlay mount (contains , : \\ or newline): %r" % path)
    return path


def skeleton(state_dir, code: CodePaths):
    """The shared, read-only top layer of every template: only mount points; built once per state dir and content."""
    dirs = sorted({p.lstrip("/") for p in [WORKSPACE, GUEST_RUN_DIR, "/tmp", "/proc", "/dev", "/sys"]
                   + [g for g, is_dir in code.mount_points() if is_dir]})
    files = sorted(g.lstrip("/") for g, is_dir in code.mount_points() if not is_dir)
    spec = json.dumps({"dirs": dirs, "files": files}, sort_keys=True)
    path = os.path.join(state_dir, "skel", "v2-%s" % hashlib.sha256(spec.encode()).hexdigest()[:12])
    if os.path.isdir(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".build-")
    os.chmod(tmp, 0o755)
    for d in dirs:
        os.makedirs(os.path.join(tmp, d), mode=0o755, exist_ok=True)
    for name in files:
        os.makedirs(os.path.dirname(os.path.join(tmp, name)), mode=0o755, exist_ok=True)
        open(os.path.join(tmp, name), "w").close()
    os.chmod(os.path.join(tmp, "tmp"), 0o1777)
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another manager built it first
    return path


def lower_dirs(state_dir, rootfs, code: CodePaths, base_dir):
    """Template lower layers, topmost first (the skeleton on top)."""
    skel = skeleton(state_dir, code)
    if rootfs.kind == "base":
        return [skel, base_dir]
    if rootfs.kind == "dir":
        if not rootfs.path or not os.path.isdir(rootfs.path):
            raise RootfsError("rootfs dir does not exist: %r" % rootfs.path)
        return [skel, os.path.abspath(rootfs.path)]
    raise RootfsError("unknown rootfs kind: %r" % rootfs.kind)


def mount_root(layout, lowers, ids):
    """Idmapped lower layers + the session's upper dir -> layout.merged (on the host, under MOUNT_ROOT)."""
    unmount_root(layout)
    # runc mounts the root from inside the guest's user namespace, as the guest's root: it must be
    # able to traverse to it. Parents: search only (names are not listable); the session's dir:
    # only its own guest's group.
    for d in (os.path.dirname(MOUNT_ROOT), MOUNT_ROOT, os.path.dirname(layout.mount_dir)):
        os.makedirs(d, exist_ok=True)
        os.chmod(d, 0o711)
    os.makedirs(layout.mount_dir, exist_ok=True)
    os.chown(layout.mount_dir, 0, ids.gid)
    os.chmod(layout.mount_dir, 0o710)
    os.makedirs(layout.merged, exist_ok=True)
    ns = idmap.userns_fd(ids)
    try:
        mapped = []
        for i, lower in enumerate(lowers):
            target = os.path.join(layout.mount_dir, "lower%d" % i)
            os.makedirs(target, exist_ok=True)
            idmap.idmapped_bind(check_mount_path(lower), target, ns)
            mapped.append(target)
    finally:
        os.close(ns)
    # The overlay's options are what the guest's /proc/self/mountinfo shows of its root: names relative to the
    # mount dir (links there to the upper and work dirs), never the host's paths of the state dir.
    for name, target in (("upper", layout.upper("root")), ("work", layout.work("root"))):
        link = os.path.join(layout.mount_dir, name)
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(check_mount_path(target), link)
    opts = "lowerdir=%s,upperdir=upper,workdir=work" % ":".join(os.path.basename(m) for m in mapped)
    proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, layout.merged], cwd=layout.mount_dir,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        unmount_root(layout)
        raise RootfsError("cannot mount the guest's root filesystem: %s" % proc.stderr.strip())


def unmount_root(layout):
    """Undo mount_root (idempotent)."""
    if not os.path.isdir(layout.mount_dir):
        return
    idmap.unmount(layout.merged)
    for name in sorted(os.listdir(layout.mount_dir)):
        if name.startswith("lower"):
            idmap.unmount(os.path.join(layout.mount_dir, name))
    shutil.rmtree(layout.mount_dir, ignore_errors=True)  # only empty mount points are left


def write_identity(layout, lowers, hostname, ids, resolvers):
    """/etc/hostname, /etc/hosts and /etc/resolv.conf of the guest (written into its upper dir, owned by it).

    The upper dir is the guest's own content: never follow a symlink in it (the
    guest may have left one pointing anywhere on the host). The guest is not
    running at this point, so checking then writing is race-free.
    """
    etc = os.path.join(layout.upper("root"), "etc")
    if any(os.path.islink(os.path.join(lower, "etc")) for lower in lowers):
        return  # an image whose /etc is a link: a real dir in the upper layer would hide it
    if not os.path.lexists(etc):
        os.mkdir(etc, 0o755)
        os.chown(etc, ids.uid, ids.gid)
    if os.path.islink(etc) or not os.path.isdir(etc):
        return  # the guest replaced its /etc: leave it alone
    _write_own_file(os.path.join(etc, "hostname"), hostname + "\n", True, ids)
    _write_own_file(os.path.join(etc, "hosts"), "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                    "127.0.1.1\t%s\n" % hostname, False, ids)
    if resolvers:
        _write_own_file(os.path.join(etc, "resolv.conf"), "".join("nameserver %s\n" % r for r in resolvers), False, ids)


def write_session_env(layout, env, ids):
    path = os.path.join(layout.run, "session-env.json")
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.fchown(fd, ids.uid, ids.gid)
    with os.fdopen(fd, "w") as f:
        json.dump(env, f)


def _write_own_file(path, text, replace, ids):
    if os.path.lexists(path):
        if not replace or os.path.isdir(path) and not os.path.islink(path):
            return
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    os.fchown(fd, ids.uid, ids.gid)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def tree_size(path):
    """Apparent bytes of the regular files under path (what a checkpoint reports)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for n in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total
