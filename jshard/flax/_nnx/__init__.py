"""The NNX adapter: a sharded module gathers its own parameters when called."""
