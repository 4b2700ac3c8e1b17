"""``python -m mgpu_lab`` is the same CLI as ``mgpu-lab``."""
import sys

from .cli import main

sys.exit(main())
