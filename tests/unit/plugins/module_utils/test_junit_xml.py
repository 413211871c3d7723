# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""junit_merge's merge of JUnit files from untrusted sandboxes: counts recounted, hostile files refused whole."""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.microvm.sandbox.plugins.module_utils import junit_xml

ROOT = Path(__file__).resolve().parents[4]
SHARD_PLUGIN = ROOT / "playbooks" / "files"

PYTEST_STYLE = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0"
 skipped="0" tests="99" time="1.5" hostname="f1"><testcase classname="t" name="a" time="0.1"/>
<testcase classname="t" name="b"><failure message="x &amp; &lt;y&gt;">trace &#233;</failure></testcase>
<testcase classname="t" name="c"><skipped message="later"/></testcase></testsuite></testsuites>"""

BARE_SUITE = """<testsuite name="other" time="nan"><testcase name="d"><error message="e"/></testcase>
<!-- a comment --><?pi stuff?><testcase name="e"/></testsuite>"""


def params(tmp_path: Path, src: list[str], **kw: Any) -> dict[str, Any]:
    p = dict(src=src, names=None, dest=str(tmp_path / "out" / "junit.xml"), missing="warn", max_bytes=1 << 20,
             max_elements=10000)
    p.update(kw)
    return p


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name / "junit.xml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_merges_every_suite_renamed_and_recounts(tmp_path: Path) -> None:
    a = write(tmp_path, "shard-0", PYTEST_STYLE)
    b = write(tmp_path, "shard-1", BARE_SUITE)
    warnings: list[str] = []
    result = junit_xml.run(params(tmp_path, [a, b]), False, warnings.append)
    assert result["changed"] and not warnings, result
    # counted from the test cases: the file's tests="99" and time="nan" are not believed
    assert (result["tests"], result["failures"], result["errors"], result["skipped"]) == (5, 1, 1, 1)
    assert result["time"] == 1.5
    root = ET.parse(result["dest"]).getroot()
    assert root.tag == "testsuites" and root.get("tests") == "5"
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["shard-0/pytest", "shard-1/other"]
    assert suites[0].get("tests") == "3" and suites[0].get("hostname") == "f1"
    assert suites[0].find("testcase/failure").get("message") == "x & <y>"
    assert suites[0].find("testcase/failure").text == "trace \u00e9"
    assert "comment" not in Path(result["dest"]).read_text()
    # the same inputs again: nothing to write
    assert junit_xml.run(params(tmp_path, [a, b]), False, warnings.append)["changed"] is False


def test_check_mode_writes_nothing(tmp_path: Path) -> None:
    a = write(tmp_path, "s", PYTEST_STYLE)
    result = junit_xml.run(params(tmp_path, [a]), True, print)
    assert result["changed"] is True and not os.path.exists(result["dest"])


def test_a_missing_file_warns_or_fails(tmp_path: Path) -> None:
    a = write(tmp_path, "s", PYTEST_STYLE)
    gone = str(tmp_path / "nope" / "junit.xml")
    warnings: list[str] = []
    result = junit_xml.run(params(tmp_path, [a, gone], names=["one", "two"]), False, warnings.append)
    assert result["missing"] == [gone] and result["tests"] == 3 and "two" in warnings[0]
    failed = junit_xml.run(params(tmp_path, [a, gone], missing="fail"), False, warnings.append)
    assert failed["failed"] and gone in failed["msg"]


LAUGHS = """<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;">]><testsuite><testcase name="&lol3;"/></testsuite>"""
EXTERNAL = """<?xml version="1.0"?><!DOCTYPE t [<!ENTITY x SYSTEM "file:///etc/passwd">]>
<testsuite><testcase name="&x;"/></testsuite>"""
PARAMETER = """<?xml version="1.0"?><!DOCTYPE t [<!ENTITY % p SYSTEM "http://127.0.0.1:9/x.dtd"> %p;]><testsuite/>"""
UNDEFINED = """<testsuite><testcase name="&nope;"/></testsuite>"""


@pytest.mark.parametrize("text, reason", [
    (LAUGHS, "document type or entity declaration"),
    (EXTERNAL, "document type or entity declaration"),
    (PARAMETER, "document type or entity declaration"),
    (UNDEFINED, "not well-formed"),
    ("<testsuite><testcase>", "not well-formed"),
    ("<html><body/></html>", "not <testsuites> or <testsuite>"),
    ("<testsuite>" + "<x>" * 40 + "</x>" * 40 + "</testsuite>", "nested deeper than 32"),
    ("<testsuite>" + "<testcase/>" * 20000 + "</testsuite>", "more than max_elements"),
    ("<testsuite>" + "<testcase name='%s'/>" % ("a" * (2 << 20)) + "</testsuite>", "more than max_bytes"),
    ("", "not well-formed"),
])
def test_hostile_files_are_refused_and_nothing_is_written(tmp_path: Path, text: str, reason: str) -> None:
    good = write(tmp_path, "good", PYTEST_STYLE)
    bad = write(tmp_path, "shard-3", text)
    result = junit_xml.run(params(tmp_path, [good, bad]), False, print)
    assert result.get("failed"), result
    assert reason in result["msg"] and "shard-3" in result["msg"], result["msg"]
    assert not os.path.exists(tmp_path / "out" / "junit.xml")


def test_a_file_growing_while_read_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "s", "<testsuite>" + " " * 5000 + "</testsuite>")
    real_stat = os.stat
    monkeypatch.setattr(junit_xml.os, "stat", lambda p, *a, **k: os.stat_result((0,) * 6 + (10,) + (0,) * 3)
                        if p == path else real_stat(p, *a, **k))
    with pytest.raises(junit_xml.Refused, match="more than max_bytes"):
        junit_xml.parse_bounded(path, 1000, 100)


def pytest_in(folder: Path, index: int, count: int) -> tuple[int, str]:
    env = dict(os.environ, SHARD_INDEX=str(index), SHARD_COUNT=str(count),
               PYTHONPATH=str(SHARD_PLUGIN))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "microvm_ci_shard", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-o", "addopts=", "--rootdir", str(folder), "--junitxml",
                           str(folder / ("j%d.xml" % index)), str(folder / "t_cases.py")],
                          capture_output=True, text=True, env=env, cwd=str(folder), timeout=120, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_shard_plugin_splits_a_suite_into_disjoint_shards_that_cover_it(tmp_path: Path) -> None:
    (tmp_path / "t_cases.py").write_text("".join("def test_%02d():\n    pass\n" % i for i in range(10)))
    ran: list[str] = []
    for index in range(3):
        rc, out = pytest_in(tmp_path, index, 3)
        assert rc == 0, out
        cases = [c.get("name") for c in ET.parse(str(tmp_path / ("j%d.xml" % index))).getroot().iter("testcase")]
        assert len(cases) in (3, 4), cases
        ran += cases
    assert sorted(ran) == ["test_%02d" % i for i in range(10)]


def test_the_shard_plugin_refuses_a_bad_index(tmp_path: Path) -> None:
    (tmp_path / "t_cases.py").write_text("def test_a():\n    pass\n")
    rc, out = pytest_in(tmp_path, 3, 3)
    assert rc != 0 and "need 0 <= SHARD_INDEX < SHARD_COUNT" in out, out
