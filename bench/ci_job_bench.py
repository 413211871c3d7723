# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The CI job's own speed (not a timed test): one pytest suite split in 3 shards, run two ways.

- microvm.sandbox.ci on a fresh local plane: a session from the base template, the project synced in, a venv with
  pytest from wheels pushed with sync, a checkpoint, 3 forks each running a third of the suite (the collection's
  shard plugin), the JUnit files pulled back and merged, everything deleted;
- podman: 3 containers at once from a local image (the plane's own base rootfs, `podman import`ed, plus the same
  venv, built once and kept), the project bind-mounted read-only and copied in, each running the same third.

The suite is more-itertools' (its sdist, fetched once with the controller's pip into .local/bench/sdist, from pip's
configured index), or tests/integration/ci_project when that fails (offline). For each way: wall time, the time
pytest itself took (the slowest shard's JUnit time), the overhead outside pytest (wall - that), and for the CI job
its prepare (session, sync, setup) and fan-out (checkpoint to end) apart; min and median of --repeat runs, and
the ratio of the medians. With --stages, the CI job's per-stage figures (bench/ci_stages.yml and the playbook's
own tasks, timed by bench/callbacks/microvm_ci_timing.py).

Writes bench/results/ci_job.json.
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/ci_job_bench.py [--repeat 3]
       [--shards 3] [--project ci_project|more-itertools] [--skip-podman]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import ROOT

from microvm_plane_testing import localplane_cache, start_local_plane, stop_local_plane, unique_name

LOCAL = os.path.join(ROOT, ".local", "bench")
WHEELS = os.path.join(ROOT, ".local", "wheels")
CALLBACKS = os.path.join(ROOT, "bench", "callbacks")
SHARD_PLUGIN_DIR = os.path.join(ROOT, "playbooks", "files")
CI_PROJECT = os.path.join(ROOT, "tests", "integration", "ci_project")
RESULTS = os.path.join(ROOT, "bench", "results", "ci_job.json")


class Project:
    """A pure-Python project and how its suite runs: pytest arguments, PYTHONPATH relative to its root."""

    def __init__(self, name: str, path: str, pytest_args: str, pythonpath: str) -> None:
        self.name = name
        self.path = path
        self.pytest_args = pytest_args
        self.pythonpath = pythonpath


def more_itertools() -> Project | None:
    """more-itertools' sdist, downloaded once with the controller's pip (its own configured index) and unpacked."""
    sdists = os.path.join(LOCAL, "sdist")
    found = sorted(glob.glob(os.path.join(sdists, "more_itertools-*.tar.gz")))
    if not found:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                               "--dest", sdists, "more-itertools"], capture_output=True, text=True, timeout=300,
                              check=False)
        found = sorted(glob.glob(os.path.join(sdists, "more_itertools-*.tar.gz")))
        if proc.returncode != 0 or not found:
            print("more-itertools' sdist is not available (%s): the bench runs tests/integration/ci_project" %
                  proc.stderr.strip()[-300:])
            return None
    sdist = found[-1]
    name = os.path.basename(sdist)[:-len(".tar.gz")]
    dest = os.path.join(LOCAL, "projects", name)
    if not os.path.isdir(dest):
        tmp = dest + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        os.rename(os.path.join(tmp, name), dest)
        shutil.rmtree(tmp, ignore_errors=True)
    return Project("more-itertools (%s)" % name.split("-")[-1], dest, "-q tests", ".")


def ci_project() -> Project:
    return Project("tests/integration/ci_project", CI_PROJECT, "-q -o python_files=check_*.py tests", "src")


def wheels() -> str:
    if not (os.path.isdir(WHEELS) and any(n.startswith("pytest-") for n in os.listdir(WHEELS))):
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version",
                        "3.11", "--dest", WHEELS, "pytest"], check=True, timeout=300)
    return WHEELS


def junit_times(paths: list[str]) -> list[float]:
    """Each file's pytest time (its suites' time attributes): the bench's own files, parsed with the stdlib."""
    times = []
    for path in paths:
        root = ET.parse(path).getroot()
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        times.append(sum(float(s.get("time") or 0) for s in suites))
    return times


def junit_tests(path: str) -> int:
    return len(list(ET.parse(path).getroot().iter("testcase")))


# -- the CI playbook ------------------------------------------------------------------------------------------------

def ci_run(plane: Any, project: Project, shards: int, work: str) -> dict[str, Any]:
    run = unique_name("cibench")
    results = os.path.join(work, run)
    timing = os.path.join(work, run + ".timing.jsonl")
    args = {
        "ci_name": run, "ci_project": project.path, "ci_shards": shards, "ci_results_dir": results,
        "ci_push": [{"src": wheels(), "dest": "/workspace/wheels"}],
        "ci_setup_command": "python3 -m venv /workspace/venv && /workspace/venv/bin/pip install --quiet --no-index "
                            "--find-links /workspace/wheels pytest",
        "ci_python": "/workspace/venv/bin/python", "ci_pytest_args": project.pytest_args,
        "ci_env": {"PYTHONPATH": os.path.join("/workspace/project", project.pythonpath)},
    }
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=benchlib.COLLECTIONS, ANSIBLE_NOCOLOR="1",
               ANSIBLE_CALLBACK_PLUGINS=CALLBACKS, ANSIBLE_CALLBACKS_ENABLED="microvm_ci_timing",
               MICROVM_CI_TIMING=timing, ANSIBLE_LOCALHOST_WARNING="False", **plane.env)
    argv = [os.path.join(benchlib.BIN, "ansible-playbook"), "microvm.sandbox.ci", "-e", json.dumps(args)]
    proc, wall = benchlib.timed_run(argv, env, work)
    if proc.returncode != 0:
        raise RuntimeError("the CI playbook failed:\n%s\n%s" % (proc.stdout[-4000:], proc.stderr[-2000:]))
    rows = [json.loads(line) for line in open(timing)]
    files = sorted(glob.glob(os.path.join(results, "shards", "*", "junit.xml")))
    pytest_s = junit_times(files)
    t0 = min(r["start"] for r in rows)

    def span(task: str) -> list[float]:
        return [r["end"] - r["start"] for r in rows if r["task"] == task]

    prepared = max(r["end"] for r in rows if r["task"] == "Mark the session prepared") - t0
    stages = {
        "session start": span("Start the session"),
        "checkpoint (with ci_checkpoint_label only)": span("Checkpoint (retaken on every run, so the shards test this run's sources)"),
        "fork call (its checkpoint, 3 forks booted)": span("Fork the shards"),
        "shard command minus its pytest time (connect, pytest start-up, artifacts)": [
            c - p for c, p in zip(sorted(span("Run the shard's command")), sorted(pytest_s))],
        "pull of the results": span("Pull the shard's results back"),
        "delete a shard": span("Delete the shard"),
        "delete the source (beside the shards)": span("Delete the session, since the shards have their copies"),
        "merge": span("Merge the shards' JUnit files"),
    }
    end = max(r["end"] for r in rows)
    return dict(wall=wall, pytest=max(pytest_s), overhead=wall - max(pytest_s), prepare=prepared,
                fanout=end - t0 - prepared, fanout_overhead=end - t0 - prepared - max(pytest_s),
                tests=junit_tests(os.path.join(results, "junit.xml")), stages=stages)


def ci_stages(plane: Any, shards: int, work: str) -> dict[str, float]:
    """bench/ci_stages.yml: each fan-out stage as a task of its own."""
    name = unique_name("stages")
    timing = os.path.join(work, name + ".timing.jsonl")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=benchlib.COLLECTIONS, ANSIBLE_NOCOLOR="1",
               ANSIBLE_CALLBACK_PLUGINS=CALLBACKS, ANSIBLE_CALLBACKS_ENABLED="microvm_ci_timing",
               ANSIBLE_PYTHON_INTERPRETER=sys.executable, MICROVM_CI_TIMING=timing, **plane.env)
    argv = [os.path.join(benchlib.BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local",
            os.path.join(ROOT, "bench", "ci_stages.yml"), "-e", "run=%s out=%s shards=%d" % (
                name, os.path.join(work, name + "-out"), shards)]
    proc, _wall = benchlib.timed_run(argv, env, work)
    if proc.returncode != 0:
        raise RuntimeError("bench/ci_stages.yml failed:\n%s" % proc.stdout[-3000:])
    out: dict[str, list[float]] = {}
    for line in open(timing):
        r = json.loads(line)
        if r["task"].startswith("Stage "):
            out.setdefault(r["task"][len("Stage "):], []).append(r["end"] - r["start"])
    return {k: max(v) for k, v in out.items()}  # the slowest host: what the next task waits for


# -- podman ---------------------------------------------------------------------------------------------------------

def podman_env(work: str) -> dict[str, str]:
    """podman's settings on this kind of machine, as hack/ee-test.sh: runc (crun refuses hybrid cgroup v1 hosts),
    cgroupfs without systemd, rlimits no higher than ours."""
    import resource
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = 32768 if nproc == resource.RLIM_INFINITY or nproc > 32768 else nproc
    conf = os.path.join(work, "containers.conf")
    with open(conf, "w") as f:
        f.write('[containers]\ndefault_ulimits = ["nofile=%d:%d", "nproc=%d:%d"]\n[engine]\nruntime = "runc"\n'
                'cgroup_manager = "cgroupfs"\nevents_logger = "file"\n' % (nofile, nofile, nproc, nproc))
    return dict(os.environ, CONTAINERS_CONF=conf)


def podman(env: dict[str, str], *args: str, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          check=kw.pop("check", True), **kw)


def podman_image(env: dict[str, str], work: str) -> str:
    """The base rootfs of the local plane imported, plus a venv with pytest from the same wheels; built once."""
    label = subprocess.run(["bash", os.path.join(ROOT, "hack", "checkout-label.sh")], capture_output=True, text=True,
                           check=True).stdout.strip()
    bases = sorted(glob.glob(os.path.join(localplane_cache(), "base-*", "rootfs")), key=os.path.getmtime)
    base_dir = bases[-1] if bases else ""
    if not os.path.isdir(base_dir):
        raise RuntimeError("no base rootfs in %s: run the local plane once (make local-up)" % localplane_cache())
    key = hashlib.sha256((base_dir + "".join(sorted(os.listdir(wheels())))).encode()).hexdigest()[:12]
    image = "localhost/microvm-ci-bench:%s" % key
    if podman(env, "image", "exists", image, check=False).returncode == 0:
        return image
    base = "localhost/microvm-ci-bench-base:%s" % key
    if podman(env, "image", "exists", base, check=False).returncode != 0:
        tar = os.path.join(work, "base.tar")
        subprocess.run(["tar", "-C", base_dir, "-cf", tar, "."], check=True)
        podman(env, "import", "--quiet", "--change", "LABEL " + label, tar, base)
        os.unlink(tar)
    name = "microvm-ci-bench-build-%s" % key
    podman(env, "rm", "-f", name, check=False)
    podman(env, "run", "--name", name, "--network", "none", "-v", "%s:/wheels:ro" % wheels(), base, "sh", "-c",
           "python3 -m venv /opt/venv && /opt/venv/bin/pip install --quiet --no-index --find-links /wheels pytest")
    podman(env, "commit", "--quiet", name, image)
    podman(env, "rm", "-f", name)
    return image


def podman_run(env: dict[str, str], image: str, project: Project, shards: int, work: str) -> dict[str, Any]:
    out = os.path.join(work, unique_name("podman"))

    def shard(index: int) -> None:
        d = os.path.join(out, str(index))
        os.makedirs(d)
        podman(env, "run", "--rm", "--network", "none", "-v", "%s:/src:ro" % project.path,
               "-v", "%s:/ci:ro" % SHARD_PLUGIN_DIR, "-v", "%s:/out" % d, "-e", "SHARD_INDEX=%d" % index,
               "-e", "SHARD_COUNT=%d" % shards, "-e", "PYTHONPATH=/ci:%s" % os.path.join("/work", project.pythonpath),
               image, "sh", "-c", "cp -a /src /work && cd /work && /opt/venv/bin/python -m pytest -p microvm_ci_shard "
               "-p no:cacheprovider --junitxml=/out/junit.xml %s" % project.pytest_args)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(shards) as pool:
        list(pool.map(shard, range(shards)))
    wall = time.perf_counter() - start
    files = [os.path.join(out, str(i), "junit.xml") for i in range(shards)]
    pytest_s = junit_times(files)
    return dict(wall=wall, pytest=max(pytest_s), overhead=wall - max(pytest_s),
                tests=sum(junit_tests(f) for f in files))


# -- report ---------------------------------------------------------------------------------------------------------

def summary(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    return {k: {"min": round(min(r[k] for r in runs), 2), "median": round(statistics.median(r[k] for r in runs), 2)}
            for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--project", choices=["more-itertools", "ci_project"], default="more-itertools")
    ap.add_argument("--skip-podman", action="store_true")
    ap.add_argument("--stages", action="store_true", help="also time each fan-out stage (bench/ci_stages.yml)")
    opts = ap.parse_args()
    project = (more_itertools() if opts.project == "more-itertools" else None) or ci_project()
    os.makedirs(LOCAL, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ci-job-", dir=LOCAL)
    report: dict[str, Any] = {"project": project.name, "shards": opts.shards, "repeat": opts.repeat,
                              "cpus": os.cpu_count(), "load_before": os.getloadavg()[0]}
    try:
        os.makedirs(os.path.join(work, "plane"))
        plane = start_local_plane(os.path.join(work, "plane"))
        try:
            ci_run(plane, project, opts.shards, work)  # warm-up: the base template's caches, the plane's first boot
            ci_runs = [ci_run(plane, project, opts.shards, work) for _run in range(opts.repeat)]
            if opts.stages:
                report["stages"] = [ci_stages(plane, opts.shards, work) for _run in range(opts.repeat)]
        finally:
            stop_local_plane(plane)
        report["ci"] = summary(ci_runs, ("wall", "pytest", "overhead", "prepare", "fanout", "fanout_overhead"))
        report["ci"]["tests"] = ci_runs[0]["tests"]
        report["ci_stages_in_job"] = {k: round(statistics.median(max(r["stages"][k]) if r["stages"][k] else 0
                                                                 for r in ci_runs), 2)
                                      for k in ci_runs[0]["stages"]}
        if not opts.skip_podman and shutil.which("podman"):
            env = podman_env(work)
            image = podman_image(env, work)
            podman_run(env, image, project, opts.shards, work)  # warm-up
            pod_runs = [podman_run(env, image, project, opts.shards, work) for _run in range(opts.repeat)]
            report["podman"] = summary(pod_runs, ("wall", "pytest", "overhead"))
            report["podman"]["tests"] = pod_runs[0]["tests"]
            report["ratio_wall_median"] = round(report["ci"]["wall"]["median"] / report["podman"]["wall"]["median"], 2)
            report["ratio_overhead_median"] = round(
                report["ci"]["overhead"]["median"] / max(report["podman"]["overhead"]["median"], 0.01), 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["load_after"] = os.getloadavg()[0]
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(report, f, indent=2)
    print("project: %s, %d shards, %d runs each (min / median, seconds); load %.1f -> %.1f on %d cpus" % (
        project.name, opts.shards, opts.repeat, report["load_before"], report["load_after"], report["cpus"]))
    rows = [("microvm.sandbox.ci", report["ci"])] + ([("podman x%d" % opts.shards, report["podman"])]
                                                     if "podman" in report else [])
    print("%-20s %15s %15s %15s %15s %15s" % ("", "wall", "pytest", "overhead", "prepare", "fan-out overhead"))
    for name, r in rows:
        cells = ["%6.1f / %6.1f" % (r[k]["min"], r[k]["median"]) if k in r else "%15s" % "-"
                 for k in ("wall", "pytest", "overhead", "prepare", "fanout_overhead")]
        print("%-20s %s   (%d tests)" % (name, " ".join("%15s" % c for c in cells), r["tests"]))
    if "podman" in report:
        print("ratio of the medians, CI job / podman: wall %.2f, overhead %.2f" % (
            report["ratio_wall_median"], report["ratio_overhead_median"]))
    print("CI job's stages (median of the slowest host): " + ", ".join(
        "%s %.2f" % kv for kv in report["ci_stages_in_job"].items()))
    for n, st in enumerate(report.get("stages", [])):
        print("stage probe %d: %s" % (n + 1, ", ".join("%s %.2f" % kv for kv in st.items())))
    print("results: %s" % os.path.relpath(RESULTS, ROOT))


if __name__ == "__main__":
    main()
