"""What the commands need around the library: the shared flags and their spelling table (`flags`)
and the optional plotting extra (`plotting`). Only command modules (`cli.py`, `*_cli.py`) import
it; what library code needs from its process lives in `mcore_proxy.runtime`."""
