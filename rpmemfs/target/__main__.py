import sys

from rpmemfs.target.cli import main

sys.exit(main())
