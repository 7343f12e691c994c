import sys

from mcore_offload.cli import main

sys.exit(main())
