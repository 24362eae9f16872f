"""Tests of training and cache writing across several processes, and the workers they launch.

The workers (``*_worker.py``) run as scripts under ``accelerate launch`` or ``python``, one per
process; the tests here (and the cache tests in ``tests/``) also import them as
``distributed.<worker>`` to run the single-process reference in the test's own process.
"""
