"""docs/playbooks.md describes every playbook in playbooks/, and counts them right (issue 42: it said seven of nine)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "playbooks.md"
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
           "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15}


def shipped():
    return sorted(p.stem for p in (ROOT / "playbooks").glob("*.yml"))


def test_the_count_in_the_doc_is_the_number_of_playbooks():
    m = re.search(r"ships (\w+) playbooks", DOC.read_text())
    assert m, "docs/playbooks.md no longer says how many playbooks the collection ships"
    said = int(m.group(1)) if m.group(1).isdigit() else NUMBERS.get(m.group(1).lower())
    assert said == len(shipped()), "docs/playbooks.md says %s playbooks; playbooks/ has %d: %s" % (
        m.group(1), len(shipped()), ", ".join(shipped()))


def test_every_playbook_has_its_section_and_every_section_its_playbook():
    sections = sorted(re.findall(r"^## microvm\.sandbox\.(\w+)\s*$", DOC.read_text(), re.M))
    assert sections == shipped(), "sections in docs/playbooks.md: %s; playbooks/: %s" % (sections, shipped())
