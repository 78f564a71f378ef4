# As the command line runs: numpy's CPU dispatch set before the tests load numpy (this package
# is imported before its conftest), and inherited by the pytest workers.
from tally.audit.core import cpu

cpu.tune()
