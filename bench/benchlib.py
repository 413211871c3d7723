"""What the benches share: paths, the playbooks they time, the ansible-playbook environment and runs, output.

Importing it puts .local/collections and localplane on sys.path, so a bench can then import
microvm_localplane and the collection's plugin_utils.
"""
import compileall
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIONS = os.path.join(ROOT, ".local", "collections")
BIN = os.path.dirname(sys.executable)

for _p in (COLLECTIONS, os.path.join(ROOT, "localplane")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# Bytecode for the collection's plugins, as an installed collection has it after its first use: this machine
# sets PYTHONDONTWRITEBYTECODE, so without this every task's worker would compile the plugin from source,
# a cost the peers (ansible-core, Mitogen: installed with their bytecode) never pay.
compileall.compile_dir(os.path.join(ROOT, "plugins"), quiet=1)


PLAYBOOK = """
- hosts: target
  gather_facts: false
  tasks:
{tasks}
"""
COMMAND_TASK = "    - ansible.builtin.command: echo {n}\n"
COPY_TASK = "    - ansible.builtin.copy: {{content: \"file {n}\\n\", dest: \"{{{{ dest_dir }}}}/f{n}.txt\"}}\n"


def playbook_text(mixed=True, count=30):
    """`count` tasks for host `target`: all `command`, or (mixed) 2 commands then 1 copy to {{ dest_dir }}, repeated."""
    tasks = []
    for n in range(count):
        tasks.append(COPY_TASK.format(n=n) if mixed and n % 3 == 2 else COMMAND_TASK.format(n=n))
    return PLAYBOOK.format(tasks="".join(tasks))


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


def ansible_env(plane, mux_dir, persist, **extra):
    """The environment ansible-playbook runs in: the repo's collection, the plane's URL and token, a private mux dir."""
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=COLLECTIONS, ANSIBLE_NOCOLOR="1", ANSIBLE_HOST_KEY_CHECKING="0",
               ANSIBLE_RETRY_FILES_ENABLED="0", MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST=str(persist), **plane.env)
    env.update(extra)
    return env


def playbook_argv(inventory, playbook, *options, bin_dir=BIN):
    return [os.path.join(bin_dir, "ansible-playbook"), "-i", inventory, *options, playbook]


def timed_run(argv, env, cwd):
    """Run argv to completion -> (CompletedProcess with text output, seconds)."""
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    return proc, time.perf_counter() - start


def run_playbook(workdir, playbook, inventory, env, bin_dir=BIN):
    """Seconds one ansible-playbook run took; RuntimeError with its output if any task failed."""
    proc, elapsed = timed_run(playbook_argv(inventory, playbook, bin_dir=bin_dir), env, workdir)
    if proc.returncode != 0 or "failed=0" not in proc.stdout:
        raise RuntimeError("playbook failed (%s):\n%s\n%s" % (inventory, proc.stdout[-3000:], proc.stderr[-2000:]))
    return elapsed


def print_rows(rows, indent=""):
    """A two-column table: names padded to the longest, then values."""
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print("%s%-*s  %s" % (indent, width, name, value))


def save_json(path, data, sort_keys=False):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=sort_keys)
    return path


def posix_collection():
    """A collections path holding ansible.posix (the `synchronize` peer), taken from the pinned `ansible` wheel.

    The wheel comes from the machine's package index (pip download, no install: the bench's ansible-core stays
    the one the collection is tested with); only its ansible_collections/ansible/posix is unpacked.
    """
    with open(os.path.join(ROOT, "bench", "requirements-synchronize.txt")) as f:
        pin = [line.strip() for line in f if line.strip() and not line.startswith("#")][0]
    base = os.path.join(ROOT, ".local", "bench", "posix-" + pin.replace("=", ""))
    if not os.path.isdir(os.path.join(base, "ansible_collections", "ansible", "posix")):
        wheels = os.path.join(ROOT, ".local", "bench", "wheels")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", wheels, pin], check=True)
        wheel = [w for w in os.listdir(wheels) if w.startswith(pin.split("==")[0] + "-") and w.endswith(".whl")
                 and pin.split("==")[-1] in w][0]
        tmp = base + ".part"
        shutil.rmtree(tmp, ignore_errors=True)
        with zipfile.ZipFile(os.path.join(wheels, wheel)) as z:
            z.extractall(tmp, [n for n in z.namelist() if n.startswith("ansible_collections/ansible/posix/")])
        os.rename(tmp, base)
    return base
