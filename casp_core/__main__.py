import sys

from casp_core.cli import main

sys.exit(main())
