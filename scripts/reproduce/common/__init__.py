"""What the reproduction's experiments share: tasks, the model family, the stages, statistics, run folders,
books and config pieces (the package docstring of ``longppl_reproduce`` lists them). Nothing here imports
an experiment."""
