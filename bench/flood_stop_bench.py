"""How promptly a flood past max_output_bytes is stopped (not a timed test): per session, the seconds from the moment
the guest's output passed the limit to (a) the task failing, (b) the command gone from the guest, (c) the session's
next tasks done.

Each session runs, with the free strategy (so a host's next task does not wait for the others): a flood (`raw`, or
`shell` run by the warm runner) that prints FLOOD bytes (0: without end, `raw` only), ignoring its failure, then
`raw: echo fine` and `command: echo fine`. When the output passed the limit: for `raw`, the command's start (it
streams: the limit is passed within milliseconds), read from the guest's clock (`date` into a file the playbook
fetches: the guests are runc containers on this host's clock); for `shell`, the command's end (the module prints
its result then). The command's processes are the host's too: a watcher reads /proc every 20 ms for the flood's
process group (marked by a word in its command line) and notes when it was last seen. Task times come from
bench/callbacks/microvm_ci_timing.py.

Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/flood_stop_bench.py
       [--road agent|api] [--module raw|shell] [--sessions 1] [--flood 400000000] [--source yes|zero]
       [--limit 1048576] [--output bench/results/flood-stop.json]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile
import threading
import time
import uuid

from benchlib import BIN, COLLECTIONS, ROOT  # first: it puts the collection and localplane on sys.path

from microvm_plane_testing import start_local_plane, stop_local_plane, stop_muxes, team_defaults

PLAYBOOK = """
- hosts: sbx
  gather_facts: false
  strategy: free
  tasks:
    - name: flood
      {module}: "{command}"
      ignore_errors: true
      register: flooded
    - name: next raw
      ansible.builtin.raw: echo fine
    - name: next command
      ansible.builtin.command: echo fine
    - name: the guest's clock at the flood's start and after its command
      ansible.builtin.fetch:
        src: "/workspace/flood-{{{{ item }}}}"
        dest: "{out}/{{{{ inventory_hostname }}}}-{{{{ item }}}}"
        flat: true
        fail_on_missing: false
      loop: [t0, t1]
"""
NAN = float("nan")


def flood_command(marker, size, source="yes"):
    """A command whose shell carries `marker` in its command line (the watcher finds its process group by it).

    `source`: yes (lines, as fast as `yes` writes) or zero (one line of x, as fast as the pipe takes it)."""
    if source == "yes":
        flood = "yes %s" % marker if not size else "yes %s | head -c %d" % (marker, size)
    else:
        flood = "tr '\\\\0' x </dev/zero" if not size else "head -c %d /dev/zero | tr '\\\\0' x" % size
        flood = ": %s; %s" % (marker, flood)
    return ("rm -f /workspace/flood-t1; date +%%s.%%N >/workspace/flood-t0; %s; sleep 2; touch /workspace/flood-after; "
            "date +%%s.%%N >/workspace/flood-t1" % flood)


class Watcher(threading.Thread):
    """When a process of each marked process group was last seen on this host (20 ms polls)."""

    def __init__(self, markers):
        super().__init__(daemon=True)
        self.markers = {m.encode(): m for m in markers}
        self.groups = {}   # pgid -> marker
        self.plain = {}    # pid -> when first seen unmarked (a forked child may exec a marked command soon after)
        self.last = {}
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(0.02):
            now = time.time()
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open("/proc/%s/stat" % entry, "rb") as f:
                        pgid = int(f.read().rsplit(b")", 1)[1].split()[2])
                    marker = self.groups.get(pgid)
                    if marker is None and now - self.plain.setdefault(entry, now) < 1.0:
                        with open("/proc/%s/cmdline" % entry, "rb") as f:
                            cmdline = f.read()
                        marker = next((m for b, m in self.markers.items() if b in cmdline), None)
                        if marker is not None:
                            self.groups[pgid] = marker
                except (OSError, ValueError, IndexError):
                    continue
                if marker is not None:
                    self.last[marker] = now


def guest_clock(path):
    try:
        with open(path) as f:
            return float(f.read().strip())
    except (OSError, ValueError):
        return NAN


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--road", choices=("agent", "api"), default="agent")
    parser.add_argument("--module", choices=("raw", "shell"), default="raw")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--flood", type=int, default=400000000, help="bytes printed, 0 for no end (raw only)")
    parser.add_argument("--source", choices=("yes", "zero"), default="yes")
    parser.add_argument("--limit", type=int, default=1048576, help="max_output_bytes")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.module == "shell" and not args.flood:
        parser.error("a module buffers its command's output: give it a flood that ends")
    tmp = tempfile.mkdtemp(prefix="floodbench-")
    os.environ["MICROVM_TEST_TRANSPORT"] = args.road  # team_defaults() reads it
    plane = start_local_plane(tmp)
    mux_dir = os.path.join(tmp, "mux")
    try:
        from microvm_localplane import dataplane
        dataplane.write_settings(tmp, **team_defaults())
        api = plane.client()
        names = []
        for i in range(args.sessions):
            made = api.create_session({"name": "flood-%d-%s" % (i, uuid.uuid4().hex[:6]), "agent": "custom"})
            names.append(api.wait_session(made["session_id"], timeout=180)["name"])
        markers = {name: "FLOOD%s" % uuid.uuid4().hex[:10] for name in names}
        inventory = ["[sbx]"] + ["%s ansible_host=%s flood_marker=%s" % (n, n, markers[n]) for n in names] + [
            "[sbx:vars]", "ansible_connection=microvm.sandbox.agent", "ansible_python_interpreter=/usr/bin/python3",
            "ansible_microvm_max_output_bytes=%d" % args.limit]
        module = "ansible.builtin.raw" if args.module == "raw" else "ansible.builtin.shell"
        out = os.path.join(tmp, "clocks")
        os.makedirs(out)
        playbook = PLAYBOOK.format(module=module, out=out,
                                   command=flood_command("{{ flood_marker }}", args.flood, args.source))
        with open(os.path.join(tmp, "inventory.ini"), "w") as f:
            f.write("\n".join(inventory) + "\n")
        with open(os.path.join(tmp, "playbook.yml"), "w") as f:
            f.write(playbook)
        timing = os.path.join(tmp, "timing.jsonl")
        env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=COLLECTIONS, ANSIBLE_NOCOLOR="1",
                   ANSIBLE_CALLBACK_PLUGINS=os.path.join(ROOT, "bench", "callbacks"),
                   ANSIBLE_CALLBACKS_ENABLED="microvm_ci_timing", MICROVM_CI_TIMING=timing, MICROVM_MUX_DIR=mux_dir,
                   MICROVM_TRANSPORT=args.road, MICROVM_PERSIST="60", ANSIBLE_FORKS=str(max(5, args.sessions)),
                   **plane.env)
        watcher = Watcher(markers.values())
        watcher.start()
        began = time.time()
        proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", "inventory.ini", "playbook.yml"], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
        watcher.done.set()
        watcher.join()
        rows = {}
        with open(timing) as f:
            for line in f:
                row = json.loads(line)
                rows.setdefault(row["host"], {})[row["task"]] = row
        per_host = []
        for name in names:
            started, printed = guest_clock(os.path.join(out, name + "-t0")), guest_clock(os.path.join(out, name + "-t1"))
            # when the output passed the limit: a command streams it (at once), a module prints it after the command
            t0 = started if args.module == "raw" else printed
            tasks = rows.get(name, {})
            per_host.append({
                "host": name,
                "flood_status": tasks.get("flood", {}).get("status"),
                "command_ran": None if math.isnan(printed) else round(printed - started, 2),
                "failed_after": round(tasks.get("flood", {}).get("end", NAN) - t0, 2),
                # the last sighting (20 ms polls of a loaded host): a command killed at once may never be seen
                "last_seen_after": round(watcher.last.get(markers[name], NAN) - t0, 2),
                "next_raw_done_after": round(tasks.get("next raw", {}).get("end", NAN) - t0, 2),
                "next_command_done_after": round(tasks.get("next command", {}).get("end", NAN) - t0, 2),
            })
        report = {"road": args.road, "module": args.module, "sessions": args.sessions, "flood": args.flood,
                  "source": args.source, "limit": args.limit, "rc": proc.returncode, "wall": round(time.time() - began, 2)}
        for key in ("failed_after", "last_seen_after", "next_raw_done_after", "next_command_done_after"):
            values = [h[key] for h in per_host if not math.isnan(h[key])]
            report["max_" + key] = max(values) if values else None
            report["median_" + key] = statistics.median(values) if values else None
        report["hosts"] = per_host
        if proc.returncode != 0 or "max_output_bytes" not in proc.stdout:
            report["output_tail"] = proc.stdout[-3000:] + proc.stderr[-2000:]
        text = json.dumps(report, indent=1)
        print(text)
        if args.output:
            with open(args.output, "w") as f:
                f.write(text + "\n")
    finally:
        stop_muxes(mux_dir)
        stop_local_plane(plane)


if __name__ == "__main__":
    main()
