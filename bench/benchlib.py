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
import threading
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
COPY_TASK = "    - ansible.builtin.copy: {{content: \"file {n}{stamp}\\n\", dest: \"{{{{ dest_dir }}}}/f{n}.txt\"}}\n"
STAMP = " {{ now().isoformat() }}"  # a content new at each run: the copy puts its file (mkdtemp, stat, put, chmod, copy, rm)


def playbook_text(mixed=True, count=30, changed=False):
    """`count` tasks for host `target`: all `command`, or (mixed) 2 commands then 1 copy to {{ dest_dir }}, repeated.

    The copies are unchanged after the first run (stat, then the file module: nothing put), or with `changed`
    changed at every run (the file put, chmod, the copy module)."""
    tasks = []
    for n in range(count):
        tasks.append(COPY_TASK.format(n=n, stamp=STAMP if changed else "") if mixed and n % 3 == 2
                     else COMMAND_TASK.format(n=n))
    return PLAYBOOK.format(tasks="".join(tasks))


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


def ansible_env(plane, mux_dir, persist, **extra):
    """The environment ansible-playbook runs in: the repo's collection, the plane's URL and token, a private mux dir."""
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=COLLECTIONS, ANSIBLE_NOCOLOR="1", ANSIBLE_HOST_KEY_CHECKING="0",
               ANSIBLE_RETRY_FILES_ENABLED="0", MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST=str(persist), **plane.env)
    # the bench's own payload cache: its warm-up run fills it, as a user's earlier runs would
    env["MICROVM_PAYLOAD_CACHE"] = os.path.join(os.path.dirname(os.path.abspath(mux_dir)), "payloads")
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


# -- memory ----------------------------------------------------------------------------------------
def memory_kib(pid):
    """(PSS, RSS) of one process in KiB; zeros when it is gone."""
    pss = rss = 0
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


# -- CPU -------------------------------------------------------------------------------------------
HZ = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids):
    """CPU seconds used by `pids` and their reaped children (utime + stime + cutime + cstime)."""
    total_cpu = 0
    for pid in pids:
        try:
            with open("/proc/%d/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total_cpu += sum(int(x) for x in fields[11:15])
        except (OSError, ValueError, IndexError):
            pass
    return total_cpu / HZ


def children_cpu():
    """CPU seconds of this process's reaped children (and what they reaped): a finished ansible-playbook run."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def processes():
    """{pid: (ppid, comm, cmdline)} of every process we can read."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                stat = f.read()
            with open("/proc/%s/cmdline" % d, "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        out[int(d)] = (int(stat.rsplit(")", 1)[1].split()[1]), comm, cmdline)
    return out


def tree(procs, root):
    """root and all its descendants in `procs` (see processes())."""
    children = {}
    for pid, (ppid, _comm, _cmd) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def total(pids):
    """Summed PSS and RSS of `pids` (PSS counts shared pages once: the fair sum), the largest RSS, the count."""
    pss = rss = largest = 0
    for pid in pids:
        p, r = memory_kib(pid)
        pss += p
        rss += r
        largest = max(largest, r)
    return {"pss_kib": pss, "rss_kib": rss, "largest_rss_kib": largest, "processes": len(pids)}


def playbook_tree(procs, playbook):
    """Every process of the ansible-playbook runs of `playbook` (the playbook process and its workers)."""
    def is_run(pid):
        return "ansible-playbook" in procs.get(pid, (0, "", ""))[2] and playbook in procs[pid][2]

    roots = [pid for pid, (ppid, _comm, _cmd) in procs.items() if is_run(pid) and not is_run(ppid)]
    return [p for root in roots for p in tree(procs, root)]


def kib_per_additional_session(one, many, sessions):
    """What each session beyond the first adds to a pool of muxes: `one` is total() with one session open,
    `many` with all `sessions`; each process of the pool costs what the one serving one session costs."""
    procs = many["processes"]
    return round((many["pss_kib"] - procs * one["pss_kib"]) / max(1, sessions - procs), 1)


class PeakSampler:
    """Samples total() of some groups of processes every half second while a run goes; keeps each group's peak
    (by PSS). `groups(procs)` -> {name: [pids]}, given processes()."""

    def __init__(self, groups, interval=0.5):
        self.groups = groups
        self.interval = interval
        self.peak = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def sample(self):
        now = {name: total(pids) for name, pids in self.groups(processes()).items()}
        for name, value in now.items():
            if value["pss_kib"] >= self.peak.get(name, {}).get("pss_kib", -1):
                self.peak[name] = value
        return now

    def run(self):
        while not self.stop_event.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.sample()  # every group has a figure, however short the run
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join()


def mib(kib):
    return "%.1f MiB" % (kib / 1024.0)


# -- output ----------------------------------------------------------------------------------------
def print_markdown(rows):
    """The rows as a two-column Markdown table, to paste into the docs as printed."""
    print("| | |\n|---|---|")
    for name, value in rows:
        print("| %s | %s |" % (name, value))


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
