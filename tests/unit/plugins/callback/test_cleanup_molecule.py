# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The cleanup callback's reading of a Molecule scenario (its `molecule` option): which session names the ledger and
the instance config give, and what it leaves once they are deleted (what Molecule's destroy would have left)."""
from __future__ import annotations

import pathlib

import yaml

from ansible_collections.microvm.sandbox.plugins.callback.cleanup import MOLECULE_LEDGER, MoleculeScenario


def scenario_dir(tmp_path: pathlib.Path) -> dict[str, str]:
    ephemeral = tmp_path / "molecule.abc.default"
    ephemeral.mkdir()
    # an older run's leftover and this run's session in the ledger; the instance config names this run's
    (ephemeral / MOLECULE_LEDGER).write_text(yaml.safe_dump([
        {"instance": "instance", "name": "molecule-default-instance-old00001", "run_id": "old00001"},
        {"instance": "instance", "name": "molecule-default-instance-new00002", "run_id": "new00002"},
    ]))
    (ephemeral / "instance_config.yml").write_text("# Molecule managed\n\n" + yaml.safe_dump([
        {"instance": "instance", "address": "0b1c-id", "connection": "microvm.sandbox.agent",
         "session": "molecule-default-instance-new00002"},
        {"instance": "other", "address": "10.0.0.5"},  # not a sandbox of this collection: no session key
    ]))
    (ephemeral / "state.yml").write_text("# Molecule managed\n\n---\nconverged: true\ncreated: true\n"
                                         "driver: default\nprepared: true\nrun_uuid: r-1\n")
    return {"MOLECULE_EPHEMERAL_DIRECTORY": str(ephemeral),
            "MOLECULE_INSTANCE_CONFIG": str(ephemeral / "instance_config.yml"),
            "MOLECULE_STATE_FILE": str(ephemeral / "state.yml"),
            "MOLECULE_SCENARIO_NAME": "default"}


def test_not_under_molecule_knows_no_scenario() -> None:
    assert MoleculeScenario.from_env({"HOME": "/root"}) is None


def test_names_from_the_ledger_and_the_instance_config_once_each(tmp_path: pathlib.Path) -> None:
    scenario = MoleculeScenario.from_env(scenario_dir(tmp_path))
    assert scenario is not None and scenario.name == "default"
    assert scenario.session_names() == ["molecule-default-instance-old00001", "molecule-default-instance-new00002"]


def test_missing_or_broken_files_name_nothing(tmp_path: pathlib.Path) -> None:
    env = scenario_dir(tmp_path)
    pathlib.Path(env["MOLECULE_INSTANCE_CONFIG"]).write_text("{not: [yaml")
    (pathlib.Path(env["MOLECULE_EPHEMERAL_DIRECTORY"]) / MOLECULE_LEDGER).unlink()
    scenario = MoleculeScenario.from_env(env)
    assert scenario is not None and scenario.session_names() == []


def test_forget_leaves_what_destroy_leaves(tmp_path: pathlib.Path) -> None:
    env = scenario_dir(tmp_path)
    scenario = MoleculeScenario.from_env(env)
    assert scenario is not None
    scenario.forget()
    assert not (pathlib.Path(env["MOLECULE_EPHEMERAL_DIRECTORY"]) / MOLECULE_LEDGER).exists()
    assert yaml.safe_load(pathlib.Path(env["MOLECULE_INSTANCE_CONFIG"]).read_text()) == []
    state_text = pathlib.Path(env["MOLECULE_STATE_FILE"]).read_text()
    assert state_text.startswith("# Molecule managed\n")
    state = yaml.safe_load(state_text)
    # not created: the next `molecule converge` runs create again; the rest of Molecule's state is kept
    assert state == {"converged": False, "created": False, "driver": "default", "prepared": False, "run_uuid": "r-1"}
    assert scenario.session_names() == []
    scenario.forget()  # a second time (nothing left) is harmless
