"""Entry point: python -m microvm_localplane serve|up|down (the console script is microvm-localplane)."""
import sys

from .cli import main

sys.exit(main())
