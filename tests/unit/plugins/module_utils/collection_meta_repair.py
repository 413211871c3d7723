"""Keep the collection importable when a test installs ansible's collection finder mid-session.

The suites import the collection as a plain package (conftest puts
.local/collections on sys.path). A test module that calls
init_plugin_loader() at import time installs the collection finder after the
package `ansible_collections.microvm.sandbox` was already imported that way,
without the metadata the finder expects; every later import of a subpackage
then fails with "collection metadata was not loaded". Giving the package its
runtime metadata, as the finder would have, keeps both import styles working.
The real fix is to install the finder before anything imports the collection.
"""
import os
import sys

import yaml

PACKAGE = "ansible_collections.microvm.sandbox"


def repair():
    pkg = sys.modules.get(PACKAGE)
    if pkg is None or getattr(pkg, "_collection_meta", None) is not None:
        return
    with open(os.path.join(list(pkg.__path__)[0], "meta", "runtime.yml")) as f:
        pkg._collection_meta = yaml.safe_load(f) or {}
