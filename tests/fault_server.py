"""``dinfer-rt serve`` with one planted fault, for the server's fault tests: a forward whose input
holds the token ``$DINFER_TEST_POISON`` raises, as a failing device kernel would. Everything else
is the real server. Every forward face is planted (a lone request runs the engine's lockstep
``forward`` / ``confidence``, requests at different blocks share ``forward_rows``)."""

import functools
import os
import sys

from dinfer_rt import cli
from dinfer_rt.model import Model

POISON = int(os.environ["DINFER_TEST_POISON"])


def _poisoned(real):
    @functools.wraps(real)
    def forward(self, input_ids, *args, **kwargs):
        if bool((input_ids == POISON).any()):
            raise RuntimeError(f"poisoned input: token {POISON} reached the kernel")
        return real(self, input_ids, *args, **kwargs)

    return forward


for _name in ("forward", "confidence", "forward_rows"):
    setattr(Model, _name, _poisoned(getattr(Model, _name)))

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
