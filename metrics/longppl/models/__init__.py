"""Where models come from and which they are: local path or Hub id (``sources``), loading a model
and its tokenizer on a device (``loading``), and the fingerprints that name a model and a text
(``fingerprints``)."""
