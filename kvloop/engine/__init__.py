"""The engine core's assembly (`build`) and its process (`proc`: `python -m
kvloop.engine.proc`). Importing the package imports neither."""
