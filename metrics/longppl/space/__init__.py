"""The Hub Space's app (``app``): the Gradio page over the metric, with its limits as a public
server. The Space's own ``app.py`` is a thin shell that runs it."""
