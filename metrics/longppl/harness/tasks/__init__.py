"""The bundled LongPPL task YAMLs (``longppl.yaml``: the task ``longppl``), the folder
``longppl.harness.TASKS_PATH`` names. A package so that an entry point can name it: lm_eval's
``lm_eval.tasks`` group (setup.cfg) points at the package whose folder holds an installed
distribution's task YAMLs, and lm_eval reads every ``*.yaml`` under it."""
