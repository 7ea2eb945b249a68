"""The training step in the local view: gathers, gradient reduction, remat, segments, scan."""
