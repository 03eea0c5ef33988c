"""The zinf runtime: what the graph's zinf ops call.  Imports no FX."""
