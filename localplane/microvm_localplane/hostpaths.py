"""Where the host's Python and the repo's code live, derived from this file and sys.executable.

The guest runs the agent with the host's venv Python and the repo's code, bound
read-only into the guest at the same paths (so no path is ever rewritten).
Only these code paths are bound: never the repo root, which may hold a state dir.
"""
import os
import sys
from dataclasses import dataclass

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))          # .../localplane/microvm_localplane
LOCALPLANE_DIR = os.path.dirname(PACKAGE_DIR)                      # .../localplane
REPO_DIR = os.path.dirname(LOCALPLANE_DIR)                         # collection root


@dataclass(frozen=True)
class CodePaths:
    python: str              # the interpreter to run in the guest (venv python)
    venv: str                # sys.prefix
    base_prefix: str         # the real Python installation the venv points to
    package_dir: str         # microvm_localplane
    localplane_dir: str      # PYTHONPATH entry for microvm_localplane
    plugins_dir: str         # the collection's plugins (agent_pb stubs)
    collections_dir: str     # .local/collections (ansible_collections/microvm/sandbox -> repo)

    def read_only_binds(self):
        """Host paths to bind read-only into every guest at the same path."""
        paths = [self.base_prefix, self.venv, self.package_dir, self.plugins_dir, self.collections_dir]
        # A venv inside the base prefix (or the reverse) needs only the outer bind.
        unique = []
        for p in sorted(set(paths), key=len):
            if not any(p == u or p.startswith(u + "/") for u in unique):
                unique.append(p)
        return unique

    def pythonpath(self):
        return os.pathsep.join([self.collections_dir, self.localplane_dir])


def code_paths():
    base_prefix = os.path.realpath(sys.base_prefix)
    return CodePaths(
        python=sys.executable,
        venv=os.path.abspath(sys.prefix),
        base_prefix=base_prefix,
        package_dir=PACKAGE_DIR,
        localplane_dir=LOCALPLANE_DIR,
        plugins_dir=os.path.join(REPO_DIR, "plugins"),
        collections_dir=os.path.join(REPO_DIR, ".local", "collections"),
    )
