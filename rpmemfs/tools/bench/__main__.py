import sys

from rpmemfs.tools.bench import main

sys.exit(main())
