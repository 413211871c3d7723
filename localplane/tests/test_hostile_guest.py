"""The hostile guest, against the plane and the agent: what the guest's unprivileged user, or root, can try.

Real runc guests and the real agent over gRPC (guestkit). The guest's unprivileged user is the base template's
`sandbox`; commands run as it with `runuser` (no password needed from root). See docs/guarantees.md, "Hostile
guest".
"""

import grpc
import pytest
from guestkit import Plane, guests_supported, run, sh

from microvm_localplane import baseimage

pytestmark = [pytest.mark.skipif(not guests_supported(), reason="needs root, runc and subordinate ids (make system-deps)"),
              pytest.mark.timeout(600)]

CODE = grpc.StatusCode
ROOT_PASSWORD = "r00t-Pw-7c1f9e"
USER_PASSWORD = "us3r-Pw-52aa0d"


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    p = Plane(str(tmp_path_factory.mktemp("hostile-state")))
    yield p
    p.close()


@pytest.fixture(scope="module")
def stub(plane):
    """A guest whose session sets both account passwords (as secrets do: the plane writes them to its run dir)."""
    g = plane.boot("hostile", env={"SANDBOX_ROOT_PASSWORD": ROOT_PASSWORD, "SANDBOX_USER_PASSWORD": USER_PASSWORD,
                                   "PLAIN_SETTING": "visible"})
    return plane.stub(g)


def as_user(stub, script, **kw):
    """A shell script run as the guest's unprivileged user."""
    return run(stub, ["runuser", "-u", baseimage.GUEST_USER, "--", "sh", "-c", script], **kw)


# ------------------------------------------------------------------ the account passwords

def test_the_account_passwords_reach_no_command_environment(stub):
    root_env = run(stub, ["env"]).stdout.decode()
    assert "PLAIN_SETTING=visible" in root_env  # the rest of the session env still does
    user = as_user(stub, "env; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do cat $f 2>/dev/null; echo; done;"
                         " cat /run/localplane/session-env.json 2>&1; true")
    assert user.code == 0, user.stderr
    for text in (root_env, user.stdout.decode(errors="replace")):
        assert "PASSWORD" not in text and ROOT_PASSWORD not in text and USER_PASSWORD not in text
    assert b"Permission denied" in user.stdout  # the run dir's env file is root's alone
    # what root's processes hold: PID 1's and the agent's own environment
    agent = sh(stub, "cat /proc/1/environ /proc/$(cat /run/localplane/agent.pid)/environ").stdout
    assert b"PASSWORD" not in agent and ROOT_PASSWORD.encode() not in agent


def test_su_needs_roots_password_which_the_user_cannot_read(stub):
    # the passwords were set at boot: with root's password, su works...
    ok = as_user(stub, "printf '%s\\n' | su -c 'id -u' root" % ROOT_PASSWORD)
    assert ok.stdout.strip().endswith(b"0"), (ok.stdout, ok.stderr)
    # ...and without it, from what the user can see, it does not
    for guess in ("", "$SANDBOX_ROOT_PASSWORD", USER_PASSWORD):
        r = as_user(stub, "printf '%%s\\n' \"%s\" | su -c 'id -u' root" % guess)
        assert r.code != 0 and not r.stdout.strip().endswith(b"0"), (guess, r.stdout, r.stderr)
    # sudo takes the user's own password (its documented use), never root's from the environment
    r = as_user(stub, "printf '%s\\n' | sudo -S -k id -u" % USER_PASSWORD)
    assert r.stdout.strip() == b"0", r.stderr
