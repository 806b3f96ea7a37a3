"""``python -m actors --learner HOST:PORT [overrides]`` (the same as ``dapo actor``)."""

import logging
import os
import sys

from dapo.runtime import apply_service_env

apply_service_env()  # before torch / vLLM are imported: thread counts, in-process vLLM

if __name__ == "__main__":
    from actors.main import main

    code = main()
    # Everything was closed explicitly in main(). Skip the interpreter's teardown: native threads
    # that cannot be interrupted (a c10d store wait of the collective weight receiver) abort the
    # process there ("terminate called without an active exception") instead of exiting 0.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
