"""The built-in tasks: rows made offline, no download (``data.train_path=builtin:...``).

- ``addition``: three-digit addition worked column by column (``builtin``, the embedded default), its
  calculator variant (``builtin:calc``) and its long chains (``builtin:long``);
- ``arith``: small arithmetic asked in words, for a small instruct model (``builtin:arith``);
- ``coding``: small Python functions graded by unit tests in the sandbox (``builtin:code``).

Pure: rows only; their verifiers live in ``dapo.rewards`` and their environments in ``dapo.envs``.
"""
