import sys

from dinfer_rt.console import main

sys.exit(main())
