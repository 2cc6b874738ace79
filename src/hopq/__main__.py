import sys

from hopq.cli import main

sys.exit(main())
