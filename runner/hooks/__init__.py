"""The methods' training glue: the `runner.train.fit` hooks (batch transforms, losses, per-epoch passes)
and feature passes that wire the pure solvers of `runner.methods` into the loop. The import graph reads
solvers (`runner.methods`) -> loop (`runner.train`) -> hooks (here) -> tasks (`tasks/`)."""
