import sys

from dinfer_rt.cli import main

sys.exit(main())
