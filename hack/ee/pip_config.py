"""Write the machine's pip configuration for a container build: the index
pip here uses (index-url, extra-index-url, trusted-host, from pip's config
files and PIP_* variables) and its CA bundle, so pip inside the execution
environment's build reaches the same index through the same TLS trust.
Local-only settings (file:// indexes, find-links directories, constraint
files of this machine) are left out: the container does not have them.

usage: pip_config.py OUTDIR   (writes OUTDIR/pip.conf and OUTDIR/ca.pem)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

KEEP = ("index-url", "extra-index-url", "trusted-host", "cert", "proxy", "timeout", "retries")
IN_CONTAINER = "/etc/microvm-ee-pip"


def machine_settings() -> dict[str, str]:
    """pip's own view of its configuration (files), then PIP_* variables over it."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    settings: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep and "." in key:
            settings[key.split(".", 1)[1]] = value.strip().strip("'\"")
    for key in KEEP:
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            settings[key] = env
    return settings


def main(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in machine_settings().items() if k in KEEP}
    for key in ("index-url", "extra-index-url"):
        if key in settings:
            urls = [u for u in settings[key].split() if not u.startswith("file:")]
            if urls:
                settings[key] = " ".join(urls)
            else:
                del settings[key]
    cert = settings.pop("cert", "") or "/etc/ssl/certs/ca-certificates.crt"
    if os.path.isfile(cert):
        shutil.copyfile(cert, outdir / "ca.pem")
        settings["cert"] = IN_CONTAINER + "/ca.pem"
    lines = ["# Written by hack/ee/pip_config.py from this machine's pip configuration.", "[global]"]
    lines += ["%s = %s" % (k, v) for k, v in sorted(settings.items())]
    (outdir / "pip.conf").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
