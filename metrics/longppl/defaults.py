"""Default settings shared by the scoring core, the key-token cache and the scripts.

A module of plain numbers that imports nothing, so that a script's ``--help`` can show them without
loading torch (``scoring`` re-exports them under the same names).
"""

DEFAULT_TRUNC_LEN = 4096  # K, the short-context length (paper: 4096)
DEFAULT_SLIDING_WINDOW = 1024  # d, the stride of the short-context windows
DEFAULT_MAX_TOKENS_PER_BATCH = 32768  # token budget of one forward batch
