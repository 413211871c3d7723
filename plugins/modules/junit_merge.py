#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: junit_merge
short_description: Merge JUnit XML files from untrusted sandboxes into one, safely
version_added: 0.1.0
description:
  - Reads JUnit XML files (pulled from sandboxes, as the C(microvm.sandbox.ci) playbook does with each
    shard's file) and writes one C(<testsuites>) file holding every C(<testsuite>) of every file, each renamed
    C(<name>/<its name>) so the shards stay apart.
  - B(The files are hostile input.) Each is refused when larger than O(max_bytes) (checked before it is read, and
    again while reading), parsed with the standard library's expat without a DTD - a document type declaration,
    an entity declaration or an external entity is refused, so no entity is ever expanded (no "billion laughs",
    no file or network read) - and refused when nested deeper than 32 elements or holding more than
    O(max_elements) elements. Comments and processing instructions are dropped.
  - The counts (C(tests), C(failures), C(errors), C(skipped)) of every suite and of the result are counted from its
    C(<testcase>) elements, never taken from the file's attributes.
  - An action plugin - it runs on the controller, in its own process, whatever host the task is for; the files and
    O(dest) are controller paths (a relative path is relative to the current directory).
author:
  - microvm.sandbox maintainers (@microvm)
attributes:
  check_mode:
    description: Reads and checks every file and reports whether O(dest) would change, without writing it.
    support: full
  diff_mode:
    description: No diff; RV(files) says what each file added.
    support: none
  platform:
    description: Runs on the controller.
    support: full
    platforms: posix
options:
  src:
    description:
      - The JUnit XML files to merge, in order.
    type: list
    elements: path
    required: true
  names:
    description:
      - A name per file of O(src), same order, prefixed to the names of its suites (a shard's name, say).
      - Default - the name of the directory holding the file.
    type: list
    elements: str
  dest:
    description:
      - The merged file, written atomically (a temporary file renamed into place). Its directory is created.
    type: path
    required: true
  missing:
    description:
      - What a file of O(src) that does not exist does - V(warn) leaves it out with a warning (it is listed in
        RV(missing)), V(fail) fails the task.
    type: str
    choices: [warn, fail]
    default: warn
  max_bytes:
    description:
      - The largest file accepted, in bytes.
    type: int
    default: 16777216
  max_elements:
    description:
      - The most elements a file may hold.
    type: int
    default: 1000000
seealso:
  - module: microvm.sandbox.sync
"""

EXAMPLES = r"""
- name: Merge the shards' results
  microvm.sandbox.junit_merge:
    src:
      - results/shards/shard-0/junit.xml
      - results/shards/shard-1/junit.xml
    dest: results/junit.xml
  register: junit

- name: Show the totals
  ansible.builtin.debug:
    msg: "{{ junit.tests }} tests, {{ junit.failures }} failures, {{ junit.errors }} errors"
"""

RETURN = r"""
dest:
  description: The merged file.
  returned: always
  type: str
tests:
  description: The C(<testcase>) elements in all files.
  returned: always
  type: int
failures:
  description: The test cases with a C(<failure>).
  returned: always
  type: int
errors:
  description: The test cases with an C(<error>).
  returned: always
  type: int
skipped:
  description: The test cases with a C(<skipped>).
  returned: always
  type: int
time:
  description: The sum of the suites' C(time) attributes (those that are numbers), in seconds.
  returned: always
  type: float
files:
  description: Per file of O(src) merged - its C(name), C(path), C(tests), C(failures), C(errors), C(skipped).
  returned: always
  type: list
  elements: dict
missing:
  description: The files of O(src) that did not exist (with O(missing=warn)).
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.junit_xml import ARGUMENT_SPEC, run  # noqa: E402


def main() -> None:
    # The action plugin of the same name runs this on the controller, in-process; this entry point is the same
    # work as a module (the files and dest are then on the host the task runs on).
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    result = run(module.params, module.check_mode, module.warn)
    if result.pop("failed", False):
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
