"""A clone's venv (.venv, .venv-newest, .venv-220) as a thin overlay over a shared venv cached by content.

Run by the base Python the venv is for (make venv, make .venv-newest/.stamp, make .venv-220/.stamp):

    python3 hack/cached_venv.py --dest .venv -r requirements-dev.txt --localplane localplane

The shared venv lives at $CACHE/venvs/<name>-<key16>, CACHE being
${MICROVM_SANDBOX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/microvm-sandbox}. Its key is a sha256 over
SCHEMA, this Python's build (sys.version, the real path of its executable, the platform) and the bytes
of the requirement files (and of localplane/pyproject.toml for .venv: its dependencies). It is built once
under a lock (`python -m venv`, pip upgraded, the requirements installed with pip's own defaults and this
machine's pip configuration; `-e` lines left out: an editable install would tie it to one clone) and
marked complete only when whole; a missing or mismatched key builds it anew.

The clone's venv is an overlay made in well under a second: `python -m venv --without-pip`, a .pth that
adds the shared site-packages with site.addsitedir (its own .pth files are processed), a .pth naming the
clone's localplane dir (what `-e ./localplane` gave), the shared venv's scripts rewritten with the
overlay's python in their shebang, its other executables symlinked. It records its key: when that
matches, nothing is done.
"""
from __future__ import annotations  # hints stay unevaluated: make may run this on a base Python older than 3.10

import argparse
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

SCHEMA = "1"
KEY_FILE = ".cached-venv-key"      # in the overlay: the key and the shared venv it was made over
COMPLETE = ".complete"             # in the shared venv: written last, holding the key
PTH_SHARED = "_microvm_shared_venv.pth"
PTH_LOCALPLANE = "_microvm_localplane.pth"
# Linux's limit on a shebang line (BINPRM_BUF_SIZE, including "#!"); pip's own rule for the /bin/sh form.
SHEBANG_MAX = 127
LOCALPLANE_SCRIPTS = {"microvm-localplane": ("microvm_localplane.cli", "main")}
SKIP_BIN = re.compile(r"^(activate.*|Activate\.ps1|python[0-9.]*|__pycache__)$")
# The Python the venvs are made with: the base one even when this runs in a venv (make puts .venv/bin first on
# PATH, so `python3` may be the very overlay this replaces).
BASE_PYTHON: str = getattr(sys, "_base_executable", None) or sys.executable


def cache_root() -> str:
    """The machine's shared cache of every clone (the one rule: make, typecheck and the test fixtures ask here)."""
    root = os.environ.get("MICROVM_SANDBOX_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "microvm-sandbox")
    return os.path.abspath(root)


def compute_key(requirements: Iterable[str], extra_files: Iterable[str] = ()) -> str:
    h = hashlib.sha256()

    def part(label: str, data: str | bytes) -> None:
        if isinstance(data, str):
            data = data.encode()
        h.update(b"%s %d\n" % (label.encode(), len(data)))
        h.update(data)

    part("schema", SCHEMA)
    part("version", sys.version)
    part("executable", os.path.realpath(BASE_PYTHON))
    # The platform as far as built wheels care (OS, machine, C library): not the kernel's release.
    part("platform", "%s %s %s" % (sys.platform, platform.machine(), " ".join(platform.libc_ver())))
    for label, paths in (("requirements", requirements), ("extra", extra_files)):
        for path in paths:
            with open(path, "rb") as f:
                part(label, f.read())
    return h.hexdigest()


def site_packages(prefix: str) -> str:
    """The purelib dir of the venv at prefix, as its own python says (Debian's python3 has a scheme of its own
    outside venvs: this one's sysconfig would not do)."""
    return subprocess.run([os.path.join(prefix, "bin", "python"), "-c",
                           "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def read_requirements(paths: Iterable[str]) -> list[str]:
    """The requirement lines to install into the shared venv: every line but editable (-e) ones."""
    lines = []
    for path in paths:
        with open(path) as f:
            for line in f:
                stripped = line.strip()
                if stripped.startswith(("-e ", "-e\t", "--editable")) or stripped == "-e":
                    continue
                lines.append(line.rstrip("\n"))
    return lines


def localplane_dependencies(localplane: str) -> list[str]:
    """[project].dependencies of localplane/pyproject.toml (what the editable install pulled in)."""
    path = os.path.join(localplane, "pyproject.toml")
    try:
        import tomllib
    except ImportError:   # Python < 3.11: its dependencies are in requirements-dev.txt anyway
        return []
    with open(path, "rb") as f:
        return list(tomllib.load(f).get("project", {}).get("dependencies", []))


def _run(argv: Sequence[str], **kw: Any) -> None:
    subprocess.run(argv, check=True, **kw)


def create_venv(path: str, with_pip: bool = True) -> None:
    _run([BASE_PYTHON, "-m", "venv"] + ([] if with_pip else ["--without-pip"]) + [path])


def pip_install(python: str, args: list[str]) -> None:
    """pip with its own default sources and this machine's pip configuration (PIP_* variables, pip.conf)."""
    _run([python, "-m", "pip", "install", "--quiet"] + args)


def _locked(lock_path: str) -> TextIO:
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    f = open(lock_path, "a")
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def shared_complete(shared: str, key: str) -> bool:
    try:
        with open(os.path.join(shared, COMPLETE)) as f:
            return f.read().strip() == key
    except OSError:
        return False


def shared_path(name: str, key: str) -> str:
    return os.path.join(cache_root(), "venvs", "%s-%s" % (name, key[:16]))


def ensure_shared(name: str, key: str, requirement_lines: Sequence[str], log: Callable[[str], object] = print) -> str:
    """-> the shared venv for key, building it first (under a lock) when it is missing or incomplete."""
    shared = shared_path(name, key)
    if shared_complete(shared, key):
        return shared
    with _locked(shared + ".lock"):
        if shared_complete(shared, key):       # another clone built it while we waited
            return shared
        shutil.rmtree(shared, ignore_errors=True)   # a build that never completed
        log("cached_venv: building the shared venv %s (once per content)" % shared)
        started = time.monotonic()
        # Built in place (a venv is not relocatable); COMPLETE is written only once it is whole.
        create_venv(shared)
        python = os.path.join(shared, "bin", "python")
        pip_install(python, ["--upgrade", "pip"])
        reqs = os.path.join(shared, "requirements.txt")
        with open(reqs, "w") as f:
            f.write("\n".join(requirement_lines) + "\n")
        if any(line.strip() and not line.strip().startswith("#") for line in requirement_lines):
            pip_install(python, ["-r", reqs])
        with open(os.path.join(shared, COMPLETE), "w") as f:
            f.write(key + "\n")
        log("cached_venv: built %s in %.0f s" % (shared, time.monotonic() - started))
    return shared


def _shebang_python(first_lines: Sequence[str], shared_bin: str) -> tuple[str, int] | None:
    """The shared interpreter a script's header names, or None when it is not a script of the shared venv."""
    if first_lines[0].startswith("#!"):
        target = first_lines[0][2:].strip().split(" ", 1)[0]   # (pip writes no interpreter arguments)
        if target.startswith(shared_bin + os.sep):
            return target, 1
        if target == "/bin/sh" and len(first_lines) > 2 and first_lines[1].startswith("'''exec' "):
            # pip's long-shebang form: #!/bin/sh / '''exec' "<python>" "$0" "$@" / ' '''
            m = re.match(r"""'''exec' "?([^"]+?)"? "\$0" "\$@"$""", first_lines[1].strip())
            if m and m.group(1).startswith(shared_bin + os.sep) and first_lines[2].strip() == "' '''":
                return m.group(1), 3
    return None


def shebang(python: str) -> str:
    if len("#!" + python) <= SHEBANG_MAX and " " not in python:
        return "#!%s\n" % python
    return "#!/bin/sh\n'''exec' \"%s\" \"$0\" \"$@\"\n' '''\n" % python


def link_scripts(shared: str, dest: str) -> None:
    """The shared venv's bin into the overlay's: scripts rewritten for its python, other executables linked."""
    shared_bin, dest_bin = os.path.join(shared, "bin"), os.path.join(dest, "bin")
    for entry in sorted(os.listdir(shared_bin)):
        src, dst = os.path.join(shared_bin, entry), os.path.join(dest_bin, entry)
        if SKIP_BIN.match(entry) or os.path.lexists(dst) or os.path.isdir(src):
            continue
        with open(src, "rb") as f:
            head = f.read(4096)
        lines = head.split(b"\n")[:3]
        try:
            found = _shebang_python([x.decode() for x in lines] + ["", ""], shared_bin) if head[:2] == b"#!" else None
        except UnicodeDecodeError:
            found = None
        if not found:
            os.symlink(src, dst)
            continue
        python, header_lines = found
        ours = os.path.join(dest_bin, os.path.basename(python))
        if not os.path.exists(ours):
            ours = os.path.join(dest_bin, "python")
        with open(src, "rb") as f:
            body = f.read().split(b"\n", header_lines)[-1]
        with open(dst, "wb") as f:
            f.write(shebang(ours).encode() + body)
        os.chmod(dst, os.stat(src).st_mode & 0o7777)


def write_console_script(dest: str, name: str, module: str, func: str) -> None:
    path = os.path.join(dest, "bin", name)
    with open(path, "w") as f:
        f.write(shebang(os.path.join(dest, "bin", "python")))
        f.write("import re\nimport sys\nfrom %s import %s\n"
                "if __name__ == \"__main__\":\n"
                "    sys.argv[0] = re.sub(r\"(-script\\.pyw|\\.exe)?$\", \"\", sys.argv[0])\n"
                "    sys.exit(%s())\n" % (module, func, func))
    os.chmod(path, 0o755)


def overlay_key(dest: str) -> list[str]:
    try:
        with open(os.path.join(dest, KEY_FILE)) as f:
            return f.read().split()
    except OSError:
        return []


def make_overlay(dest: str, shared: str, key: str, localplane: str | None = None) -> None:
    """The clone's thin venv over shared (replacing whatever dest held)."""
    shutil.rmtree(dest, ignore_errors=True)
    if os.path.lexists(dest):
        os.unlink(dest)
    create_venv(dest, with_pip=False)
    sp = site_packages(dest)
    os.makedirs(sp, exist_ok=True)
    with open(os.path.join(sp, PTH_SHARED), "w") as f:
        f.write("import site; site.addsitedir(%r)\n" % site_packages(shared))
    if localplane:
        with open(os.path.join(sp, PTH_LOCALPLANE), "w") as f:
            f.write(os.path.abspath(localplane) + "\n")
    link_scripts(shared, dest)
    if localplane:
        for name, (module, func) in LOCALPLANE_SCRIPTS.items():
            write_console_script(dest, name, module, func)
    with open(os.path.join(dest, KEY_FILE), "w") as f:
        f.write("%s %s\n" % (key, shared))


def ensure(dest: str, requirements: Sequence[str], localplane: str | None = None, name: str | None = None,
           log: Callable[[str], object] = print) -> tuple[str, str]:
    """-> (dest, shared): the overlay at dest over the shared venv of these requirements, made if needed."""
    dest = os.path.abspath(dest)
    extra = [os.path.join(localplane, "pyproject.toml")] if localplane else []
    key = compute_key(requirements, extra)
    name = name or os.path.basename(dest).lstrip(".") or "venv"
    have = overlay_key(dest)
    if have == [key, shared_path(name, key)] and shared_complete(have[1], key):
        return dest, have[1]
    lines = read_requirements(requirements)
    if localplane:
        lines += localplane_dependencies(localplane)
    shared = ensure_shared(name, key, lines, log=log)
    locks = os.path.join(cache_root(), "locks")
    lock_name = hashlib.sha256(dest.encode()).hexdigest()[:16] + ".lock"
    with _locked(os.path.join(locks, lock_name)):
        have = overlay_key(dest)
        if not (len(have) == 2 and have[0] == key and have[1] == shared):
            started = time.monotonic()
            make_overlay(dest, shared, key, localplane)
            log("cached_venv: %s over %s (%.2f s)" % (os.path.relpath(dest), shared, time.monotonic() - started))
    return dest, shared


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--cache-root", action="store_true", help="print the shared cache's root and exit")
    parser.add_argument("--dest", help="the clone's venv dir (.venv)")
    parser.add_argument("-r", "--requirements", action="append", help="requirement file (repeatable)")
    parser.add_argument("--localplane", help="the clone's localplane dir: on the path, with its console script")
    parser.add_argument("--name", help="the shared venv's name prefix (default: dest's name)")
    args = parser.parse_args(argv)
    if args.cache_root:
        print(cache_root())
        return
    if not args.dest or not args.requirements:
        parser.error("--dest and -r are required")
    try:
        ensure(args.dest, args.requirements, localplane=args.localplane, name=args.name)
    except subprocess.CalledProcessError as e:
        raise SystemExit("cached_venv: %s failed (exit %d)" % (" ".join(e.cmd), e.returncode)) from e


if __name__ == "__main__":
    main()
