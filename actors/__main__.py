"""``python -m actors --learner HOST:PORT [overrides]`` (the same as ``dapo actor``)."""

from dapo.runtime import apply_service_env

apply_service_env()  # before torch / vLLM are imported: thread counts, in-process vLLM

if __name__ == "__main__":
    from actors.main import exit_without_teardown, main

    exit_without_teardown(main())
