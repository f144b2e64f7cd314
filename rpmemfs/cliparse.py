"""argparse as every rpmemfs command uses it: a usage error is one line on stderr.

argparse prints the whole usage before its error, which buries the one line that says what
is wrong; rpmemfs says that line, where to look for the rest, and exits with status 2 (as
argparse does). The `rpmemfs` command and the tools it runs (bench, soak) build their
parsers from this class, so all of them answer a mistake the same way.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

USAGE_ERROR = 2


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("rpmemfs").strip()
        where = f"{command}: " if command else ""
        self.exit(USAGE_ERROR, f"rpmemfs: {where}{message} (see {self.prog} --help)\n")
