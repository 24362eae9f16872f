"""What people look at: the key-token view (``key_token_html``), an HTML page of a text with its
key tokens marked and LSD / LCL on hover, click, tap or focus, which ``longppl-visualize`` writes
and the Space shows."""
