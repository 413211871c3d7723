"""make test's bindep step: bindep.txt must parse with bindep (as
ansible-builder's assemble step parses it), its default profile (what an
execution environment installs) must be empty on Debian, and its profiles
together must list exactly DEB_PACKAGES of the Makefile, so `make
system-deps` and bindep agree. Also checks that the execution environment's
Python requirements leave out the local plane's (aiohttp)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from bindep.depends import Depends

ROOT = Path(__file__).resolve().parent.parent
DEBIAN = ["platform:dpkg", "platform:debian", "default"]


def makefile_packages() -> set[str]:
    match = re.search(r"^DEB_PACKAGES := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    if not match:
        raise SystemExit("bindep-check: no DEB_PACKAGES line in the Makefile")
    return set(match.group(1).split())


def main() -> int:
    problems: list[str] = []
    bindep_bin = Path(sys.executable).parent / "bindep"
    # The command line ansible-builder runs: a parse error fails here.
    cli = subprocess.run([str(bindep_bin), "-f", str(ROOT / "bindep.txt"), "-l", "newline"],
                         capture_output=True, text=True, check=False)
    if "parsing error" in (cli.stdout + cli.stderr).lower():
        problems.append("bindep cannot parse bindep.txt:\n" + cli.stdout + cli.stderr)
        print("\n".join(problems))
        return 1
    depends = Depends((ROOT / "bindep.txt").read_text(), filename="bindep.txt")
    profiles = sorted(depends.profiles())
    default = [r[0] for r in depends.active_rules(DEBIAN)]
    if default:
        problems.append("the default profile (an execution environment) would install: " + " ".join(default))
    listed = {r[0] for r in depends.active_rules(["platform:dpkg", "platform:debian"] + profiles)}
    wanted = makefile_packages()
    if listed != wanted:
        problems.append("bindep.txt and DEB_PACKAGES differ: only in bindep.txt: %s; only in the Makefile: %s"
                        % (" ".join(sorted(listed - wanted)) or "-", " ".join(sorted(wanted - listed)) or "-"))
    ee_reqs = (ROOT / "requirements.txt").read_text().lower()
    if re.search(r"^aiohttp", ee_reqs, re.M):
        problems.append("requirements.txt (the execution environment's) lists aiohttp, which only the local plane needs")
    for p in problems:
        print("bindep-check: " + p)
    summary = "%d packages in %d profiles (%s), default profile %s" % (
        len(listed), len(profiles), " ".join(profiles), "empty" if not default else "NOT empty")
    print(("FAILED: " if problems else "") + summary)
    Path(ROOT / ".local/results").mkdir(parents=True, exist_ok=True)
    (ROOT / ".local/results/bindep.txt").write_text(summary + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
