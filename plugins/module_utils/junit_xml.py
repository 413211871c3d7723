# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Merging JUnit XML files that came out of untrusted sandboxes (microvm.sandbox.junit_merge).

Each file is hostile input: bounded in size before and while it is read, parsed by expat with every DTD, entity
declaration and external entity refused (so nothing is ever expanded), bounded in depth and element count, and its
counts are recounted from its test cases.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import math
import os
import tempfile
import xml.etree.ElementTree as ET
from typing import Any, Callable, NoReturn
from xml.parsers import expat


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

    def refuse(*_args: Any) -> NoReturn:
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


def write_if_changed(dest: str, data: bytes, check_mode: bool = False) -> bool:
    """Write data to dest atomically (temporary file, rename) unless dest holds it already; -> changed."""
    try:
        with open(dest, "rb") as f:
            if f.read(len(data) + 1) == data:
                return False
    except OSError:
        pass
    if check_mode:
        return True
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
    return True


ARGUMENT_SPEC: dict[str, Any] = dict(
    src=dict(type="list", elements="path", required=True),
    names=dict(type="list", elements="str"),
    dest=dict(type="path", required=True),
    missing=dict(type="str", choices=["warn", "fail"], default="warn"),
    max_bytes=dict(type="int", default=16 * 1024 * 1024),
    max_elements=dict(type="int", default=1000000),
)


def run(params: dict[str, Any], check_mode: bool, warn: Callable[[str], None]) -> dict[str, Any]:
    """The task's result for validated params (ARGUMENT_SPEC); failures come back with failed=True and msg."""
    names = params["names"] or [os.path.basename(os.path.dirname(s)) or s for s in params["src"]]
    if len(names) != len(params["src"]):
        return dict(failed=True, msg="names has %d entries and src %d: give one name per file" % (
            len(names), len(params["src"])))
    present: list[tuple[str, str]] = []
    missing: list[tuple[str, str]] = []
    for name, path in zip(names, params["src"]):
        (present if os.path.lexists(path) else missing).append((name, path))
    gone = [m[1] for m in missing]
    if missing and params["missing"] == "fail":
        return dict(failed=True, msg="no JUnit file for %s" % ", ".join("%s (%s)" % m for m in missing), missing=gone)
    for name, path in missing:
        warn("no JUnit file for %s (%s): left out of the merge" % (name, path))
    try:
        data, totals = merge(present, params["max_bytes"], params["max_elements"])
    except Refused as e:
        return dict(failed=True, msg="refused a JUnit file: %s" % e, missing=gone)
    changed = write_if_changed(params["dest"], data, check_mode)
    return dict(changed=changed, dest=params["dest"], missing=gone, **totals)
