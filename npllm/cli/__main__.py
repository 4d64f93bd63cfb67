"""python -m npllm.cli: the same as python -m npllm."""

import sys

from . import main

sys.exit(main())
