"""One module per weight format: its data checks and its forward (see `moeroute.experts`)."""
