"""Key-token rules: which tokens are key (LSD/LCL, ``key_tokens``) and how key tokens carry across
tokenizers (``alignment``). Pure functions of log-probabilities and character spans: no model runs
here."""
