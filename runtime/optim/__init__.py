"""The optimizer: one torch optimizer over this rank's master shards, wherever they rest (device, host memory,
NVMe), with the steps it takes during backward.  Part of the runtime: it is handed the store it steps (see
optimizer.py's OptimizerParts); zinf_compiler/optim.py holds the public classes that hand it the process's."""
