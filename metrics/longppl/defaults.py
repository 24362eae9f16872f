"""The library's default settings, in one place: the paper's values (Sec. 3.1, App. A).

A module of plain numbers that imports nothing, so that a script's ``--help`` can show them without
loading torch. ``key_tokens``, ``scoring`` and ``settings`` re-export them under the same names.
"""

DEFAULT_ALPHA = 2.0  # key iff LSD > alpha
DEFAULT_BETA = -2.0  # ... and LCL > beta
DEFAULT_GAMMA = 5.0  # cap of the soft / LongCE weight min(exp(LSD), gamma)
DEFAULT_TRUNC_LEN = 4096  # K, the short-context length
DEFAULT_SLIDING_WINDOW = 1024  # d, the stride of the short-context windows
DEFAULT_MAX_TOKENS_PER_BATCH = 32768  # token budget of one forward batch (results do not depend on it)
