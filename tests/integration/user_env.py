"""A user's machine, as far as tests can make one: a home directory of its own
under /var/tmp (outside any git work tree, so nothing can lean on this checkout's
git; never /tmp: guests mount their own), the built tarball installed there with a
plain `ansible-galaxy collection install`, and an environment with nothing of this
checkout in it (no ANSIBLE_COLLECTIONS_PATH, no PYTHONPATH)."""
import os
import shutil
import subprocess
import sys
import tempfile

from microvm_tarball import collection_tarball

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
USERS_DIR = "/var/tmp"
# What a developer's shell or the Makefile may have set that a user would not have.
CHECKOUT_VARS = ("ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_COLLECTIONS_PATHS", "ANSIBLE_ROLES_PATH", "ANSIBLE_CONFIG",
                 "ANSIBLE_INVENTORY", "PYTHONPATH", "DO_AGENTS_API_URL", "DO_AGENTS_API_TOKEN")


def run(args, env, cwd=None, timeout=1200):
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, check=False, text=True, timeout=timeout)


class UserHome:
    """A user with the collection installed from the tarball into ~/.ansible/collections."""

    def __init__(self, label):
        # Short: unix socket paths under ~/.ansible (the connection's multiplexer) must stay under 108 bytes.
        self.label = label
        self.root = tempfile.mkdtemp(prefix="microvm-u-", dir=USERS_DIR)
        os.chmod(self.root, 0o755)  # like a home's parent: guests' subordinate uids traverse it to plane state
        self.home = os.path.join(self.root, "home")
        os.makedirs(self.home)
        self.env = dict((k, v) for k, v in os.environ.items() if k not in CHECKOUT_VARS and not k.startswith("MOLECULE_"))
        self.env.update(HOME=self.home, PATH=BIN + os.pathsep + os.environ.get("PATH", ""),
                        ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", NO_COLOR="1")
        # The tarball of the tree as it is, built once per content for the whole run (tests/support/microvm_tarball.py).
        self.tarball = collection_tarball()
        inst = run([os.path.join(BIN, "ansible-galaxy"), "collection", "install", self.tarball], env=self.env)
        assert inst.returncode == 0, inst.stdout + inst.stderr
        self.collection = os.path.join(self.home, ".ansible", "collections", "ansible_collections", "microvm",
                                       "sandbox")
        assert os.path.isfile(os.path.join(self.collection, "MANIFEST.json")), inst.stdout

    def with_plane(self, plane):
        """The plane's URL and token (and road); not the test run's mux dir: a user's is under their own home."""
        return dict(self.env, **{k: v for k, v in plane.env.items() if k != "MICROVM_MUX_DIR"})

    def remove(self):
        shutil.rmtree(self.root, ignore_errors=True)
