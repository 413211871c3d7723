"""What of the host a guest gets to run its agent: a few read-only directories at a private path.

The agent (agent.py, guest_init.py) runs inside the guest's own root filesystem
on the plane's own Python runtime, whatever the template holds (a template may
have no Python, or one without what the agent relies on, such as tarfile's
extraction filters, which Debian bookworm's 3.11.2 lacks). It gets, read-only
and nothing else of the host:

- AGENT_DIR/python/bin/pythonX.Y: the plane's interpreter binary (one file),
- AGENT_DIR/python/lib/pythonX.Y: its standard library directory, with the
  host's installed packages in it (site-packages, dist-packages) masked by an
  empty read-only tmpfs (masked_paths()),
- AGENT_DIR/hostlib: the C libraries that interpreter and the agent's extension
  modules need, libpython included (copied once into the state dir by hostlib();
  the agent runs through that dir's dynamic loader, so the template's own libc
  never matters),
- AGENT_DIR/lib: this package (microvm_localplane, with its own generated
  agent_pb package), grpcio and protobuf (the `grpc`, `google/protobuf` and
  `google/_upb` dirs of the plane's environment, and `typing_extensions`, which
  grpc imports). Nothing of the collection: the plane may be installed without
  a checkout.

Never a whole installation prefix: with a distribution's Python that would be
the host's /usr, with pyenv a directory in the host's home. code_paths()
refuses, naming what it found, a layout it cannot bind that narrowly.

The guest's own programs never see these on their paths: the agent's commands
get a fixed baseline environment (agent.py).
"""
import contextlib
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass

AGENT_DIR = "/opt/localplane-agent"
AGENT_LIB = AGENT_DIR + "/lib"
AGENT_PYTHON_DIR = AGENT_DIR + "/python"
AGENT_HOSTLIB_DIR = AGENT_DIR + "/hostlib"


def scope_of(guests_dir: str) -> str:
    """The name every host object of one plane's guests carries (its cgroups, its dirs under /run): a hash of its
    guests dir, so planes of different state dirs never collide and `sweep` can tell whose they are."""
    return hashlib.sha256(os.path.abspath(guests_dir).encode()).hexdigest()[:12]


PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))          # .../microvm_localplane (checkout or site-packages)


# What of a stdlib dir is not the standard library: the host's installed packages.
INSTALLED_PACKAGE_DIRS = ("site-packages", "dist-packages")


class HostPathsError(Exception):
    pass


@dataclass(frozen=True)
class CodePaths:
    package_dir: str         # microvm_localplane
    grpc_dir: str            # site-packages/grpc
    protobuf_dirs: tuple     # site-packages/google/protobuf and google/_upb (its C extension)
    typing_extensions: str   # site-packages/typing_extensions.py (grpc.aio imports it)
    typing_extensions_pyc: str | None  # its byte code, if the host has it (compiling it costs ~90 ms a boot)
    python: str              # the plane's interpreter binary (real path)
    stdlib: str              # its standard library dir (real path, .../pythonX.Y, lib-dynload inside)
    loader: str | None       # the host's ELF interpreter of that interpreter

    @property
    def guest_python(self):
        return "%s/bin/%s" % (AGENT_PYTHON_DIR, os.path.basename(self.python))

    @property
    def guest_stdlib(self):
        return "%s/lib/%s" % (AGENT_PYTHON_DIR, os.path.basename(self.stdlib))

    def binds(self, hostlib):
        """[(host path, guest path)] to bind read-only into a guest."""
        out = [(self.package_dir, AGENT_LIB + "/microvm_localplane"),
               (self.grpc_dir, AGENT_LIB + "/grpc")]
        out += [(d, AGENT_LIB + "/google/" + os.path.basename(d)) for d in self.protobuf_dirs]
        out.append((self.typing_extensions, AGENT_LIB + "/typing_extensions.py"))
        if self.typing_extensions_pyc:
            # a lone module has no __pycache__ of its own in the guest, and the guest's Python writes none
            out.append((self.typing_extensions_pyc, AGENT_LIB + "/__pycache__/" + os.path.basename(self.typing_extensions_pyc)))
        out.append((self.python, self.guest_python))
        out.append((self.stdlib, self.guest_stdlib))
        out.append((hostlib, AGENT_HOSTLIB_DIR))
        return out

    def masked_paths(self):
        """Guest paths to mask (OCI maskedPaths): the host's installed packages inside the bound stdlib dir."""
        return [self.guest_stdlib + "/" + d for d in INSTALLED_PACKAGE_DIRS if os.path.isdir(os.path.join(self.stdlib, d))]

    def mount_points(self):
        """[(guest path, is_dir)] the binds need (made in a template's skeleton layer, never in the guest's own)."""
        return [(g, os.path.isdir(h) or h == "x") for h, g in self.binds(hostlib="x")]

    def python_argv(self):
        """argv prefix that runs the plane's Python in a guest."""
        if not self.loader:
            return [self.guest_python]
        return [os.path.join(AGENT_HOSTLIB_DIR, os.path.basename(self.loader)), "--library-path", AGENT_HOSTLIB_DIR,
                self.guest_python]

    def compile_package(self):
        """Byte-compile this package in place (once; later calls only check mtimes): the guest imports it
        read-only and writes no byte code, so without this every guest boot compiles the agent's modules
        from source. A package dir we cannot write (an installed one has its byte code already) is left as is."""
        import compileall

        with contextlib.suppress(OSError):
            compileall.compile_dir(self.package_dir, quiet=2)

    def env(self):
        return {"PYTHONPATH": AGENT_LIB, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHOME": AGENT_PYTHON_DIR}

    def hostlib(self, state_dir):
        """A directory with the host C libraries the plane's Python and the agent's extensions need,
        built once per state dir and content."""
        objects = [self.python]
        for top in (self.grpc_dir, *self.protobuf_dirs, os.path.join(self.stdlib, "lib-dynload")):
            for dirpath, _dirs, files in os.walk(top):
                objects += [os.path.join(dirpath, f) for f in files if f.endswith(".so") or ".so." in f]
        # all of them, libpython included: nothing of the host's lib dirs is bound into a guest
        libs = _needed_libs(objects)
        if self.loader:
            libs.add(self.loader)
        key = hashlib.sha256("\n".join(sorted(libs)).encode()).hexdigest()[:12]
        path = os.path.join(state_dir, "hostlib", key)
        if os.path.isdir(path):
            return path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".build-")
        os.chmod(tmp, 0o755)
        for lib in sorted(libs):
            shutil.copy2(os.path.realpath(lib), os.path.join(tmp, os.path.basename(lib)))
        try:
            os.rename(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another manager built it first
        return path


def _needed_libs(paths):
    libs = set()
    for chunk in range(0, len(paths), 50):
        out = subprocess.run(["ldd", *paths[chunk:chunk + 50]], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            for part in line.split():
                if part.startswith("/") and ".so" in part and not part.endswith(":"):
                    libs.add(part)
    return libs


def elf_interpreter(path):
    """PT_INTERP of a 64-bit little-endian ELF executable (e.g. /lib64/ld-linux-x86-64.so.2), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return None
            phoff, = struct.unpack_from("<Q", head, 0x20)
            phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
            for i in range(phnum):
                f.seek(phoff + i * phentsize)
                p_type, _p_flags, p_offset, _p_vaddr, _p_paddr, p_filesz = struct.unpack("<IIQQQQ", f.read(40))
                if p_type == 3:  # PT_INTERP
                    f.seek(p_offset)
                    return f.read(p_filesz).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _pyc(source):
    """The byte code Python keeps for source (in its __pycache__), or None if there is none."""
    import importlib.util

    pyc = importlib.util.cache_from_source(source)
    return pyc if os.path.isfile(pyc) else None


def _stdlib_dir():
    """The real dir of the standard library, checked to be only that: the guest sees it whole."""
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    want = "python%d.%d" % sys.version_info[:2]
    if os.path.basename(stdlib) != want or not os.path.isfile(os.path.join(stdlib, "os.py")):
        raise HostPathsError("the plane's Python keeps its standard library in %s, not in a %s directory of its own: "
                             "guests get only that directory of the host, so run the plane on a Python installed the "
                             "usual way (a venv of Debian's python3, pyenv or python.org's)" % (stdlib, want))
    # In a guest, Python finds its extension modules at <stdlib>/lib-dynload (from PYTHONHOME): they must be there.
    for ext in {os.path.realpath(p) for p in sys.path if os.path.basename(p) == "lib-dynload"}:
        if ext != os.path.join(stdlib, "lib-dynload"):
            raise HostPathsError("the plane's Python keeps its extension modules in %s, outside its standard library "
                                 "(%s): guests get only that directory of the host, so run the plane on a Python whose "
                                 "lib-dynload is inside it (Debian's python3, pyenv or python.org's)" % (ext, stdlib))
    return stdlib


def code_paths():
    import google.protobuf
    import grpc
    import typing_extensions

    base_prefix = os.path.realpath(sys.base_prefix)
    real_python = os.path.realpath(sys.executable)
    if not real_python.startswith(base_prefix + "/"):
        real_python = os.path.join(base_prefix, "bin", "python%d.%d" % sys.version_info[:2])
    if not os.path.isfile(real_python):
        raise HostPathsError("cannot find the plane's Python interpreter (%s, from %s): guests run the agent on it"
                             % (real_python, sys.executable))
    interp = elf_interpreter(real_python)
    protobuf_dir = os.path.dirname(os.path.realpath(google.protobuf.__file__))
    upb_dir = os.path.join(os.path.dirname(protobuf_dir), "_upb")
    return CodePaths(
        package_dir=PACKAGE_DIR,
        grpc_dir=os.path.dirname(os.path.realpath(grpc.__file__)),
        protobuf_dirs=tuple(d for d in (protobuf_dir, upb_dir) if os.path.isdir(d)),
        typing_extensions=os.path.realpath(typing_extensions.__file__),
        typing_extensions_pyc=_pyc(os.path.realpath(typing_extensions.__file__)),
        python=real_python,
        stdlib=_stdlib_dir(),
        loader=os.path.realpath(interp) if interp else None,
    )
