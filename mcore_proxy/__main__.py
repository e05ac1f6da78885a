import sys

from mcore_proxy.cli import main

sys.exit(main())
