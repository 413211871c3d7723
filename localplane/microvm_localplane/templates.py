"""Templates: the built-in `base`, and templates built from an OCI image with skopeo and umoci.

A build copies the image into an OCI layout under the state dir
(`skopeo copy`), records its manifest digest, unpacks it into a rootfs
(`umoci raw unpack --rootless`) and checks that it leaves /tmp empty. A
failing tool's own reason is reported on the build, and the template goes
FAILED.
"""
import asyncio
import json
import logging
import os
import shutil
import uuid

from . import contract
from .httputil import ApiFailure, now_rfc3339

log = logging.getLogger("microvm_localplane.templates")

LOCAL_REGISTRIES = ("localhost", "127.0.0.1", "[::1]")
TOOL_TIMEOUT = 1800


def parse_oci_ref(ref):
    """-> (skopeo source, {registry, repository, tag, digest}); ValueError when unusable."""
    if not isinstance(ref, str) or not ref.strip() or any(c.isspace() for c in ref):
        raise ValueError("source_oci_ref must be an image reference such as localhost:5000/repo:tag "
                         "or oci:/path/to/layout:tag")
    if ref.startswith("oci:"):
        rest = ref[4:]
        path, _sep, tag = rest.partition(":")
        if not path.startswith("/"):
            raise ValueError("an OCI layout reference needs an absolute path: oci:/path/to/layout:tag")
        image = {"registry": "oci", "repository": path, "tag": tag or "latest", "digest": ""}
        return "oci:%s:%s" % (path, image["tag"]), image
    name = ref[len("docker://"):] if ref.startswith("docker://") else ref
    digest = ""
    if "@" in name:
        name, digest = name.split("@", 1)
    first, slash, remainder = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, repo = first, remainder
    else:
        # No default registry: the platform builds from the team's own registry, so the host must be named.
        raise ValueError("source_oci_ref %s names no registry host: use registry.example.com/repo:tag, "
                         "localhost:5000/repo:tag or oci:/path/to/layout:tag" % contract.shown(ref))
    tag = ""
    if ":" in repo.rsplit("/", 1)[-1]:
        repo, tag = repo.rsplit(":", 1)
    if not repo or not all(part for part in repo.split("/")):
        raise ValueError("source_oci_ref %s has no repository" % contract.shown(ref))
    if not tag and not digest:
        tag = "latest"
    source = "docker://%s/%s%s" % (registry, repo, ("@" + digest) if digest else (":" + tag))
    return source, {"registry": registry, "repository": repo, "tag": tag, "digest": digest}


def is_local_registry(registry):
    host = registry.rsplit(":", 1)[0] if not registry.startswith("[") else registry.split("]")[0] + "]"
    return host in LOCAL_REGISTRIES


# Every documented platform base maps onto one of the local plane's root filesystems. For now they all map to the
# built-in `base` rootfs: the image's own files are layered as the template's rootfs, and no base adds an agent.
BASE_ROOTFS = dict((base, contract.BUILTIN_TEMPLATE) for base in contract.BASE_TEMPLATES)
# The base the built-in template reports: it carries no agent, like the documented `sandbox` base.
BUILTIN_BASE = "sandbox"


def base_rootfs(base_template):
    """The local root filesystem (a built-in template name) a documented base_template maps to; None if unknown."""
    return BASE_ROOTFS.get(base_template) if isinstance(base_template, str) else None


class Templates:
    def __init__(self, store, sessions_in_use, base_pending=lambda: None):
        self.store = store
        self.sessions_in_use = sessions_in_use  # callable(template name) -> number of live sessions using it
        # callable() -> a note while the built-in template's rootfs is still to be built (the first boot waits), or None
        self.base_pending = base_pending
        self.build_slot = asyncio.Semaphore(1)
        self.tasks = set()

    # -- views --------------------------------------------------------------
    def builtin(self):
        return {"template_id": contract.BUILTIN_TEMPLATE_ID, "name": contract.BUILTIN_TEMPLATE,
                "spec": {"base_template": BUILTIN_BASE},
                "status": contract.template_status_string(contract.TEMPLATE_READY),
                "created_at": "1970-01-01T00:00:00.000Z", "updated_at": "1970-01-01T00:00:00.000Z",
                "builtin": True}

    @staticmethod
    def public_view(rec, listed=False):
        """The documented template object: spec carries the base template only (pydo create_template); list
        items carry no spec at all (pydo list_templates)."""
        if rec.get("builtin"):
            out = {k: v for k, v in rec.items() if k != "builtin"}
        else:
            out = {"template_id": rec["template_id"], "name": rec["name"],
                   "spec": {"base_template": rec["base_template"]},
                   "status": contract.template_status_string(rec["status"]),
                   "created_at": rec["created_at"], "updated_at": rec["updated_at"]}
        if listed:
            del out["spec"]
        return out

    @staticmethod
    def build_view(template, build, listed=False):
        """The documented build object (pydo get_template_build); list items carry no spec."""
        out = {"build_id": build["build_id"], "template_id": template["template_id"], "name": template["name"],
               "spec": {"base_template": build.get("base_template") or template.get("base_template")
                        or (template.get("spec") or {}).get("base_template", "")},
               "status": build["status"], "error": build.get("error", ""), "created_at": build["created_at"],
               "updated_at": build.get("updated_at") or build.get("finished_at") or build["created_at"]}
        if listed:
            del out["spec"]
        return out

    def listing(self):
        regs = sorted(self.store.templates.values(), key=lambda r: (r["created_at"], r["template_id"]))
        return [self.builtin()] + regs

    def get(self, template_id):
        if template_id == contract.BUILTIN_TEMPLATE_ID:
            return self.builtin()
        rec = self.store.templates.get((template_id or "").lower())
        if rec is None:
            raise ApiFailure(404, "template %r not found" % (template_id or "")[:100])
        return rec

    def by_name(self, name):
        low = name.lower()
        if low == contract.BUILTIN_TEMPLATE:
            return self.builtin()
        for rec in self.store.templates.values():
            if rec["name"].lower() == low or rec["template_id"] == low:
                return rec
        return None

    def rootfs_for_session(self, name):
        """-> (rootfs dict for GuestManager, warnings). A template that cannot boot refuses the create."""
        rec = self.by_name(name)
        if rec is None:
            known = ", ".join(sorted([contract.BUILTIN_TEMPLATE] + [r["name"] for r in self.store.templates.values()]))
            raise ApiFailure(400, "unknown template %s: no template with that name exists (known: %s)" % (contract.shown(name), known))
        if rec.get("builtin"):
            note = self.base_pending()
            return {"kind": "base", "path": None}, [note] if note else []
        if rec["status"] == contract.TEMPLATE_FAILED:
            raise ApiFailure(400, "template %r failed to build: %s" % (name, self._last_error(rec)))
        if rec["status"] != contract.TEMPLATE_READY or not rec.get("rootfs"):
            raise ApiFailure(409, "template %r is %s; create the session once it is TEMPLATE_STATUS_READY" % (
                name, contract.template_status_string(rec["status"])))
        return {"kind": "dir", "path": rec["rootfs"]}, []

    @staticmethod
    def _last_error(rec):
        for build in reversed(rec.get("builds", [])):
            if build.get("error"):
                return build["error"]
        return "no reason recorded"

    # -- changes --------------------------------------------------------------
    def _check_base(self, base):
        if base is None or base == "":
            raise ApiFailure(400, "base_template is required: one of %s" % ", ".join(contract.BASE_TEMPLATES))
        if base_rootfs(base) is None:
            raise ApiFailure(400, "unknown base_template %s: use one of %s" % (contract.shown(base), ", ".join(contract.BASE_TEMPLATES)))
        return base

    def create(self, doc):
        name = doc.get("name")
        problem = contract.name_problem(name, "template")
        if problem:
            raise ApiFailure(400, problem)
        if self.by_name(name) is not None:
            raise ApiFailure(409, "a template named %r already exists" % name)
        base = self._check_base(doc.get("base_template"))
        ref = doc.get("source_oci_ref")
        if ref is None:
            raise ApiFailure(400, "source_oci_ref is required: the image to build the template from")
        try:
            parse_oci_ref(ref)
        except ValueError as e:
            raise ApiFailure(400, str(e)) from e
        now = now_rfc3339()
        rec = {"template_id": str(uuid.uuid4()), "name": name, "base_template": base, "source_oci_ref": ref,
               "image": {"registry": "", "repository": "", "tag": "", "digest": ""},
               "status": contract.TEMPLATE_PENDING, "created_at": now, "updated_at": now, "builds": [], "rootfs": None}
        self._start_build(rec)
        return rec

    def update(self, rec, doc):
        if rec.get("builtin"):
            raise ApiFailure(409, "the built-in template %r cannot be rebuilt" % rec["name"])
        if doc.get("source_oci_ref") is not None:
            try:
                parse_oci_ref(doc["source_oci_ref"])
            except ValueError as e:
                raise ApiFailure(400, str(e)) from e
            rec["source_oci_ref"] = doc["source_oci_ref"]
        if doc.get("base_template") is not None:
            rec["base_template"] = self._check_base(doc["base_template"])
        if any(b["status"] in (contract.BUILD_PENDING, contract.BUILD_BUILDING) for b in rec["builds"]):
            raise ApiFailure(409, "template %r is already building" % rec["name"])
        self._start_build(rec)
        return rec

    def delete(self, rec):
        if rec.get("builtin"):
            raise ApiFailure(409, "the built-in template %r cannot be deleted" % rec["name"])
        users = self.sessions_in_use(rec["name"])
        if users:
            raise ApiFailure(409, "template %r is used by %d live session(s); delete them first" % (rec["name"], users))
        rec["deleted"] = True
        self.store.forget_template(rec["template_id"])

    def _start_build(self, rec):
        now = now_rfc3339()
        build = {"build_id": str(uuid.uuid4()), "status": contract.BUILD_PENDING, "error": "", "created_at": now,
                 "base_template": rec.get("base_template", "")}
        rec["builds"].append(build)
        if rec["status"] != contract.TEMPLATE_READY:
            rec["status"] = contract.TEMPLATE_PENDING
        rec["updated_at"] = now
        self.store.save_template(rec)
        task = asyncio.get_running_loop().create_task(self._build(rec, build))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def resume_interrupted(self):
        """Builds cut short by a restart are run again."""
        for rec in list(self.store.templates.values()):
            for build in rec["builds"]:
                if build["status"] in (contract.BUILD_PENDING, contract.BUILD_BUILDING):
                    build["status"] = contract.BUILD_PENDING
                    task = asyncio.get_running_loop().create_task(self._build(rec, build))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)

    # -- the build ------------------------------------------------------------
    def _mark(self, rec, build, status, template_status=None, error=None):
        build["status"] = status
        if error is not None:
            build["error"] = error
        if template_status:
            rec["status"] = template_status
        rec["updated_at"] = now_rfc3339()
        if rec["template_id"] in self.store.templates:
            self.store.save_template(rec)

    async def _build(self, rec, build):
        async with self.build_slot:
            if rec.get("deleted"):
                return
            building = contract.TEMPLATE_BUILDING if rec["status"] != contract.TEMPLATE_READY else None
            self._mark(rec, build, contract.BUILD_BUILDING, building)
            workdir = os.path.join(self.store.template_data(rec["template_id"]), build["build_id"])
            try:
                image, rootfs = await self._run_build(rec["source_oci_ref"], workdir)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.info("template %s build %s failed: %s", rec["name"], build["build_id"], e)
                shutil.rmtree(workdir, ignore_errors=True)
                self._mark(rec, build, contract.BUILD_FAILED, contract.TEMPLATE_FAILED, str(e))
                return
            if rec.get("deleted"):
                shutil.rmtree(workdir, ignore_errors=True)
                return
            rec["image"] = image
            rec["rootfs"] = rootfs
            self._mark(rec, build, contract.BUILD_SUCCEEDED, contract.TEMPLATE_READY, "")

    async def _run_build(self, ref, workdir):
        source, image = parse_oci_ref(ref)
        shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(workdir)
        layout = os.path.join(workdir, "layout")
        rootfs = os.path.join(workdir, "rootfs")
        copy = ["skopeo", "copy", "--quiet"]
        if source.startswith("docker://") and is_local_registry(image["registry"]):
            copy.append("--src-tls-verify=false")
        copy += [source, "oci:%s:latest" % layout]
        await run_tool(copy, "skopeo copy")
        # The source's own digest (a copy into a layout may convert the manifest and change it).
        image["digest"] = image["digest"] or await source_digest(source, copy) or manifest_digest(layout)
        await run_tool(["umoci", "raw", "unpack", "--rootless", "--image", "%s:latest" % layout, rootfs], "umoci unpack")
        leftovers = sorted(os.listdir(os.path.join(rootfs, "tmp"))) if os.path.isdir(os.path.join(rootfs, "tmp")) else []
        if leftovers:
            raise RuntimeError("the image leaves files in /tmp (%s); a template's last root step must empty /tmp"
                               % ", ".join(leftovers[:10]))
        shutil.rmtree(layout, ignore_errors=True)
        return image, rootfs


def manifest_digest(layout):
    with open(os.path.join(layout, "index.json")) as f:
        index = json.load(f)
    manifests = index.get("manifests") or []
    if not manifests:
        raise RuntimeError("the copied image has no manifest")
    return manifests[0]["digest"]


async def source_digest(source, copy_argv):
    if not source.startswith("docker://"):
        return ""
    argv = ["skopeo", "inspect", "--format", "{{.Digest}}"]
    if "--src-tls-verify=false" in copy_argv:
        argv.append("--tls-verify=false")
    try:
        out = await run_tool(argv + [source], "skopeo inspect")
    except RuntimeError:
        return ""
    digest = out.strip()
    return digest if digest.startswith("sha256:") else ""


async def run_tool(argv, what):
    """Run a build tool; its own reason (stderr) becomes the error."""
    if shutil.which(argv[0]) is None:
        raise RuntimeError("%s is not installed (apt-get install -y %s)" % (argv[0], argv[0]))
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TOOL_TIMEOUT)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        reason = (err or out).decode("utf-8", "replace").strip().splitlines()
        raise RuntimeError("%s failed: %s" % (what, " ".join(reason[-3:]) or "exit code %d" % proc.returncode))
    return out.decode("utf-8", "replace")
