"""`python -m stack`: run the dualtrack stack locally without Docker (see stack/demo.py)."""
import sys

from stack.demo import main

sys.exit(main())
