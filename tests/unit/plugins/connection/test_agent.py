"""The connection plugin's option handling, scratch defaults, error mapping and become interaction.

The mux is replaced by a fake here (unit tests only); tests/integration runs the real stack.
"""
import pytest
from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound
from ansible.playbook.play_context import PlayContext
from ansible.plugins.loader import become_loader, connection_loader, init_plugin_loader

from ansible_collections.microvm.sandbox.plugins.connection import agent as agent_plugin
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import agent_connection
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp

init_plugin_loader()
NAME = "microvm.sandbox.agent"


def new_connection(pid="4242"):
    """The plugin as ansible-core's loader makes it (the tests import the collection as a plain package)."""
    connection_loader._load_config_defs(NAME, agent_plugin, agent_plugin.__file__)
    conn = agent_plugin.Connection(PlayContext(), task_uuid="u", ansible_playbook_pid=pid)
    conn._load_name = NAME
    return conn


@pytest.fixture
def conn(monkeypatch):
    monkeypatch.delenv("ANSIBLE_PIPELINING", raising=False)
    monkeypatch.delenv("MICROVM_SCRATCH_DIR", raising=False)
    c = new_connection()
    c.set_options(var_options={"inventory_hostname": "box", "ansible_host": "my-session"})
    c._shell.set_options(var_options={})
    return c


def test_defaults(conn):
    assert conn.has_pipelining and conn.get_option("pipelining") is True
    assert conn.is_pipelining_enabled()
    assert conn.get_option("remote_addr") == "my-session"
    assert conn.get_option("route_prefix") == "/v2/harness-runtime"
    assert conn.get_option("agent_port") == 8443
    assert conn.get_option("scratch_dir") == "/workspace/.scratch"
    assert conn.get_option("command_timeout") == 0
    assert conn.transport == "microvm.sandbox.agent"


def test_remote_tmp_defaults_under_the_scratch_dir(conn):
    assert conn._shell.get_option("remote_tmp") == "/workspace/.scratch/ansible-tmp"


def test_remote_tmp_follows_a_custom_scratch_dir():
    c = new_connection("1")
    c.set_options(var_options={"ansible_microvm_scratch_dir": "/workspace/my-scratch"})
    c._shell.set_options(var_options={})
    assert c._shell.get_option("remote_tmp") == "/workspace/my-scratch/ansible-tmp"


def test_user_remote_tmp_outside_the_workspace_is_kept(conn):
    """remote_tmp may be anywhere in the guest: its files are staged through the scratch dir like any put."""
    conn._shell.set_options(var_options={"ansible_remote_tmp": "/tmp/elsewhere"})
    assert conn._shell.get_option("remote_tmp") == "/tmp/elsewhere"
    conn._check_paths()
    assert conn._shell.get_option("remote_tmp") == "/tmp/elsewhere"


def test_home_relative_remote_tmp_is_inside_the_workspace(conn):
    conn._shell.set_options(var_options={"ansible_remote_tmp": "~/.ansible/custom"})
    conn._check_paths()


def test_scratch_outside_workspace_fails_at_connect_before_any_mux(monkeypatch):
    c = new_connection("1")
    c.set_options(var_options={"ansible_microvm_scratch_dir": "/tmp/scratch", "ansible_microvm_api_token": "t"})
    c._shell.set_options(var_options={})
    monkeypatch.setattr("ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.agent_connection.MuxClient",
                        lambda *a, **k: pytest.fail("no mux may be started"))
    with pytest.raises(AnsibleError, match=r"scratch dir '/tmp/scratch' must be an absolute directory inside /workspace"):
        c._connect()


def test_missing_token_is_unreachable_and_names_the_options(conn, monkeypatch):
    monkeypatch.delenv("DO_AGENTS_API_TOKEN", raising=False)
    with pytest.raises(AnsibleConnectionFailure, match="api_token.*DO_AGENTS_API_TOKEN"):
        conn._connect()


def test_tmpdir_is_set_last_in_the_module_environment(conn):
    prefix = conn._shell.env_prefix(TMPDIR="/tmp", LANG="C")
    run_dir = conn._run_info()["dir"]
    assert prefix.endswith("TMPDIR=%s" % run_dir)
    assert "TMPDIR=/tmp" not in prefix and prefix.startswith("LANG=C ")
    assert run_dir.startswith("/workspace/.scratch/run.")
    assert "-4242-" in run_dir  # the run is named after the ansible-playbook process


def test_run_identity_is_shared_by_the_tasks_of_a_run():
    a = new_connection("77")
    b = new_connection("77")
    for c in (a, b):
        c.set_options(var_options={})
    assert a._run_info() == b._run_info()


class FakeMux:
    def __init__(self, result=None, error=None, road="agent"):
        self.result = result or (0, b"out", b"err", {"rc": 0})
        self.error = error
        self.calls = []
        self.attached = {"road": road}  # the mux's attach answer

    def exec(self, argv, **kw):
        self.calls.append(("exec", argv, kw))
        if self.error:
            raise self.error
        if kw.get("interact"):  # as the real client does: the output is shown to the become interaction
            kw["interact"](self.result[1], self.result[2])
        return self.result

    def put(self, local, remote, run=None, ahead=None):
        self.calls.append(("put", local, remote) + ((ahead,) if ahead else ()))
        if self.error:
            raise self.error
        return getattr(self, "put_result", None)

    def fetch(self, remote, local, run=None):
        self.calls.append(("fetch", remote, local))
        if self.error:
            raise self.error

    def close(self):
        pass


def connected(conn, mux):
    conn._mux_client = mux
    conn._connected = True
    return conn


def test_exec_sends_argv_tmpdir_and_stdin(conn):
    mux = FakeMux()
    rc, out, err = connected(conn, mux).exec_command("echo hi", in_data=b"payload")
    assert (rc, out, err) == (0, b"out", b"err")
    argv, kw = mux.calls[0][1:]
    assert argv == ["/bin/sh", "-c", "echo hi"]
    assert kw["stdin"] == b"payload" and kw["env"]["TMPDIR"] == conn._run_info()["dir"]
    assert kw["interact"] is None


@pytest.mark.parametrize("cmd, argv", [
    ("/bin/sh -c 'echo ~ && sleep 0'", ["/bin/sh", "-c", "echo ~ && sleep 0"]),
    ("/bin/sh -c 'a' 'b'", ["/bin/sh", "-c", "/bin/sh -c 'a' 'b'"]),
    ("echo 'unbalanced", ["/bin/sh", "-c", "echo 'unbalanced"]),
    ("/bin/sh -c 'unbalanced", ["/bin/sh", "-c", "/bin/sh -c 'unbalanced"]),
])
def test_command_argv_skips_a_redundant_shell(cmd, argv):
    assert agent_connection.command_argv("/bin/sh", cmd) == argv


def test_command_timeout_names_the_option(conn):
    conn.set_options(var_options={"ansible_microvm_command_timeout": 5})
    with pytest.raises(AnsibleError, match=r"timed out after 5s \(option command_timeout\)"):
        connected(conn, FakeMux(result=(143, b"", b"", {"rc": 143, "timed_out": True}))).exec_command("sleep 9")


def test_a_command_rejected_for_approval_names_the_permission_setting(conn):
    # ExecExit.hitl_rejected: the session's policy held the command for a person, who was not there.
    with pytest.raises(AnsibleError, match=r"hitl_rejected.*permissions\.default resolves to ask.*default: allow"):
        connected(conn, FakeMux(result=(1, b"", b"", {"rc": 1, "hitl_rejected": True}))).exec_command("id")


@pytest.mark.parametrize("kind, exc", [
    (mp.ERR_LOST, AnsibleConnectionFailure), (mp.ERR_GONE, AnsibleConnectionFailure),
    (mp.ERR_UNREACHABLE, AnsibleConnectionFailure), (mp.ERR_NOT_FOUND, AnsibleFileNotFound),
    (mp.ERR_DENIED, AnsibleError), (mp.ERR_PATH, AnsibleError), (mp.ERR_FAILED, AnsibleError)])
def test_mux_errors_map_to_ansible_outcomes(conn, kind, exc):
    c = connected(conn, FakeMux(error=errors.from_frame({"kind": kind, "message": "session box is DESTROYED"})))
    with pytest.raises(exc, match="session box is DESTROYED") as e:
        c.fetch_file("/workspace/x", "/tmp/x")
    if exc is AnsibleError:
        assert not isinstance(e.value, AnsibleConnectionFailure)


def test_mux_socket_failure_is_unreachable(conn):
    with pytest.raises(AnsibleConnectionFailure, match="lost the multiplexer"):
        connected(conn, FakeMux(error=BrokenPipeError(32, "Broken pipe"))).exec_command("true")


def test_put_of_a_missing_local_file(conn, tmp_path):
    with pytest.raises(AnsibleFileNotFound):
        connected(conn, FakeMux()).put_file(str(tmp_path / "nope"), "/workspace/x")


def test_put_and_fetch_pass_any_guest_path(conn, tmp_path):
    f = tmp_path / "a file ☃"
    f.write_text("x")
    mux = FakeMux()
    connected(conn, mux)
    conn.put_file(str(f), "/etc/x")
    conn.fetch_file("/var/log/x", str(tmp_path / "y"))
    assert mux.calls[0] == ("put", str(f), "/etc/x")
    assert mux.calls[1] == ("fetch", "/var/log/x", str(tmp_path / "y"))


def enc(text):
    return text.encode()


def become(conn, method, password):
    b = become_loader.get(method)
    b.set_options(direct={"become_pass": password} if password else {})
    conn.set_become_plugin(b)
    b.build_become_command("/bin/sh -c true", conn._shell)
    return b


def test_sudo_password_prompt_is_answered_once_then_stdin_released(conn):
    bp = become(conn, "ansible.builtin.sudo", "pw")
    prompted, succeeded = [], []
    interact = conn._become_interaction(prompted, succeeded)
    prompt = enc("[sudo via ansible, key=%s] password:" % bp._id)
    assert interact(b"", b"") is None
    assert interact(b"", prompt) == b"pw\n"
    assert interact(b"", prompt) is None  # the same output again: the prompt was answered
    assert interact(enc("%s\n" % bp.success), prompt) is True
    assert prompted and succeeded


def test_a_second_sudo_prompt_is_a_duplicate_and_sorry_is_an_incorrect_password(conn):
    bp = become(conn, "ansible.builtin.sudo", "wrong")
    prompt = enc("[sudo via ansible, key=%s] password:" % bp._id)
    interact = conn._become_interaction([], [])
    assert interact(b"", prompt) == b"wrong\n"
    with pytest.raises(AnsibleError, match="^Duplicate become password prompt encountered waiting for become success"):
        interact(b"", prompt + prompt)
    interact = conn._become_interaction([], [])
    assert interact(b"", prompt) == b"wrong\n"
    with pytest.raises(AnsibleError, match="^Incorrect sudo password$"):
        interact(b"", prompt + b"\nSorry, try again.\n" + prompt)


def test_a_refused_su_password_is_an_incorrect_su_password(conn):
    become(conn, "ansible.builtin.su", "wrong")
    interact = conn._become_interaction([], [])
    assert interact(b"Password: ", b"") == b"wrong\n"
    with pytest.raises(AnsibleError, match="^Incorrect su password$"):
        interact(b"Password: ", b"su: Authentication failure\n")


class Frames:
    """Output fed to an interaction as the mux client does: growing buffers, one call per arriving frame."""

    def __init__(self, interact):
        self.interact, self.out, self.err = interact, bytearray(), bytearray()

    def __call__(self, *chunks):
        answers = []
        for stream, chunk in chunks:
            (self.out if stream == "out" else self.err).extend(chunk)
            answers.append(self.interact(self.out, self.err))
        return answers


def test_a_sudo_prompt_and_success_marker_split_across_frames_are_found(conn):
    bp = become(conn, "ansible.builtin.sudo", "pw")
    prompt, success = enc("[sudo via ansible, key=%s] password:" % bp._id), enc("\n%s\n" % bp.success)
    feed = Frames(conn._become_interaction([], []))
    assert feed(("err", b"motd line\n" * 1000), ("err", prompt[:9]), ("err", prompt[9:])) == [None, None, b"pw\n"]
    answers = feed(*[("out", success[i:i + 5]) for i in range(0, len(success), 5)])
    assert answers[-1] is True and set(answers[:-1]) == {None}


def test_a_su_prompt_after_megabytes_of_output_is_found_looking_at_new_output_only(conn, monkeypatch):
    """Each look covers what arrived since the last one plus a bounded tail, not the whole output (O(n^2))."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import become_scan
    bp = become(conn, "ansible.builtin.su", "pw")
    looked = []
    check = bp.check_password_prompt
    monkeypatch.setattr(bp, "check_password_prompt", lambda data: looked.append(len(data)) or check(data))
    feed = Frames(conn._become_interaction([], []))
    answers = feed(*[("out", b"x" * 65536)] * 64 + [("out", b"Pass"), ("out", b"word: ")])
    assert answers[-1] == b"pw\n" and set(answers[:-1]) == {None}
    assert max(looked) <= 65536 + become_scan.OVERLAP
    # the answered prompt is not seen again, in output that follows it either
    assert feed(("out", b"y" * 100000), ("err", b"z")) == [None, None]


def test_a_prompt_cut_at_the_tails_edge_is_not_taken_for_one_at_a_line_start(conn):
    """sudo's prompt counts only at the start of a line: a look's tail begins at a line start when one is in reach."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import become_scan
    bp = become(conn, "ansible.builtin.sudo", "pw")
    prompt = enc("[sudo via ansible, key=%s] password:" % bp._id)
    # the next look's tail, OVERLAP bytes back, would begin right at the prompt in the middle of this line
    first = b"not a prompt: " + prompt + b"\n" + b"m" * (become_scan.OVERLAP - len(prompt) - 1)
    feed = Frames(conn._become_interaction([], []))
    assert feed(("err", first), ("err", b"more\n")) == [None, None]
    assert feed(("err", prompt)) == [b"pw\n"]  # a real one, at a line start


def test_sorry_before_the_answered_prompt_is_not_an_incorrect_password_but_after_it_is(conn):
    bp = become(conn, "ansible.builtin.sudo", "pw")
    prompt = enc("[sudo via ansible, key=%s] password:" % bp._id)
    feed = Frames(conn._become_interaction([], []))
    assert feed(("err", b"Sorry, try again.\n" + prompt), ("err", b"\n")) == [b"pw\n", None]
    with pytest.raises(AnsibleError, match="^Incorrect sudo password$"):
        feed(("err", b"Sorry, try"), ("err", b" again.\n"))


def test_a_become_command_that_ends_before_success_fails_with_its_output(conn):
    become(conn, "ansible.builtin.su", "pw")
    mux = FakeMux(result=(1, b"Passwort: ", b"su: Fehler bei der Authentifizierung\n", {"rc": 1}))
    with pytest.raises(AnsibleError, match=r"(?s)^Premature end of stream waiting for become success\..*"
                                           r"Fehler bei der Authentifizierung"):
        connected(conn, mux).exec_command("su ...", in_data=b"x")


def test_sudo_on_the_api_road_sends_its_password_first_on_the_one_shot_stdin(conn):
    """No interaction (the api road has no stdin while a command runs): the password line, then the module's stdin,
    through a guest-side script that drops the line where sudo will not ask; the output is judged afterwards."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import one_shot_become
    bp = become(conn, "ansible.builtin.sudo", "pw")
    prompt = "[sudo via ansible, key=%s] password:" % bp._id
    mux = FakeMux(result=(0, enc("BECOME-SUCCESS-%s\nroot\n" % bp._id), enc(prompt), {"rc": 0}), road="api")
    rc, out, err = connected(conn, mux).exec_command("sudo ...", in_data=b"payload")
    _kind, argv, kw = mux.calls[0]
    assert argv[:5] == ["/bin/sh", "-c", one_shot_become.PASSWORD_FIRST, "sh", "sudo"] and argv[5:] == ["/bin/sh", "-c", "sudo ..."]
    assert kw["stdin"] == b"pw\npayload" and kw["interact"] is None
    assert rc == 0 and prompt.encode() not in err  # judged as the interaction would: prompted, then stripped
    mux = FakeMux(result=(1, b"", enc(prompt + "\nSorry, try again.\n" + prompt), {"rc": 1}), road="api")
    with pytest.raises(AnsibleError, match="Incorrect sudo password"):
        connected(conn, mux).exec_command("sudo ...", in_data=b"payload")


class GuardedMux(FakeMux):
    """The api road's mux for su: the guard of one_shot_become.ROOT_FIRST answers as `uid` would (its marker and
    125 when not root), the command as `result` says."""

    def __init__(self, uid, result):
        super().__init__(result=result, road="api")
        self.uid = uid

    def exec(self, argv, **kw):
        from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import one_shot_become
        if argv[:3] == ["/bin/sh", "-c", one_shot_become.ROOT_FIRST] and self.uid != 0:
            self.calls.append(("exec", argv, kw))
            return (125, b"", argv[4].encode() + b"\n", {"rc": 125})
        return super().exec(argv, **kw)


def test_su_on_the_api_road_runs_as_root_without_asking_for_stdin(conn):
    """su from root asks nothing, even with a become password set: it runs on the buffered exec (no interactive
    stdin needed), judged afterwards. (Without a password core expects no prompt: no interaction either way.)"""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import one_shot_become
    bp = become(conn, "ansible.builtin.su", "pw")
    mux = GuardedMux(0, (0, enc("%s\nroot\n" % bp.success), b"", {"rc": 0}))
    rc, out, _err = connected(conn, mux).exec_command("su ...", in_data=b"payload")
    assert rc == 0 and b"root" in out and len(mux.calls) == 1
    _kind, argv, kw = mux.calls[0]
    assert argv[:4] == ["/bin/sh", "-c", one_shot_become.ROOT_FIRST, "sh"] and argv[5:] == ["/bin/sh", "-c", "su ..."]
    assert kw["stdin"] == b"payload" and kw["interact"] is None
    mux = GuardedMux(0, (1, b"", b"su: user nobody does not exist\n", {"rc": 1}))  # su itself failed
    with pytest.raises(AnsibleError, match="Premature end of stream"):
        connected(conn, mux).exec_command("su ...", in_data=b"payload")


def test_su_that_would_prompt_on_the_api_road_answers_it_on_interactive_stdin(conn):
    """Not root: the guard stops before su (nothing ran), and su runs again with the interaction, which needs the
    team's interactive stdin (the mux refuses it at once without); later su commands go there at once."""
    bp = become(conn, "ansible.builtin.su", "pw")
    mux = GuardedMux(1000, (0, enc("Password: \n%s\nroot\n" % bp.success), b"", {"rc": 0}))
    rc, _out, _err = connected(conn, mux).exec_command("su ...", in_data=b"x")
    assert rc == 0 and [c[2]["interact"] is not None for c in mux.calls] == [False, True]
    assert mux.calls[1][1] == ["/bin/sh", "-c", "su ..."]
    connected(conn, mux).exec_command("su ...", in_data=b"x")
    assert len(mux.calls) == 3 and mux.calls[2][2]["interact"] is not None


def test_su_that_asks_root_too_or_another_become_exe_goes_to_interactive_stdin(conn):
    """A su that prompts root all the same gave up on the empty stdin (nothing ran): it runs again with the
    interaction. Another become_exe (which may ask root) goes there at once."""
    bp = become(conn, "ansible.builtin.su", "pw")

    class AsksRootToo(GuardedMux):
        def exec(self, argv, **kw):
            if kw.get("interact") is None:
                self.calls.append(("exec", argv, kw))
                return (1, b"Password: ", b"su: Authentication failure\n", {"rc": 1})
            return super().exec(argv, **kw)

    mux = AsksRootToo(0, (0, enc("Password: \n%s\nroot\n" % bp.success), b"", {"rc": 0}))
    rc, _out, _err = connected(conn, mux).exec_command("su ...", in_data=b"x")
    assert rc == 0 and [c[2]["interact"] is not None for c in mux.calls] == [False, True]
    conn._su_prompts = False
    bp.set_options(direct={"become_pass": "pw", "become_exe": "/usr/local/bin/my-su"})
    mux = GuardedMux(0, (0, enc("Password: \n%s\nroot\n" % bp.success), b"", {"rc": 0}))
    connected(conn, mux).exec_command("su ...", in_data=b"x")
    assert len(mux.calls) == 1 and mux.calls[0][2]["interact"] is not None


def test_become_timeout_is_unreachable_in_cores_words(conn):
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import InteractTimeout
    become(conn, "ansible.builtin.su", "pw")
    conn.set_options(var_options={"ansible_become_timeout": 3})
    mux = FakeMux(error=InteractTimeout(b"Passwort: ", b""))
    with pytest.raises(AnsibleConnectionFailure, match=r"(?s)^Timed out \(3s, option become_timeout\) waiting for "
                                                       r"become success or become password prompt\..*Passwort:"):
        connected(conn, mux).exec_command("su ...", in_data=b"x")
    assert mux.calls[0][2]["interact_timeout"] == 3


def test_task_messages_are_not_extended_by_their_cause(conn):
    """ansible-core 2.19+ appends an error's cause to the task message unless the message already ends with it."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import InteractTimeout
    become(conn, "ansible.builtin.su", "pw")
    timeout = InteractTimeout(b"Passwort: ", b"")
    timeout.__cause__ = TimeoutError("timed out")  # as the client raises it
    with pytest.raises(AnsibleConnectionFailure) as e:
        connected(conn, FakeMux(error=timeout)).exec_command("su ...", in_data=b"x")
    assert str(e.value).rstrip().endswith("Passwort:")  # the guest's output is summarised once, nothing after it
    mux_failure = errors.CommandLost("session box is DESTROYED")
    with pytest.raises(AnsibleConnectionFailure) as e:
        connected(conn, FakeMux(error=mux_failure)).fetch_file("/workspace/x", "/tmp/x")
    assert str(e.value) == "microvm.sandbox.agent: session box is DESTROYED" and e.value.__cause__ is mux_failure


def test_become_timeout_below_one_means_the_default(conn):
    conn.set_options(var_options={"ansible_become_timeout": 0})
    assert conn._become_timeout() == agent_connection.BECOME_TIMEOUT_DEFAULT == 10


def test_become_without_password_needs_no_interaction(conn):
    become(conn, "ansible.builtin.sudo", None)
    mux = FakeMux()
    connected(conn, mux).exec_command("sudo ...", in_data=b"x")
    assert mux.calls[0][2]["interact"] is None


def test_become_with_password_interacts(conn):
    bp = become(conn, "ansible.builtin.sudo", "pw")
    mux = FakeMux(result=(0, enc("%s\nout" % bp.success), b"", {"rc": 0}))
    connected(conn, mux).exec_command("sudo ...", in_data=b"x")
    assert mux.calls[0][2]["interact"] is not None


@pytest.mark.parametrize("user, become_user, path, shown", [
    (None, None, "~root", "~"),              # ansible_user unset: core asks for ~root (play_context's user) too
    ("root", None, "~root", "~"),
    ("root", None, "~", "~"),
    ("root", None, "~sandbox", "~sandbox"),  # someone else's home: their passwd entry
    ("sandbox", None, "~sandbox", "~"),      # it runs with HOME from its passwd entry anyway
    ("root", "root", "~root", "~root"),      # sudo and su set HOME from the passwd entry
    ("root", "sandbox", "~root", "~"),
])
def test_the_connection_users_home_is_the_home_its_commands_run_with(conn, user, become_user, path, shown):
    if user:
        conn.set_options(var_options={"inventory_hostname": "box", "ansible_host": "s", "ansible_user": user})
    if become_user:
        b = become_loader.get("ansible.builtin.sudo")
        b.set_options(direct={"become_user": become_user})
        conn.set_become_plugin(b)
    assert conn._shell.expand_user(path) == "echo %s" % shown


@pytest.mark.parametrize("action, keeps", [("tempfile", True), ("ansible.builtin.tempfile", True),
                                           ("ansible.legacy.tempfile", True), ("ansible.builtin.command", False)])
def test_tempfile_runs_without_the_runs_tmpdir(conn, action, keeps):
    conn._shell.set_options(task_keys={"action": action}, var_options={})
    prefix = conn._shell.env_prefix(FOO="1")
    assert ("TMPDIR=" in prefix) is not keeps
    mux = FakeMux()
    connected(conn, mux).exec_command("/bin/sh -c 'true'")
    assert ("TMPDIR" in mux.calls[0][2]["env"]) is not keeps


def test_documentation_parses():
    import yaml
    doc = yaml.safe_load(agent_plugin.DOCUMENTATION)
    assert doc["name"] == "agent"
    assert doc["options"]["pipelining"]["default"] is True
    # Ansible's configuration takes the last variable set: ours wins over doctl's and community.digitalocean's.
    assert doc["options"]["api_token"]["env"] == [{"name": "DIGITALOCEAN_ACCESS_TOKEN"}, {"name": "DIGITALOCEAN_TOKEN"},
                                                  {"name": "DO_AGENTS_API_TOKEN"}]
    assert all(isinstance(n, str) for n in doc["notes"])


def test_a_become_interaction_without_a_become_plugin_is_a_clear_error(conn):
    assert conn.become is None
    with pytest.raises(AnsibleError, match="needs a become plugin"):
        conn._become_interaction([], [])


def test_the_action_plugins_take_this_connection_as_theirs_and_no_other(conn):
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.sandbox_connection import sandbox_connection
    assert sandbox_connection(conn, "exec_stream") is conn
    assert sandbox_connection(conn, "put_archive") is conn
    local = connection_loader.get("ansible.builtin.local", PlayContext())
    assert sandbox_connection(local, "exec_stream") is None and sandbox_connection(local, "put_archive") is None


class WarmMux(FakeMux):
    """A mux with a warm runner: module runs and tmp ops answered (or refused), each call recorded."""

    def __init__(self, refuse_warm=False, tmp_result=(0, b"", b"", {"rc": 0})):
        super().__init__()
        self.attached = {"road": "api", "version": mp.PROTOCOL_VERSION}
        self.refuse_warm = refuse_warm
        self.tmp_result = tmp_result

    def warm(self, interpreter, env, payload, run=None, core="", before=None):
        self.calls.append(("warm", interpreter, before))
        if self.refuse_warm:
            raise errors.WarmRefused("the deferred chmod before the module: FileNotFoundError")
        return 0, b"{}", b"", {"rc": 0, "warm": True}

    def tmp(self, op, run=None):
        self.calls.append(("tmp", op["op"]))
        return self.tmp_result

    def tmp_unawaited(self, op, argv, run=None):
        self.calls.append(("tmp_unawaited", op["op"], argv))
        return True


MODULE = ("/bin/sh -c '/usr/bin/python3 && sleep 0'", b"_ANSIBALLZ_WRAPPER = True\n")


def deferred_chmod(conn):
    tmpdir = conn._shell.join_path(conn._shell.get_option("remote_tmp"), "ansible-tmp-1.5-77-88")
    paths = [tmpdir + "/", tmpdir + "/source"]
    return conn._shell.chmod(paths, "u+rwx"), paths


def test_a_tmp_chmod_goes_with_the_next_module_request(conn):
    """core's chmod of the files it put answers at once and is done by the runner ahead of the module, in its
    request: one exec less on the api road."""
    mux = WarmMux()
    connected(conn, mux)
    cmd, paths = deferred_chmod(conn)
    assert conn.exec_command(cmd, sudoable=False) == (0, b"", b"")
    assert mux.calls == []
    assert conn.exec_command(MODULE[0], in_data=MODULE[1])[0] == 0
    assert mux.calls == [("warm", "/usr/bin/python3", [{"op": "chmod", "mode": "u+rwx", "paths": paths}])]
    conn.exec_command(MODULE[0], in_data=MODULE[1])
    assert mux.calls[-1] == ("warm", "/usr/bin/python3", [])  # done once


@pytest.mark.parametrize("then", ["put", "fetch", "cold command", "close"])
def test_a_deferred_chmod_runs_before_anything_else(conn, tmp_path, then):
    mux = WarmMux()
    connected(conn, mux)
    conn.exec_command(deferred_chmod(conn)[0], sudoable=False)
    (tmp_path / "f").write_text("x")
    {"put": lambda: conn.put_file(str(tmp_path / "f"), "/workspace/f"),
     "fetch": lambda: conn.fetch_file("/workspace/f", str(tmp_path / "g")),
     "cold command": lambda: conn.exec_command("echo hi"),
     "close": conn.close}[then]()
    if then == "put":  # the mux does it ahead of the put, in its request
        assert len(mux.calls) == 1 and [item["op"]["op"] for item in mux.calls[0][3]] == ["chmod"], mux.calls
        return
    assert mux.calls[0] == ("tmp", "chmod") and len(mux.calls) == (1 if then == "close" else 2), mux.calls


def test_a_refused_module_runs_its_deferred_chmod_first_and_its_failure_fails_the_task(conn):
    """The runner could not do the chmod (so it started nothing): it runs as today, and fails as core would."""
    mux = WarmMux(refuse_warm=True, tmp_result=(1, b"", b"chmod: cannot access 'source'", {"rc": 1}))
    connected(conn, mux)
    conn.exec_command(deferred_chmod(conn)[0], sudoable=False)
    with pytest.raises(AnsibleError, match=r"Failed to set permissions on remote files \(rc: 1, err: chmod: cannot"):
        conn.exec_command(MODULE[0], in_data=MODULE[1])
    assert [c[0] for c in mux.calls] == ["warm", "tmp"]  # the module never ran cold
    assert conn._deferred == []


def test_no_chmod_is_deferred_with_become(conn):
    """With become, core's chmod / setfacl / chown dance runs where and when it does today."""
    mux = WarmMux()
    connected(conn, mux)
    conn.set_become_plugin(become_loader.get("ansible.builtin.sudo"))
    conn.exec_command(deferred_chmod(conn)[0], sudoable=False)
    assert mux.calls[0][0] == "exec" and conn._deferred == []


def mkdtemp_cmd(conn, name="ansible-tmp-1.5-77-88"):
    return conn._shell.mkdtemp(basefile=name, system=False, mode=0o700, tmpdir=conn._shell.get_option("remote_tmp"))


def test_a_mkdtemp_is_answered_at_once_and_made_with_the_next_module(conn):
    """core's mkdtemp is answered as the shell prints it, no round trip; the runner makes the dir in the module's
    request; the rm at the task's end is sent and not waited for."""
    mux = WarmMux()
    connected(conn, mux)
    tmp = conn._shell.join_path(conn._shell.get_option("remote_tmp"), "ansible-tmp-1.5-77-88")
    assert conn.exec_command(mkdtemp_cmd(conn), sudoable=False) == (0, ("ansible-tmp-1.5-77-88=%s\n" % tmp).encode(), b"")
    assert mux.calls == []
    conn.exec_command(MODULE[0], in_data=MODULE[1])
    assert mux.calls[0][0] == "warm" and [op["op"] for op in mux.calls[0][2]] == ["mkdtemp"]
    rm = conn._shell.remove(tmp + "/", recurse=True)
    assert conn.exec_command(rm, sudoable=False) == (0, b"", b"")
    assert mux.calls[1] == ("tmp_unawaited", "rm", ["/bin/sh", "-c", rm])


@pytest.mark.parametrize("then", ["cold command", "close"])
def test_a_deferred_mkdtemp_is_made_before_anything_else(conn, tmp_path, then):
    mux = WarmMux()
    connected(conn, mux)
    conn.exec_command(mkdtemp_cmd(conn), sudoable=False)
    {"cold command": lambda: conn.exec_command("echo hi"), "close": conn.close}[then]()
    assert mux.calls[0] == ("tmp", "mkdtemp"), mux.calls


def test_a_deferred_mkdtemp_goes_with_the_put(conn, tmp_path):
    """The put that comes first (pipelining off, a script) has the mux make the dir before it writes."""
    mux = WarmMux()
    connected(conn, mux)
    cmd = mkdtemp_cmd(conn)
    conn.exec_command(cmd, sudoable=False)
    (tmp_path / "f").write_text("x")
    conn.put_file(str(tmp_path / "f"), "/workspace/f")
    assert len(mux.calls) == 1 and mux.calls[0][:3] == ("put", str(tmp_path / "f"), "/workspace/f"), mux.calls
    assert [item["op"]["op"] for item in mux.calls[0][3]] == ["mkdtemp"]
    assert mux.calls[0][3][0]["argv"] == ["/bin/sh", "-c", cmd] and conn._deferred == []


def test_a_deferred_mkdtemp_that_fails_with_the_put_fails_the_task_in_cores_words(conn, tmp_path):
    mux = WarmMux()
    mux.put_result = {"ahead_failed": {"index": 0, "rc": 1, "stdout": "", "stderr": "mkdir: Not a directory"}}
    connected(conn, mux)
    cmd = mkdtemp_cmd(conn)
    conn.exec_command(cmd, sudoable=False)
    (tmp_path / "f").write_text("x")
    with pytest.raises(AnsibleConnectionFailure, match="Failed to create temporary directory"):
        conn.put_file(str(tmp_path / "f"), "/workspace/f")


def test_a_tmp_dir_never_used_is_neither_made_nor_removed(conn):
    mux = WarmMux()
    connected(conn, mux)
    conn.exec_command(mkdtemp_cmd(conn), sudoable=False)
    tmp = conn._shell.join_path(conn._shell.get_option("remote_tmp"), "ansible-tmp-1.5-77-88")
    assert conn.exec_command(conn._shell.remove(tmp + "/", recurse=True), sudoable=False) == (0, b"", b"")
    conn.close()
    assert mux.calls == [] and conn._deferred == []


@pytest.mark.parametrize("rc,stderr,words", [
    (1, b"mkdir: cannot create directory: Not a directory", "Failed to create temporary directory. In some cases"),
    (1, b"mkdir: No space left on device", "mkdir: No space left on device"),
])
def test_a_deferred_mkdtemp_that_fails_fails_the_task_in_cores_words(conn, rc, stderr, words):
    mux = WarmMux(refuse_warm=True, tmp_result=(rc, b"", stderr, {"rc": rc}))
    connected(conn, mux)
    cmd = mkdtemp_cmd(conn)
    conn.exec_command(cmd, sudoable=False)
    with pytest.raises(AnsibleConnectionFailure) as e:
        conn.exec_command(MODULE[0], in_data=MODULE[1])
    assert words in str(e.value) and (b"No space" in stderr or "Failed command was: %s, exited" % cmd in str(e.value))
    assert [c[0] for c in mux.calls] == ["warm", "tmp"] and conn._deferred == []


def test_no_mkdtemp_or_rm_is_deferred_with_become(conn):
    mux = WarmMux()
    connected(conn, mux)
    conn.set_become_plugin(become_loader.get("ansible.builtin.sudo"))
    conn.exec_command(mkdtemp_cmd(conn), sudoable=False)
    conn.exec_command(conn._shell.remove("/workspace/.scratch/ansible-tmp/ansible-tmp-1.5-77-88/", recurse=True),
                      sudoable=False)
    assert [c[0] for c in mux.calls] == ["exec", "exec"] and conn._deferred == []


def test_an_earlier_tasks_failed_rm_is_a_warning_of_the_next_task(conn, monkeypatch):
    """The mux keeps what an unawaited rm said when it failed; the session's next attach shows it, escaped."""
    mux = FakeMux()
    mux.attached = {"road": "agent", "version": mp.PROTOCOL_VERSION,
                    "tmp_warnings": ["Error deleting remote temporary files (rc: 1, stderr: rm: busy\x1b[2J})"]}
    mux.connect = lambda: mux
    conn.set_option("api_token", "t")
    monkeypatch.setattr("ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.agent_connection.MuxClient", lambda *a, **k: mux)
    shown_warnings = []
    monkeypatch.setattr("ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.agent_connection.display.warning",
                        lambda msg, *a, **k: shown_warnings.append(msg))
    conn._connect()
    assert len(shown_warnings) == 1 and "an earlier task's tmp dir: Error deleting remote temporary files (rc: 1" \
        in shown_warnings[0] and "\x1b" not in shown_warnings[0], shown_warnings
