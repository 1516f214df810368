import sys

from casp_core.cli.main import main

sys.exit(main())
