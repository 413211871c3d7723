"""Where the host's Python and the plane's code live, derived from this file and sys.executable.

The guest runs the agent with the host's venv Python and this package (with its
own generated stubs), bound read-only into the guest at the same paths (so no
path is ever rewritten). Only these code paths are bound: never a repo root,
which may hold a state dir. Nothing of the collection is needed in a guest.
"""
import os
import struct
import sys
from dataclasses import dataclass

# Where the host's dynamic loader and C libraries appear inside a "dir" guest, whose own
# userland may be anything (musl, distroless): the host's Python runs through them there.
GUEST_HOSTLIB_DIR = "/run/localplane-hostlib"

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))          # .../microvm_localplane
LOCALPLANE_DIR = os.path.dirname(PACKAGE_DIR)                      # its parent: a checkout's localplane/ or site-packages


@dataclass(frozen=True)
class CodePaths:
    python: str              # the interpreter to run in the guest (venv python)
    venv: str                # sys.prefix
    base_prefix: str         # the real Python installation the venv points to
    package_dir: str         # microvm_localplane
    localplane_dir: str      # PYTHONPATH entry for microvm_localplane
    loader: str | None = None  # the host's ELF interpreter for `python` (real path)

    @property
    def host_lib_dir(self):
        return os.path.dirname(self.loader) if self.loader else None

    def python_argv(self, own_userland):
        """argv prefix that runs the host Python in a guest; through the host's loader unless
        the guest's userland is the host's (kind "host")."""
        if own_userland or not self.loader:
            return [self.python]
        guest_loader = os.path.join(GUEST_HOSTLIB_DIR, os.path.basename(self.loader))
        libs = GUEST_HOSTLIB_DIR + ":" + os.path.join(self.base_prefix, "lib")
        return [guest_loader, "--library-path", libs, self.python]

    def read_only_binds(self):
        """Host paths to bind read-only into every guest at the same path."""
        paths = [self.base_prefix, self.venv, self.package_dir]
        # A venv inside the base prefix (or the reverse) needs only the outer bind.
        unique = []
        for p in sorted(set(paths), key=len):
            if not any(p == u or p.startswith(u + "/") for u in unique):
                unique.append(p)
        return unique

    def pythonpath(self):
        return self.localplane_dir


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


def code_paths():
    base_prefix = os.path.realpath(sys.base_prefix)
    interp = elf_interpreter(os.path.realpath(sys.executable))
    return CodePaths(
        python=sys.executable,
        venv=os.path.abspath(sys.prefix),
        base_prefix=base_prefix,
        package_dir=PACKAGE_DIR,
        localplane_dir=LOCALPLANE_DIR,
        loader=os.path.realpath(interp) if interp else None,
    )
