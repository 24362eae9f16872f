"""Key-token rules: which tokens are key (LSD/LCL, ``key_tokens``), how key tokens carry across
tokenizers (``alignment``), and how they are shown (``key_token_html``). Pure functions of
log-probabilities and character spans: no model runs here."""
