import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "module_utils"))

import collection_meta_repair  # noqa: E402

collection_meta_repair.repair()
