"""The process's run-time: stop signals, the garbage collector paused over a grid, progress,
terminal output, the loopback Prefect server."""
