import sys

from rpmemfs.bench import main

sys.exit(main())
