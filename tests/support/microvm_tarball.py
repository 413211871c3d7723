"""The collection tarball, built once per content of the tree: `collection_tarball()` -> its path.

The digest covers what `ansible-galaxy collection build` could pack: the path, mode and bytes of every
file git lists (`git ls-files --cached --others --exclude-standard`: tracked, and untracked but not
ignored; without git, a walk of the tree leaving out .git, .local and .venv*), and the ansible-galaxy
that builds it. The tarball is built under a lock into <clone>/.local/dist/<digest16>/, renamed into
place only when whole, so parallel test workers and scripts (hack/ee-test.sh, hack/galaxy-import.sh)
share one build. `python tests/support/microvm_tarball.py` prints its path.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = "1"
WALK_SKIP = (".git", ".local")


class TarballError(Exception):
    pass


def tree_files(root: str = ROOT) -> list[str]:
    """The files (relative paths) the digest covers."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, check=True, timeout=60).stdout
        return sorted(set(p for p in out.decode("utf-8", "surrogateescape").split("\0") if p))
    except (OSError, subprocess.SubprocessError):
        files: list[str] = []
        for top, dirs, names in os.walk(root):
            rel = os.path.relpath(top, root)
            dirs[:] = [d for d in dirs if not (rel == "." and (d in WALK_SKIP or d.startswith(".venv")))]
            files.extend(os.path.normpath(os.path.join(rel, n)) for n in names)
        return sorted(files)


def galaxy() -> str:
    """The ansible-galaxy beside this Python (the venv's), else the one on PATH."""
    path = os.path.join(os.path.dirname(sys.executable), "ansible-galaxy")
    return path if os.path.exists(path) else (shutil.which("ansible-galaxy") or path)


def _galaxy_version() -> str:
    try:
        from importlib.metadata import version

        return version("ansible-core")
    except Exception:  # any failure: the path alone keys the builder
        return "?"


def tree_digest(root: str = ROOT, files: Iterable[str] | None = None) -> str:
    """sha256 hex over the mode and content of each file (a symlink: its target) and the builder."""
    h = hashlib.sha256()

    def part(data: bytes) -> None:
        h.update(b"%d:" % len(data) + data)

    part(("schema %s galaxy %s %s" % (SCHEMA, os.path.realpath(galaxy()), _galaxy_version())).encode())
    for rel in (tree_files(root) if files is None else files):
        path = os.path.join(root, rel)
        part(rel.encode("utf-8", "surrogateescape"))
        try:
            st = os.lstat(path)
        except FileNotFoundError:   # tracked but deleted in the work tree
            part(b"missing")
            continue
        if stat.S_ISLNK(st.st_mode):
            part(b"link " + os.readlink(path).encode("utf-8", "surrogateescape"))
        elif stat.S_ISREG(st.st_mode):
            part(b"file %o" % (st.st_mode & 0o777))
            with open(path, "rb") as f:
                part(f.read())
        else:
            part(b"other %o" % st.st_mode)
    return h.hexdigest()


def _built(out: str) -> str | None:
    try:
        names = [n for n in os.listdir(out) if n.endswith(".tar.gz")]
    except FileNotFoundError:
        return None
    return os.path.join(out, names[0]) if len(names) == 1 and os.path.exists(os.path.join(out, ".complete")) else None


def collection_tarball(root: str = ROOT, digest: str | None = None) -> str:
    """-> the path of the collection tarball of the tree as it is now, built once per digest."""
    digest = digest or tree_digest(root)
    dist = os.path.join(root, ".local", "dist")
    out = os.path.join(dist, digest[:16])
    found = _built(out)
    if found:
        return found
    os.makedirs(dist, exist_ok=True)
    with open(out + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)    # another worker may be building it: wait for that one
        found = _built(out)
        if found:
            return found
        tmp = "%s.tmp-%d" % (out, os.getpid())
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        built = subprocess.run([galaxy(), "collection", "build", "--output-path", tmp, root], capture_output=True,
                               text=True, check=False, timeout=600)
        if built.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise TarballError("ansible-galaxy collection build failed:\n" + built.stdout + built.stderr)
        open(os.path.join(tmp, ".complete"), "w").close()
        os.rename(tmp, out)
    found = _built(out)
    if not found:
        raise TarballError("no tarball in %s after the build" % out)
    return found


def main() -> None:
    try:
        print(collection_tarball())
    except TarballError as e:
        raise SystemExit(str(e)) from e


if __name__ == "__main__":
    main()
