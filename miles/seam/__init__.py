"""The seam between the gateway and whatever runs models: the `Runtime` protocol (`runtime`), what a
runtime may offer beyond it (`capabilities`), and the requests its training calls take (`requests`).

The gateway, the catalog and the runtimes (`miles.runtime`: Ray cells, one process) import this package;
it imports only the runtime's data types (`miles.types`) and the error family.
"""
