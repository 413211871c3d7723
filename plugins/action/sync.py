# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin of microvm.sandbox.sync: a directory tree into or out of a sandbox, rsync-style.

A run is a few steps of the guest side of _guest/sync_tree.py (the guest's python3), each a command of its own
whose stdin is whole before it runs (one-shot), plus at most one archive. No step needs stdin while it runs, so
the same steps run on both roads: on `transport: api` they are the documented buffered exec (as jobs: big output
downloaded, big stdin staged) and the documented file API, without the team's interactive stdin.

push: manifest step: the guest streams the destination's manifest -> the controller walks the source beside
      it and writes the changes into one tar and the deletions and fixes into an operations file (both on
      local disk, never in memory); nothing changed: done, one command -> the tar is checked like
      workspace_archive's; stage step: the guest makes a stage dir (0700) in the run's scratch, into which the
      agent extracts the tar (Upload with is_archive) -> apply step, the operations as its stdin: the guest
      renames each staged entry into place, then deletes and fixes modes and mtimes, and removes the stage.
pull: manifest step: the guest streams the source's manifest, judged again here (sync_tree.source_entries: the
      guest is hostile) -> the controller walks its destination beside it; pack step, the wanted paths as its
      stdin: the guest writes a tar of exactly those into its scratch -> Download of the path this run chose,
      then a drop step removes it -> the tar is checked member by member (only the paths asked for), extracted
      into a local stage dir, its links resolved against dest as it is on disk (judge_links), and renamed into
      place from dest's fd, no link followed.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import os
import posixpath
import stat
import tempfile
import time
import uuid
from typing import Any

from ansible.errors import AnsibleError
from ansible.plugins.action import ActionBase

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.module_utils.archive_check import ArchiveRefused, check_archive, link_problem
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.untrusted import shown
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import source_of
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import sync_tree as st
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import outcomes
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.command_stream import ExecStream
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.sandbox_connection import SandboxConnection, sandbox_connection
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.sync_plan import ManifestReader, Planner
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import preload

# the strategy loads this class in ansible-playbook itself before it forks the worker: the agent connection too,
# so every worker forked after (the tasks in the session) inherits it loaded (_worker/preload.py)
preload.load_connection()

ARGUMENT_SPEC = dict(
    src=dict(type="str", required=True),
    dest=dict(type="str", required=True),
    mode=dict(type="str", default="push", choices=["push", "pull"]),
    delete=dict(type="bool", default=False),
    checksum=dict(type="bool", default=False),
    exclude=dict(type="list", elements="str", default=[]),
    exclude_from=dict(type="list", elements="path", default=[]),
    list_limit=dict(type="int", default=1000),
    preserve_setid=dict(type="bool", default=False),
)
COPY_CHUNK = 1024 * 1024
ANSWER_LIMIT = 64 * 1024  # what a step after the manifest may print: one JSON line
# The stage and drop steps are plain sh (a python3 start costs more than the rest of such a step). The name is this
# run's own (sync-<random>) in the run's TMPDIR; mkdir fails on any entry already there, a link included, so a
# planted stage is refused; rm -rf removes the entry itself and never what a link in it leads to.
STAGE_SH = 'mkdir -m 700 -- "$TMPDIR/$1"'
DROP_SH = 'rm -rf -- "$TMPDIR/$1"'


class SyncFailed(Exception):
    """A failure reported as the task's msg."""


def guest_program() -> str:
    """The guest side: _guest/sync_tree.py's own source, run with `python3 -c`."""
    return source_of(st)


def protected(root: str, scratch_dir: str) -> list[str]:
    """An anchored exclude for the scratch dir when it lies inside the guest tree: never synced, never deleted."""
    if profile.is_within(scratch_dir, root) and posixpath.normpath(scratch_dir) != posixpath.normpath(root):
        return ["/%s/" % posixpath.relpath(scratch_dir, root)]
    return []


def _dest_fd(root_fd: int | None, dest: str) -> int:
    """The pull's destination dir fd, which only a check-mode run may lack (it creates nothing)."""
    if root_fd is None:
        raise SyncFailed("the destination %s does not exist on the controller" % dest)
    return root_fd


class TarWriter:
    """The push archive: entries of the local tree added one by one, read through O_NOFOLLOW fds."""

    def __init__(self, path: str, root_fd: int) -> None:
        import tarfile
        self.tarfile = tarfile
        self.tar = tarfile.open(path, "w", format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")
        self.root_fd = root_fd
        self.members = 0
        # (parent parts, fd): consecutive entries mostly share a directory
        self._parent: tuple[list[bytes] | None, int | None] = (None, None)

    def _dir_fd(self, parents: list[bytes]) -> int:
        cached, fd = self._parent
        if fd is not None and cached == parents:
            return fd
        if fd is not None:
            os.close(fd)
            self._parent = (None, None)
        fd = st.open_dir_at(self.root_fd, parents)
        self._parent = (parents, fd)
        return fd

    def add(self, entry: st.Entry, ancestor_only: bool = False) -> None:
        tarfile = self.tarfile
        info = tarfile.TarInfo(st.rel_text(entry.path))
        info.mode, info.mtime = entry.mode, entry.mtime
        if entry.kind == st.KIND_DIR:
            info.type = tarfile.DIRTYPE
            self.tar.addfile(info)
        elif entry.kind == st.KIND_LINK:
            info.type, info.linkname = tarfile.SYMTYPE, st.rel_text(entry.extra)
            self.tar.addfile(info)
        else:
            parents, name = st.split_rel(entry.path)
            fd = os.open(name, st.READ_FLAGS, dir_fd=self._dir_fd(parents))
            with os.fdopen(fd, "rb") as f:
                info.size = os.fstat(fd).st_size  # what is read now, even if it changed since the walk
                self.tar.addfile(info, f)
        # tarfile keeps every header it wrote: memory would grow with the tree (typeshed leaves `members` out)
        self.tar.members = []  # type: ignore[attr-defined]
        self.members += 1

    def close(self) -> None:
        if self._parent[1] is not None:
            os.close(self._parent[1])
        self.tar.close()


class ActionModule(ActionBase):

    TRANSFERS_FILES = False
    _supports_check_mode = True
    _requires_connection = True
    _sandbox: SandboxConnection  # self._connection, once run() checked it is microvm.sandbox.agent
    _guest_run_dir = ""  # the run's TMPDIR in the guest, where the stage lives (each step tells it again)
    _started = 0.0

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super(ActionModule, self).run(tmp, task_vars)
        del tmp
        validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        del validation
        self._vars = task_vars or {}
        conn = sandbox_connection(self._connection, "exec_stream")
        if conn is None:
            return dict(result, failed=True,
                        msg="sync needs the microvm.sandbox.agent connection (it streams through the guest agent); "
                            "this host uses %s" % getattr(self._connection, "transport", type(self._connection).__name__))
        self._sandbox = conn
        try:
            excludes = list(args["exclude"])
            for path in args["exclude_from"]:
                excludes.extend(st.read_patterns(self._local_path(path)))
        except OSError as e:
            return dict(result, failed=True, msg="sync: cannot read exclude_from file: %s" % e)
        try:
            if args["mode"] == "push":
                outcome = self._push(args, excludes)
            else:
                outcome = self._pull(args, excludes)
        except SyncFailed as e:
            return dict(result, failed=True, msg="sync: %s" % e)
        except (st.SyncError, ArchiveRefused) as e:
            return dict(result, failed=True, msg="sync: %s" % e)
        except (OSError, mp.ProtocolError) as e:
            return dict(result, failed=True, msg="sync: %s" % e)
        except errors.SandboxError as e:  # from the guest side's stream: UNREACHABLE goes up, the rest fails the task
            return dict(result, failed=True, msg="sync: %s" % outcomes.task_failure(e, "sync"))
        result.update(outcome)
        return result

    # -- shared ---------------------------------------------------------------------------------------
    def _local_path(self, path: str, needle: str | None = None) -> str:
        path = os.path.expanduser(path)
        if os.path.isabs(path):
            return path
        if needle:
            try:
                return self._find_needle(needle, path)
            except AnsibleError:
                pass
        return self._loader.path_dwim(path)

    def _python(self) -> str:
        value = self._vars.get("ansible_python_interpreter")
        if isinstance(value, str) and value.startswith("/") and "{" not in value:
            return value
        return "python3"

    def _program(self, phase: str, request: dict[str, Any]) -> list[str]:
        """argv of one step of the guest side (_guest/sync_tree.py run by the guest's python3)."""
        return ["/bin/sh", "-c", 'exec "$0" -c "$1" "$2"', self._python(), guest_program(),
                st.json.dumps(dict(request, phase=phase, workspace=profile.TRANSFER_ROOT))]

    def _step(self, argv: list[str], as_user: bool, stdin: str | None = None) -> ExecStream:
        """Start one step in the guest with its whole stdin (the file at path stdin, or none) already sent.

        Every step's stdin is one-shot, so the same steps run on either road: the api road carries nothing else
        without the team's interactive stdin.
        """
        self._started = self._started or time.monotonic()
        stream, self._guest_run_dir = self._sandbox.exec_stream(argv, as_user=as_user)
        try:
            if stdin is not None:
                with open(stdin, "rb") as f:
                    for chunk in iter(lambda: f.read(COPY_CHUNK), b""):
                        stream.write(chunk)
            stream.close_stdin()
        except BaseException:
            stream.close()
            raise
        return stream

    def _answer(self, argv: list[str], as_user: bool, what: str, stdin: str | None = None) -> dict[str, Any]:
        """Run a step to its end; -> its JSON answer ({} when it prints none). The guest's stdout is bounded."""
        stream = self._step(argv, as_user, stdin)
        try:
            out = b""
            for chunk in stream.stdout():
                out += chunk
                if len(out) > ANSWER_LIMIT:
                    raise SyncFailed("%s: the guest side said more than %d bytes" % (what, ANSWER_LIMIT))
            rc = (stream.exit or {}).get("rc")
            if rc != 0:
                raise self._guest_failed(stream, what)
            try:
                answer = st.json.loads(out.decode("utf-8")) if out.strip() else {}
            except ValueError as e:
                raise SyncFailed("%s: the guest side answered %s" % (what, shown(out[:200], text=True))) from e
            if not isinstance(answer, dict):
                raise SyncFailed("%s: the guest side answered %s" % (what, shown(out[:200], text=True)))
            return answer
        finally:
            stream.close()

    def _manifest(self, mode: str, root: str, checksum: bool,
                  excludes: list[str]) -> tuple[ExecStream, ManifestReader, list[str], str]:
        """Start the manifest step; -> (stream, manifest reader, guest excludes, a stage name for this run)."""
        scratch = self._sandbox.get_option("scratch_dir") or profile.SCRATCH_DIR
        guest_excludes = excludes + protected(root, scratch)
        stage_name = "sync-%s%s" % (uuid.uuid4().hex[:16], ".tar" if mode == "pull" else "")
        request = {"mode": mode, "root": root, "checksum": checksum, "excludes": guest_excludes}
        # A pull reads as the task's user. A push reads and applies as the agent's user, who owns what its
        # Upload extracted into the stage, and hands every entry it moves in to the task's user (like put_file).
        stream = self._step(self._program("manifest", request), as_user=(mode == "pull"))
        self._timing("guest side started")
        return stream, ManifestReader(stream.stdout()), guest_excludes, stage_name

    def _manifest_done(self, stream: ExecStream, reader: ManifestReader, what: str) -> None:
        """The manifest step ran to its end (what it printed after its END record is read and dropped)."""
        reader.finish()
        if (stream.exit or {}).get("rc") != 0:
            raise self._guest_failed(stream, what)

    def _drop(self, stage_name: str, as_user: bool) -> None:
        """Remove the run's stage in the guest (best effort: the run's scratch dir goes when the run ends)."""
        try:
            self._answer(["/bin/sh", "-c", DROP_SH, "sh", stage_name], as_user, "could not remove the stage %s" % stage_name)
        except (SyncFailed, AnsibleError, OSError, mp.ProtocolError, errors.SandboxError) as e:
            self._display.warning("sync: could not remove %s from the run's scratch dir: %s" % (stage_name, e))

    def _timing(self, what: str) -> None:
        self._display.vvv("SYNC %s after %.3fs" % (what, time.monotonic() - self._started))

    def _guest_failed(self, stream: ExecStream, what: str, reader: ManifestReader | None = None) -> SyncFailed:
        if reader is not None:
            reader.finish()
        rc = (stream.exit or {}).get("rc")
        err = shown(stream.stderr, text=True).strip()
        return SyncFailed("%s (the guest side ended with rc %s): %s" % (what, rc, err[-2000:] or "no message"))

    def _outcome(self, planner: Planner, args: dict[str, Any], src: str, dest: str) -> dict[str, Any]:
        out = dict(changed=planner.changed, src=src, dest=dest, mode=args["mode"],
                   added=planner.added.paths, updated=planner.updated.paths, deleted=planner.deleted.paths,
                   left_out=planner.skipped.paths,
                   counts=dict(added=planner.added.count, updated=planner.updated.count,
                               deleted=planner.deleted.count, left_out=planner.skipped.count),
                   bytes=planner.bytes)
        if planner.skipped.count:
            self._display.warning("sync: %d entr%s left out (links that leave the tree, or special files): %s"
                                  % (planner.skipped.count, "y" if planner.skipped.count == 1 else "ies",
                                     ", ".join(shown(p) for p in planner.skipped.paths[:10])))
        if self._task.diff and planner.changed:
            lines = ["%s %s" % (sign, shown(p)) for sign, listing in (("+", planner.added), ("~", planner.updated),
                                                                      ("-", planner.deleted)) for p in listing.paths]
            hidden = sum(x.count - len(x.paths) for x in (planner.added, planner.updated, planner.deleted))
            if hidden:
                lines.append("... and %d more" % hidden)
            if planner.root_created and not lines:
                lines.append("~ . (the destination directory itself)")
            out["diff"] = dict(prepared="%s %s -> %s\n%s\n" % (args["mode"], src, dest, "\n".join(lines)))
        return out

    # -- push -----------------------------------------------------------------------------------------
    def _push(self, args: dict[str, Any], excludes: list[str]) -> dict[str, Any]:
        src = self._local_path(args["src"], needle="files")
        dest = profile.guest_path(args["dest"])
        if not os.path.isdir(src):
            raise SyncFailed("src %s is not a directory on the controller" % src)
        root_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with tempfile.TemporaryDirectory(prefix="microvm-sync-") as tmp:
                return self._push_tree(args, excludes, src, root_fd, dest, tmp)
        finally:
            os.close(root_fd)

    def _push_tree(self, args: dict[str, Any], excludes: list[str], src: str, root_fd: int, dest: str,
                   tmp: str) -> dict[str, Any]:
        stream, reader, guest_excludes, stage_name = self._manifest("push", dest, args["checksum"], excludes)
        try:
            tar_path, ops_path = os.path.join(tmp, "changes.tar"), os.path.join(tmp, "ops")
            writer = TarWriter(tar_path, root_fd)
            try:
                with open(ops_path, "wb") as ops:
                    planner = Planner(writer.add, ops.write, delete=args["delete"], checksum=args["checksum"],
                                      limit=args["list_limit"])
                    local = st.source_entries(st.walk(root_fd, st.Excludes(guest_excludes), args["checksum"],
                                                      skip_unsafe_links=True), keep_setid=args["preserve_setid"])
                    try:
                        planner.run(local, reader.entries())
                    except st.SyncError as e:
                        raise self._guest_failed(stream, "could not read %s in the sandbox" % dest, reader) from e
            finally:
                writer.close()
            self._manifest_done(stream, reader, "could not read %s in the sandbox" % dest)
        finally:
            stream.close()
        outcome = self._outcome(planner, args, src, dest)
        self._timing("compared")
        if self._task.check_mode or not planner.changed:
            self._timing("done")
            return outcome
        request: dict[str, Any] = {"mode": "push", "root": dest, "excludes": guest_excludes,
                                   "owner": self._sandbox.guest_user()}
        staged = False
        try:
            if writer.members:
                stage = posixpath.join(self._guest_run_dir, stage_name)
                check_archive(tar_path, stage)
                self._answer(["/bin/sh", "-c", STAGE_SH, "sh", stage_name], False, "could not make the stage dir %s" % stage)
                staged = True
                try:
                    self._sandbox.put_archive(tar_path, stage)
                except AnsibleError as e:
                    raise SyncFailed("the sandbox refused or failed to extract the changes into %s: %s"
                                     % (stage, outcomes.task_failure(e, "sync"))) from e
                request["stage_name"] = stage_name
                self._timing("archive of %d members uploaded" % writer.members)
            summary = self._answer(self._program("apply", request), False, "could not apply the changes to %s" % dest,
                                   stdin=ops_path)
            staged = False  # the apply step removes the stage whatever happened to it
        finally:
            if staged:
                self._drop(stage_name, as_user=False)
        self._timing("applied")
        outcome["applied"] = summary
        return outcome

    # -- pull -----------------------------------------------------------------------------------------
    def _pull(self, args: dict[str, Any], excludes: list[str]) -> dict[str, Any]:
        src = profile.guest_path(args["src"])
        dest = self._local_path(args["dest"])
        root_fd = st.open_root(dest, create=not self._task.check_mode)
        try:
            with tempfile.TemporaryDirectory(prefix="microvm-sync-") as tmp:
                return self._pull_tree(args, excludes, src, root_fd, dest, tmp)
        finally:
            if root_fd is not None:
                os.close(root_fd)

    def _pull_tree(self, args: dict[str, Any], excludes: list[str], src: str, root_fd: int | None, dest: str,
                   tmp: str) -> dict[str, Any]:
        stream, reader, guest_excludes, stage_name = self._manifest("pull", src, args["checksum"], excludes)
        local_excludes = st.Excludes(guest_excludes)
        try:
            wanted_path, ops_path = os.path.join(tmp, "wanted"), os.path.join(tmp, "ops")
            counter = {"wanted": 0}
            with open(wanted_path, "wb") as wanted, open(ops_path, "wb") as ops:
                def want(entry: Any, ancestor_only: bool = False) -> None:
                    wanted.write(entry.path + b"\0")
                    counter["wanted"] += 1
                planner = Planner(want, ops.write, delete=args["delete"], checksum=args["checksum"],
                                  limit=args["list_limit"])
                local = st.walk(root_fd, local_excludes, args["checksum"]) if root_fd is not None else iter(())
                # What the guest sends is judged here again, whatever its own walk did (the guest is not trusted).
                source = st.source_entries(reader.entries(), keep_setid=args["preserve_setid"], private_root=True)
                try:
                    planner.run(source, local)
                except st.SyncError as e:
                    raise self._guest_failed(stream, "could not read %s in the sandbox" % src, reader) from e
            self._manifest_done(stream, reader, "could not read %s in the sandbox" % src)
        finally:
            stream.close()
        outcome = self._outcome(planner, args, src, dest)
        self._timing("compared")
        if self._task.check_mode or not planner.changed or not counter["wanted"]:
            if not self._task.check_mode and planner.changed:
                self._apply_local(_dest_fd(root_fd, dest), None, ops_path, local_excludes, dest, args)
            self._timing("done")
            return outcome
        local_tar = os.path.join(tmp, "changes.tar")
        try:
            made = self._answer(self._program("pack", {"mode": "pull", "root": src, "stage_name": stage_name}), True,
                                "could not pack the changes of %s" % src, stdin=wanted_path)
            try:
                # the path this run chose, never one the guest names
                self._sandbox.fetch_file(posixpath.join(self._guest_run_dir, stage_name), local_tar)
            except AnsibleError as e:
                raise SyncFailed("could not download the changes of %s: %s" % (src, outcomes.task_failure(e, "sync"))) from e
        finally:
            self._drop(stage_name, as_user=True)  # made by the pack step as the task's user, or never made
        self._timing("archive of %s members downloaded" % made.get("members"))
        check_archive(local_tar, dest)
        self._apply_local(_dest_fd(root_fd, dest), local_tar, ops_path, local_excludes, dest, args, wanted_path)
        self._timing("applied")
        return outcome

    @staticmethod
    def _apply_local(root_fd: int, tar_path: "str | None", ops_path: str, excludes: "st.Excludes | None", dest: str,
                     args: dict, wanted_path: "str | None" = None) -> None:
        """Extract the checked tar into a stage dir beside dest, judge its links against dest as it is on disk,
        rename it into place, then the operations. Every path below dest is opened from root_fd, no link followed."""
        if tar_path is not None:
            if wanted_path is None:
                raise SyncFailed("internal error: the pulled archive %s comes without the list of its paths" % tar_path)
            parent = os.path.dirname(os.path.abspath(dest.rstrip("/")))
            try:
                stage = tempfile.mkdtemp(prefix=".microvm-sync.", dir=parent)
            except OSError:
                stage = tempfile.mkdtemp(prefix="microvm-sync.")
            try:
                stage_fd = os.open(stage, st.DIR_FLAGS)
                try:
                    with open(tar_path, "rb") as f, open(wanted_path, "rb") as wanted:
                        asked = (p for p in st.split_stream(iter(lambda: wanted.read(COPY_CHUNK), b"")) if p)
                        links = st.extract_checked(f, stage_fd, wanted=asked, keep_setid=args["preserve_setid"])
                    judge_links(links, stage_fd, root_fd, dest)
                    st.apply_stage(stage_fd, root_fd)
                finally:
                    os.close(stage_fd)
            finally:
                import shutil
                shutil.rmtree(stage, ignore_errors=True)
        with open(ops_path, "rb") as ops:
            st.run_ops(root_fd, st.split_stream(iter(lambda: ops.read(COPY_CHUNK), b"")), excludes)


class OnDisk:
    """The links of the tree a pull leaves, as archive_check's resolver asks for them (name -> target or None):
    the stage's entry where it has one, else dest's, each looked up from its directory fd, no link followed."""

    def __init__(self, stage_fd: int, dest_fd: int) -> None:
        self.fds = (stage_fd, dest_fd)

    def get(self, name: str) -> "str | None":
        parents, _sep, last = os.fsencode(name).rpartition(b"/")
        for fd in self.fds:
            try:
                dir_fd = st.open_dir_at(fd, parents.split(b"/") if parents else [])
            except OSError:
                continue  # missing, or not a directory there
            try:
                mode = os.stat(last, dir_fd=dir_fd, follow_symlinks=False).st_mode
                return st.rel_text(os.readlink(last, dir_fd=dir_fd)) if stat.S_ISLNK(mode) else None
            except FileNotFoundError:
                continue
            finally:
                os.close(dir_fd)
        return None


def judge_links(links: "list[tuple[bytes, bytes]]", stage_fd: int, dest_fd: int, dest: str) -> None:
    """Refuse the pull (nothing moved yet) when a link it brings would lead out of dest through the tree as it
    is on disk: dest's own links (however they got there) and the pull's, resolved together."""
    view = OnDisk(stage_fd, dest_fd)
    offending = []
    for rel, target in links:
        problem = link_problem(st.rel_text(rel), st.rel_text(target), view, dest)
        if problem:
            offending.append(shown("%s (%s)" % (st.rel_text(rel), problem)))  # the guest's names
    if offending:
        raise SyncFailed("refused the sandbox's tree, nothing was changed in %s: through the links already there, "
                         "these links would lead outside it: %s" % (dest, "; ".join(offending[:20])))
