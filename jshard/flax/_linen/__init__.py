"""The Linen adapter: a module transform (and method interception) that gathers per module."""
