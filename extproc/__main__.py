import sys

from extproc.ops.cli import main

sys.exit(main())
