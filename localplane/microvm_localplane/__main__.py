"""Entry point: python -m microvm_localplane serve|up|down."""
import sys

from .cli import main

sys.exit(main())
