"""Persistent state: one JSON file per session, checkpoint, template and Environment Config.

Every write goes to a temporary file in the same directory, is fsynced and
renamed into place, so a crash leaves either the old record or the new one.
Records are plain dicts held in memory and written through on every change.
"""
import json
import os
import shutil
import tempfile


def write_json_atomic(path, data, mode=0o600):
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_dir(directory):
    """Every record in a directory of JSON files; torn temporary files are dropped."""
    records = {}
    if not os.path.isdir(directory):
        return records
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if entry.startswith(".tmp-"):
            os.unlink(path)
            continue
        if not entry.endswith(".json"):
            continue
        try:
            with open(path) as f:
                records[entry[:-5]] = json.load(f)
        except (OSError, ValueError):
            continue
    return records


class Store:
    """Sessions, checkpoints and templates of one state dir."""

    def __init__(self, state_dir):
        self.root = os.path.abspath(state_dir)
        self.sessions_dir = os.path.join(self.root, "sessions")
        self.templates_dir = os.path.join(self.root, "templates")
        self.checkpoints_dir = os.path.join(self.root, "checkpoints")
        self.checkpoint_data_dir = os.path.join(self.root, "checkpoint-data")
        self.rootfs_dir = os.path.join(self.root, "template-data")
        self.configs_dir = os.path.join(self.root, "configs")
        for d in (self.sessions_dir, self.templates_dir, self.checkpoints_dir, self.checkpoint_data_dir,
                  self.rootfs_dir, self.configs_dir):
            os.makedirs(d, exist_ok=True)
        self.sessions = _read_dir(self.sessions_dir)
        self.templates = _read_dir(self.templates_dir)
        self.configs = _read_dir(self.configs_dir)
        self.checkpoints = {}  # session_id -> {checkpoint_id: record}
        for sid in sorted(os.listdir(self.checkpoints_dir)):
            if os.path.isdir(os.path.join(self.checkpoints_dir, sid)):
                self.checkpoints[sid] = _read_dir(os.path.join(self.checkpoints_dir, sid))

    # -- sessions ---------------------------------------------------------
    def save_session(self, rec):
        self.sessions[rec["session_id"]] = rec
        write_json_atomic(os.path.join(self.sessions_dir, rec["session_id"] + ".json"), rec)

    def forget_session(self, session_id):
        self.sessions.pop(session_id, None)
        _unlink(os.path.join(self.sessions_dir, session_id + ".json"))
        for cid in list(self.checkpoints.get(session_id, {})):
            self.forget_checkpoint(session_id, cid)
        shutil.rmtree(os.path.join(self.checkpoints_dir, session_id), ignore_errors=True)
        self.checkpoints.pop(session_id, None)

    # -- Environment Configs (they hold a spec with its secrets: files 0600, like the sessions') ----
    def save_config(self, rec):
        self.configs[rec["config_id"]] = rec
        write_json_atomic(os.path.join(self.configs_dir, rec["config_id"] + ".json"), rec)

    def forget_config(self, config_id):
        self.configs.pop(config_id, None)
        _unlink(os.path.join(self.configs_dir, config_id + ".json"))

    # -- checkpoints ------------------------------------------------------
    def checkpoint_data(self, session_id, checkpoint_id):
        return os.path.join(self.checkpoint_data_dir, session_id, checkpoint_id)

    def save_checkpoint(self, rec):
        sid, cid = rec["session_id"], rec["checkpoint_id"]
        self.checkpoints.setdefault(sid, {})[cid] = rec
        write_json_atomic(os.path.join(self.checkpoints_dir, sid, cid + ".json"), rec)

    def forget_checkpoint(self, session_id, checkpoint_id):
        self.checkpoints.get(session_id, {}).pop(checkpoint_id, None)
        _unlink(os.path.join(self.checkpoints_dir, session_id, checkpoint_id + ".json"))
        shutil.rmtree(self.checkpoint_data(session_id, checkpoint_id), ignore_errors=True)

    # -- templates --------------------------------------------------------
    def template_data(self, template_id):
        return os.path.join(self.rootfs_dir, template_id)

    def save_template(self, rec):
        self.templates[rec["template_id"]] = rec
        write_json_atomic(os.path.join(self.templates_dir, rec["template_id"] + ".json"), rec)

    def forget_template(self, template_id):
        self.templates.pop(template_id, None)
        _unlink(os.path.join(self.templates_dir, template_id + ".json"))
        shutil.rmtree(self.template_data(template_id), ignore_errors=True)


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
