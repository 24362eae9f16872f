"""The key-token cache: an evaluator's scores of a corpus as a ``datasets.Dataset`` on disk
(``key_token_cache``), to evaluate many models at the cost of one perplexity pass each."""
