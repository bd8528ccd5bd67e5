"""``dinfer-rt serve`` with one planted fault, for the server's fault tests: a forward whose input
holds the token ``$DINFER_TEST_POISON`` raises, as a failing device kernel would. Everything else
is the real server."""

import os
import sys

from dinfer_rt import cli
from dinfer_rt.model import Model

POISON = int(os.environ["DINFER_TEST_POISON"])
_real = Model.forward_rows


def _poisoned(self, input_ids, *args, **kwargs):
    if bool((input_ids == POISON).any()):
        raise RuntimeError(f"poisoned input: token {POISON} reached the kernel")
    return _real(self, input_ids, *args, **kwargs)


Model.forward_rows = _poisoned

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
