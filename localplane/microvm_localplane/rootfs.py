"""A guest's filesystem: per-session state layout, template lower layers, and the launch script.

Root filesystem = overlayfs: read-only lower layers from the template, one
writable upper dir per session (the "root changes" a checkpoint captures).

- kind "host": the host's userland read-only. Three overlays: "/" over a
  skeleton (merged-usr symlinks, empty /var, /root, mount points), "/usr"
  over the host's /usr, "/etc" over the host's /etc. Nothing else of the host
  is visible (no /home, /root, /work, no state dir).
- kind "dir": one overlay, "/" over the unpacked OCI rootfs, with a small
  skeleton layer on top that only adds the mount points (so bubblewrap never
  has to create them in the session's upper dir).

bubblewrap 0.8 has no overlay options, so the launch script mounts the
overlays in a private mount namespace (`unshare --mount --propagation
private`) and hands the merged tree to bwrap as its root: the mounts never
appear on the host and vanish with the guest.
"""
import hashlib
import json
import os
import shlex
import shutil
import stat
import tempfile

from .hostpaths import GUEST_HOSTLIB_DIR, CodePaths
from .portdial import BRIDGE_NAME

GUEST_RUN_DIR = "/run/localplane"
WORKSPACE = "/workspace"
MERGED_USR_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
SKELETON_DIRS = ("usr", "etc", "var", "var/tmp", "var/lib", "var/cache", "var/log", "opt", "srv", "mnt", "media",
                 "home", "root", "run", "tmp", "proc", "dev", "sys")
# Capabilities a guest keeps (Docker's default set): enough for package managers and
# `become`, none that reach past the guest's namespaces (no SYS_ADMIN, no MKNOD).
GUEST_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
              "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE", "CAP_SETFCAP")
BAD_PATH_CHARS = set(",:\n\\")


class RootfsError(Exception):
    pass


class SessionLayout:
    """state_dir/sessions/<id>/{workspace, rootfs/<layer>/{upper,work}, run, host}."""

    def __init__(self, state_dir, session_id):
        self.root = os.path.join(state_dir, "sessions", session_id)
        self.workspace = os.path.join(self.root, "workspace")
        self.rootfs = os.path.join(self.root, "rootfs")
        self.run = os.path.join(self.root, "run")          # bound into the guest at /run/localplane
        self.host = os.path.join(self.root, "host")        # host-side only: meta, logs, mount point
        self.merged = os.path.join(self.host, "mnt")
        self.meta_file = os.path.join(self.host, "meta.json")
        self.info_file = os.path.join(self.host, "bwrap-info.json")
        self.log_file = os.path.join(self.host, "guest.log")
        self.bridge_name = BRIDGE_NAME                     # in host/: the guest cannot see or replace it

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

    def create(self, layers):
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        for d in (self.workspace, self.run, self.host, self.merged):
            os.makedirs(d, exist_ok=True)
        os.chmod(self.host, 0o700)
        for layer in layers:
            os.makedirs(self.upper(layer), exist_ok=True)
            # overlayfs needs an empty work dir; a stale one (crash, restore) is recreated.
            shutil.rmtree(self.work(layer), ignore_errors=True)
            os.makedirs(self.work(layer))
        home = os.path.join(self.workspace, "home")
        if not os.path.lexists(home):  # whatever the guest left there is its own business
            os.mkdir(home)
        for stale in ("agent.pid", "agent.fallback"):
            try:
                os.unlink(os.path.join(self.run, stale))
            except FileNotFoundError:
                pass
        try:
            os.unlink(self.info_file)
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


def _mountpoints(code: CodePaths, kind):
    points = [WORKSPACE, GUEST_RUN_DIR, "/tmp", "/proc", "/dev"] + code.read_only_binds()
    if kind == "dir" and code.host_lib_dir:
        points.append(GUEST_HOSTLIB_DIR)
    return points


def skeleton(state_dir, kind, code: CodePaths):
    """The shared, read-only top layer of a template; built once per state dir and content."""
    links = {n: os.readlink("/" + n) for n in MERGED_USR_LINKS if kind == "host" and os.path.islink("/" + n)}
    dirs = (list(SKELETON_DIRS) if kind == "host" else []) + [p.lstrip("/") for p in _mountpoints(code, kind)]
    spec = json.dumps({"kind": kind, "links": links, "dirs": sorted(set(dirs))}, sort_keys=True)
    path = os.path.join(state_dir, "skel", "%s-%s" % (kind, hashlib.sha256(spec.encode()).hexdigest()[:12]))
    if os.path.isdir(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".build-")
    os.chmod(tmp, 0o755)
    for d in sorted(set(dirs)):
        os.makedirs(os.path.join(tmp, d), mode=0o755, exist_ok=True)
    if kind == "host":
        for d in ("tmp", "var/tmp"):
            os.chmod(os.path.join(tmp, d), 0o1777)
        os.chmod(os.path.join(tmp, "root"), 0o700)
    for name, target in links.items():
        os.symlink(target, os.path.join(tmp, name))
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another manager built it first
    return path


def overlays(state_dir, layout, rootfs, code: CodePaths):
    """[(layer, lowerdirs, mount point under merged)] for a rootfs spec."""
    if rootfs.kind == "host":
        skel = skeleton(state_dir, "host", code)
        return [("root", [skel], ""), ("usr", ["/usr"], "usr"), ("etc", ["/etc"], "etc")]
    if rootfs.kind == "dir":
        if not rootfs.path or not os.path.isdir(rootfs.path):
            raise RootfsError("rootfs dir does not exist: %r" % rootfs.path)
        skel = skeleton(state_dir, "dir", code)
        return [("root", [skel, os.path.abspath(rootfs.path)], "")]
    raise RootfsError("unknown rootfs kind: %r" % rootfs.kind)


def write_identity(layout, mounts, hostname):
    """/etc/hostname and /etc/hosts name the guest, not the host (written into the upper dir).

    The upper dir is the guest's own content: never follow a symlink in it (the
    guest may have left one pointing anywhere on the host). The guest is not
    running at this point, so checking then writing is race-free.
    """
    layers = {layer: lowers for layer, lowers, _target in mounts}
    if "etc" in layers:
        etc = layout.upper("etc")
    else:
        etc = os.path.join(layout.upper("root"), "etc")
        image_etc = [os.path.join(lower, "etc") for lower in layers["root"]]
        if any(os.path.islink(p) for p in image_etc):
            return  # an image whose /etc is a link: a real dir in the upper layer would hide it
        if not os.path.lexists(etc):
            os.mkdir(etc, 0o755)
    if os.path.islink(etc) or not os.path.isdir(etc):
        return  # the guest replaced its /etc: leave it alone
    _write_own_file(os.path.join(etc, "hostname"), hostname + "\n", replace=True)
    _write_own_file(os.path.join(etc, "hosts"), "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                    "127.0.1.1\t%s\n" % hostname, replace=False)


def write_session_env(layout, env):
    path = os.path.join(layout.run, "session-env.json")
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(env, f)


def _write_own_file(path, text, replace):
    if os.path.lexists(path):
        if not replace or os.path.isdir(path) and not os.path.islink(path):
            return
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def overlay_mounts(layout, mounts):
    """[(mount options, target)] in mount order."""
    out = []
    for layer, lowers, sub in mounts:
        target = os.path.join(layout.merged, sub) if sub else layout.merged
        opts = "lowerdir=%s,upperdir=%s,workdir=%s" % (
            ":".join(check_mount_path(p) for p in lowers), check_mount_path(layout.upper(layer)),
            check_mount_path(layout.work(layer)))
        out.append((opts, target))
    return out


def bwrap_argv(layout, code: CodePaths, hostname, guest_argv, host_libs=False):
    """bwrap over the merged root; its --info-fd is fd 3."""
    argv = ["bwrap", "--bind", layout.merged, "/",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--bind", layout.workspace, WORKSPACE,
            "--bind", layout.run, GUEST_RUN_DIR]
    for p in code.read_only_binds():
        argv += ["--ro-bind", p, p]
    if host_libs and code.host_lib_dir:
        argv += ["--ro-bind", code.host_lib_dir, GUEST_HOSTLIB_DIR]
    argv += ["--unshare-pid", "--unshare-uts", "--unshare-ipc", "--unshare-net", "--unshare-cgroup-try",
             "--hostname", hostname, "--as-pid-1", "--new-session", "--chdir", "/", "--cap-drop", "ALL"]
    for cap in GUEST_CAPS:
        argv += ["--cap-add", cap]
    return argv + ["--info-fd", "3", "--"] + list(guest_argv)


def launch_script(layout, cgroup_procs, overlay, bwrap):
    """The shell run as `unshare --mount --propagation private sh -c SCRIPT` (when no warm launcher)."""
    q = shlex.quote
    lines = ["set -e"]
    for f in cgroup_procs:
        lines.append("echo $$ > %s" % q(f))
    for opts, target in overlay:
        lines.append("mount -t overlay overlay -o %s %s" % (q(opts), q(target)))
    lines.append("exec %s 3> %s" % (" ".join(q(a) for a in bwrap), q(layout.info_file)))
    return "\n".join(lines) + "\n"


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
