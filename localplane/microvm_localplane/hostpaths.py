"""What of the host a guest gets to run its agent: a few read-only directories at a private path.

The agent (agent.py, guest_init.py) runs inside the guest's own root filesystem
on the plane's own Python runtime, whatever the template holds (a template may
have no Python, or one without what the agent relies on, such as tarfile's
extraction filters, which Debian bookworm's 3.11.2 lacks). It gets, read-only
and nothing else of the host:

- AGENT_DIR/python: the plane's Python installation prefix (its stdlib),
- AGENT_DIR/hostlib: the C libraries that runtime and the agent's extension
  modules need (copied once into the state dir by hostlib(); the agent runs
  through that dir's dynamic loader, so the template's own libc never matters),
- AGENT_DIR/lib: this package (microvm_localplane, with its own generated
  agent_pb package), grpcio and protobuf (the `grpc` and `google` packages of
  the plane's environment, and `typing_extensions`, which grpc imports).
  Nothing of the collection: the plane may be installed without a checkout.

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

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))          # .../microvm_localplane (checkout or site-packages)


@dataclass(frozen=True)
class CodePaths:
    package_dir: str         # microvm_localplane
    grpc_dir: str            # site-packages/grpc
    google_dir: str          # site-packages/google (protobuf and its C extension)
    typing_extensions: str   # site-packages/typing_extensions.py (grpc.aio imports it)
    typing_extensions_pyc: str | None  # its byte code, if the host has it (compiling it costs ~90 ms a boot)
    base_prefix: str         # the plane's Python installation (for templates without Python 3.11)
    python_rel: str          # its interpreter, relative to base_prefix
    loader: str | None       # the host's ELF interpreter of that interpreter

    def binds(self, hostlib):
        """[(host path, guest path)] to bind read-only into a guest."""
        out = [(self.package_dir, AGENT_LIB + "/microvm_localplane"),
               (self.grpc_dir, AGENT_LIB + "/grpc"),
               (self.google_dir, AGENT_LIB + "/google"),
               (self.typing_extensions, AGENT_LIB + "/typing_extensions.py")]
        if self.typing_extensions_pyc:
            # a lone module has no __pycache__ of its own in the guest, and the guest's Python writes none
            out.append((self.typing_extensions_pyc, AGENT_LIB + "/__pycache__/" + os.path.basename(self.typing_extensions_pyc)))
        out.append((self.base_prefix, AGENT_PYTHON_DIR))
        out.append((hostlib, AGENT_HOSTLIB_DIR))
        return out

    def mount_points(self):
        """[(guest path, is_dir)] the binds need (made in a template's skeleton layer, never in the guest's own)."""
        return [(g, os.path.isdir(h) or h == "x") for h, g in self.binds(hostlib="x")]

    def python_argv(self):
        """argv prefix that runs the plane's Python in a guest."""
        python = os.path.join(AGENT_PYTHON_DIR, self.python_rel)
        if not self.loader:
            return [python]
        libs = AGENT_HOSTLIB_DIR + ":" + AGENT_PYTHON_DIR + "/lib"
        return [os.path.join(AGENT_HOSTLIB_DIR, os.path.basename(self.loader)), "--library-path", libs, python]

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
        objects = [os.path.join(self.base_prefix, self.python_rel)]
        stdlib = os.path.join(self.base_prefix, "lib", "python%d.%d" % sys.version_info[:2], "lib-dynload")
        for top in (self.grpc_dir, self.google_dir, stdlib):
            for dirpath, _dirs, files in os.walk(top):
                objects += [os.path.join(dirpath, f) for f in files if f.endswith(".so") or ".so." in f]
        libs = _needed_libs(objects)
        libs = {p for p in libs if not p.startswith(self.base_prefix + "/")}
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


def code_paths():
    import google.protobuf
    import grpc
    import typing_extensions

    base_prefix = os.path.realpath(sys.base_prefix)
    real_python = os.path.realpath(sys.executable)
    if not real_python.startswith(base_prefix + "/"):
        real_python = os.path.join(base_prefix, "bin", "python%d.%d" % sys.version_info[:2])
    interp = elf_interpreter(real_python)
    return CodePaths(
        package_dir=PACKAGE_DIR,
        grpc_dir=os.path.dirname(os.path.realpath(grpc.__file__)),
        google_dir=os.path.dirname(os.path.dirname(os.path.realpath(google.protobuf.__file__))),
        typing_extensions=os.path.realpath(typing_extensions.__file__),
        typing_extensions_pyc=_pyc(os.path.realpath(typing_extensions.__file__)),
        base_prefix=base_prefix,
        python_rel=os.path.relpath(real_python, base_prefix),
        loader=os.path.realpath(interp) if interp else None,
    )
