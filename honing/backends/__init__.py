"""Where a run's processes run: this one, torchrun's ranks, or Ray actors (``launch.train``
chooses). The backends sit above the pipeline: they compose its loop, never the reverse."""
