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
  - Reads JUnit XML files (pulled from sandboxes, as the P(microvm.sandbox.ci#playbook) playbook does with each
    shard's file) and writes one C(<testsuites>) file holding every C(<testsuite>) of every file, each renamed
    C(<name>/<its name>) so the shards stay apart.
  - B(The files are hostile input.) Each is refused when larger than O(max_bytes) (checked before it is read, and
    again while reading), parsed with the standard library's expat without a DTD - a document type declaration,
    an entity declaration or an external entity is refused, so no entity is ever expanded (no "billion laughs",
    no file or network read) - and refused when nested deeper than 32 elements or holding more than
    O(max_elements) elements. Comments and processing instructions are dropped.
  - The counts (C(tests), C(failures), C(errors), C(skipped)) of every suite and of the result are counted from its
    C(<testcase>) elements, never taken from the file's attributes.
  - Runs where the task runs; the files and O(dest) are paths on that host (the controller, with C(localhost)).
author:
  - microvm.sandbox maintainers (@microvm)
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  platform:
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
  delegate_to: localhost

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

import math  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import xml.etree.ElementTree as ET  # noqa: E402
from typing import Any  # noqa: E402
from xml.parsers import expat  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

MAX_DEPTH = 32
READ_CHUNK = 1 << 16


class Refused(Exception):
    """A file that is not accepted, with the reason."""


def parse_bounded(path: str, max_bytes: int, max_elements: int) -> ET.Element:
    """The file's root element, built by expat with no DTD, no entities and bounded size, depth and count."""
    size = os.stat(path).st_size
    if size > max_bytes:
        raise Refused("%d bytes, more than max_bytes (%d)" % (size, max_bytes))
    parser = expat.ParserCreate()
    # No DTD at all: every declaration that could define an entity or reach outside is refused.
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    stack: list[ET.Element] = []
    root: list[ET.Element] = []
    count = [0]

    def refuse(*_args: Any) -> None:
        raise Refused("a document type or entity declaration (refused: no DTD is read)")

    def start(tag: str, attrs: dict[str, str]) -> None:
        count[0] += 1
        if count[0] > max_elements:
            raise Refused("more than max_elements (%d) elements" % max_elements)
        if len(stack) >= MAX_DEPTH:
            raise Refused("elements nested deeper than %d" % MAX_DEPTH)
        el = ET.Element(tag, attrs)
        if stack:
            stack[-1].append(el)
        else:
            root.append(el)
        stack.append(el)

    def end(_tag: str) -> None:
        stack.pop()

    def text(data: str) -> None:
        if not stack:
            return
        el = stack[-1]
        if len(el):
            el[-1].tail = (el[-1].tail or "") + data
        else:
            el.text = (el.text or "") + data

    parser.StartDoctypeDeclHandler = refuse
    parser.EntityDeclHandler = refuse
    parser.UnparsedEntityDeclHandler = refuse
    parser.ExternalEntityRefHandler = refuse
    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = text
    read = 0
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(READ_CHUNK)
                read += len(chunk)
                if read > max_bytes:  # it grew since the stat
                    raise Refused("more than max_bytes (%d)" % max_bytes)
                parser.Parse(chunk, not chunk)
                if not chunk:
                    break
    except expat.ExpatError as e:
        raise Refused("not well-formed XML: %s" % e) from e
    if not root:
        raise Refused("no root element")
    return root[0]


def suites_of(root: ET.Element) -> list[ET.Element]:
    if root.tag == "testsuite":
        return [root]
    if root.tag == "testsuites":
        # direct children only: a nested suite's test cases are counted with its parent's
        return root.findall("testsuite")
    raise Refused("the root element is <%s>, not <testsuites> or <testsuite>" % root.tag[:64])


def count(suite: ET.Element) -> dict[str, int]:
    cases = list(suite.iter("testcase"))
    return dict(tests=len(cases),
                failures=sum(1 for c in cases if c.find("failure") is not None),
                errors=sum(1 for c in cases if c.find("error") is not None),
                skipped=sum(1 for c in cases if c.find("skipped") is not None))


def seconds(value: str | None) -> float:
    try:
        t = float(value or 0)
    except ValueError:
        return 0.0
    return t if math.isfinite(t) and t >= 0 else 0.0


def merge(files: list[tuple[str, str]], max_bytes: int, max_elements: int) -> tuple[bytes, dict[str, Any]]:
    """The merged document and its totals, from (name, path) pairs; raises Refused naming the file."""
    out = ET.Element("testsuites", name="microvm.sandbox.ci")
    totals: dict[str, Any] = dict(tests=0, failures=0, errors=0, skipped=0, time=0.0, files=[])
    for name, path in files:
        try:
            root = parse_bounded(path, max_bytes, max_elements)
            suites = suites_of(root)
        except (Refused, OSError) as e:
            raise Refused("%s (%s): %s" % (name, path, e)) from e
        per: dict[str, Any] = dict(name=name, path=path, tests=0, failures=0, errors=0, skipped=0)
        for suite in suites:
            c = count(suite)
            t = seconds(suite.get("time"))
            suite.set("name", "%s/%s" % (name, suite.get("name") or "suite"))
            for k, v in c.items():
                suite.set(k, str(v))
                per[k] += v
                totals[k] += v
            totals["time"] += t
            out.append(suite)
        totals["files"].append(per)
    for k in ("tests", "failures", "errors", "skipped"):
        out.set(k, str(totals[k]))
    out.set("time", "%.3f" % totals["time"])
    totals["time"] = round(totals["time"], 3)
    return ET.tostring(out, encoding="utf-8", xml_declaration=True) + b"\n", totals


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            src=dict(type="list", elements="path", required=True),
            names=dict(type="list", elements="str"),
            dest=dict(type="path", required=True),
            missing=dict(type="str", choices=["warn", "fail"], default="warn"),
            max_bytes=dict(type="int", default=16 * 1024 * 1024),
            max_elements=dict(type="int", default=1000000),
        ),
        supports_check_mode=True,
    )
    p = module.params
    names = p["names"] or [os.path.basename(os.path.dirname(s)) or s for s in p["src"]]
    if len(names) != len(p["src"]):
        module.fail_json(msg="names has %d entries and src %d: give one name per file" % (len(names), len(p["src"])))
    present, missing = [], []
    for name, path in zip(names, p["src"]):
        (present if os.path.lexists(path) else missing).append((name, path))
    if missing and p["missing"] == "fail":
        module.fail_json(msg="no JUnit file for %s" % ", ".join("%s (%s)" % m for m in missing),
                         missing=[m[1] for m in missing])
    for name, path in missing:
        module.warn("no JUnit file for %s (%s): left out of the merge" % (name, path))
    try:
        data, totals = merge(present, p["max_bytes"], p["max_elements"])
    except Refused as e:
        module.fail_json(msg="refused a JUnit file: %s" % e, missing=[m[1] for m in missing])
    dest = p["dest"]
    try:
        with open(dest, "rb") as f:
            changed = f.read() != data
    except OSError:
        changed = True
    if changed and not module.check_mode:
        folder = os.path.dirname(os.path.abspath(dest))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".junit-merge.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, dest)
        except BaseException:
            os.unlink(tmp)
            raise
    module.exit_json(changed=changed, dest=dest, missing=[m[1] for m in missing], **totals)


if __name__ == "__main__":
    main()
