"""shown(): what a guest names or prints, made safe for the user's terminal (issue 34)."""
import os
import subprocess
import sys

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.untrusted import shown


@pytest.mark.parametrize("raw, expected", [
    ("plain name ☃ é 名前.txt", "plain name ☃ é 名前.txt"),  # printable text of any script is left alone
    ("clear\x1b[2J", "clear\\x1b[2J"),
    ("title\x1b]0;owned\x07", "title\\x1b]0;owned\\x07"),
    ("a\nb\tc\rd\x00", "a\\x0ab\\x09c\\x0dd\\x00"),  # a name: every control character, line breaks too
    ("del\x7f c1\x85\x9b", "del\\x7f c1\\x85\\x9b"),
    ("invoice\u202egpj.exe", "invoice\\u202egpj.exe"),
    ("\u202a\u202b\u202c\u202d \u2066\u2067\u2068\u2069 \u200e\u200f\u061c", "\\u202a\\u202b\\u202c\\u202d "
     "\\u2066\\u2067\\u2068\\u2069 \\u200e\\u200f\\u061c"),
    (b"bytes \xff\xfe\x1b ok \xe2\x98\x83", "bytes \\xff\\xfe\\x1b ok ☃"),  # undecodable bytes as the bytes they are
    ("surrogate-escaped \udcff", "surrogate-escaped \\xff"),  # a name decoded with surrogateescape
    (bytearray(b"x\x1by"), "x\\x1by"),
    ("back\\slash", "back\\slash"),
])
def test_names_show_controls_bidi_and_bad_bytes_as_escapes(raw, expected):
    assert shown(raw) == expected


def test_text_keeps_its_lines_and_tabs_but_not_escape_sequences():
    assert shown(b"su: Authentication failure\n\tline two\x1b[31m red\r\n", text=True) == \
        "su: Authentication failure\n\tline two\\x1b[31m red\\x0d\n"


def test_nothing_is_compiled_at_import_only_at_first_use():
    """Every task's worker imports this module, and most tasks never show a guest's text (issue 45: 0.4 ms a task)."""
    probe = ("import re\nseen = []\nreal = re.compile\n"
             "re.compile = lambda *a, **k: seen.append(a) or real(*a, **k)\n"
             "from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import untrusted\n"
             "at_import = len(seen)\nassert untrusted.shown('a\\x1bb') == 'a\\\\x1bb'\nprint(at_import, len(seen))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))).stdout.split()
    assert out == ["0", "1"]
