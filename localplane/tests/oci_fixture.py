"""A tiny OCI image for template tests, built offline from host binaries.

The rootfs holds sh, cat and ls plus every shared library they, the host's
Python and its extension modules need (the local plane runs its agent with the
host's Python bound into the guest), a /marker file, and an empty /tmp.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

BINARIES = ("/usr/bin/dash", "/usr/bin/cat", "/usr/bin/ls", "/usr/bin/env")


def _needed_libs(paths):
    libs = set()
    for chunk in range(0, len(paths), 50):
        out = subprocess.run(["ldd", *paths[chunk:chunk + 50]], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            for part in line.split():
                if part.startswith("/") and ".so" in part and not part.endswith(":"):
                    libs.add(part)
    return libs


def build_rootfs(root, marker="from-oci-image"):
    for d in ("bin", "tmp", "etc", "workspace"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    shutil.copy2("/usr/bin/dash", os.path.join(root, "bin", "sh"))
    for b in BINARIES[1:]:
        shutil.copy2(b, os.path.join(root, "bin", os.path.basename(b)))
    real_python = os.path.realpath(sys.executable)
    objects = list(BINARIES) + [real_python]
    objects += glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "**", "*.so"), recursive=True)
    objects += glob.glob(os.path.join(sysconfig.get_paths()["platstdlib"], "lib-dynload", "*.so"))
    for lib in _needed_libs(objects):
        real = os.path.realpath(lib)
        dest = os.path.join(root, lib.lstrip("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if not os.path.exists(dest):
            shutil.copy2(real, dest)
    with open(os.path.join(root, "etc", "passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\n")
    with open(os.path.join(root, "marker"), "w") as f:
        f.write(marker + "\n")


def build_layout(workdir, tag="v1", marker="from-oci-image"):
    """-> 'oci:<layout>:<tag>' for an image whose /marker holds `marker`."""
    root = os.path.join(workdir, "rootfs")
    build_rootfs(root, marker)
    layer = os.path.join(workdir, "layer.tar")
    subprocess.run(["tar", "-C", root, "-cf", layer, "."], check=True)
    layout = os.path.join(workdir, "layout")
    if not os.path.isdir(layout):
        subprocess.run(["umoci", "init", "--layout", layout], check=True)
    subprocess.run(["umoci", "new", "--image", "%s:%s" % (layout, tag)], check=True)
    subprocess.run(["umoci", "raw", "add-layer", "--image", "%s:%s" % (layout, tag), layer], check=True)
    return "oci:%s:%s" % (layout, tag)
