"""microvm.sandbox.role_digest's parts: every file of a role counts (content, name, executable bit), caches do
not, and its variables and dependencies are found where Ansible keeps them."""
import os

from ansible_collections.microvm.sandbox.plugins.lookup import role_digest as rd


def make_role(root, tasks="- ansible.builtin.debug: {msg: hi}\n"):
    for d in ("tasks", "defaults", "meta", "files", "__pycache__"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "tasks" / "main.yml").write_text(tasks)
    (root / "defaults" / "main.yml").write_text("r_one: 1\nr_two: two\n")
    (root / "meta" / "argument_specs.yml").write_text(
        "argument_specs:\n  main:\n    options:\n      r_three: {type: str}\n")
    (root / "meta" / "main.yml").write_text("dependencies:\n  - role: other\n  - ns.coll.third\n  - name: fourth\n")
    (root / "files" / "run.sh").write_text("echo hi\n")
    (root / "__pycache__" / "x.pyc").write_bytes(b"cache")
    return root


def test_every_file_counts_and_caches_do_not(tmp_path):
    role = make_role(tmp_path / "r")
    first = rd.files_digest(str(role))
    (role / "__pycache__" / "x.pyc").write_bytes(b"other cache")
    assert rd.files_digest(str(role)) == first
    os.chmod(role / "files" / "run.sh", 0o755)
    second = rd.files_digest(str(role))
    assert second != first
    (role / "files" / "new.txt").write_text("")
    third = rd.files_digest(str(role))
    assert third != second
    (role / "files" / "new.txt").rename(role / "files" / "renamed.txt")
    assert rd.files_digest(str(role)) != third


def test_variables_and_dependencies_are_found(tmp_path):
    role = make_role(tmp_path / "r")
    assert rd.variable_names(str(role)) == ["r_one", "r_three", "r_two"]
    assert rd.dependencies(str(role)) == ["other", "ns.coll.third", "fourth"]
