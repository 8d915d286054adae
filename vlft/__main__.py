import sys

from vlft.cli import main

sys.exit(main())
