"""Moving paged KV blocks between processes: NIXL (UCX), TCP fallback, in-process.

The contract is in ``kvtransfer.base``; backends load lazily through
``get_backend`` (names in ``kvtransfer.registry``). The package imports nothing itself:
nothing imports NIXL until the nixl backend is asked for, nor torch until base is.
"""
