"""Parallel scoring: an evaluator split over several GPUs (``tensor_parallel``), for models that
do not fit on one."""
